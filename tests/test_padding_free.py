"""Padding-free training (the default) gives the same parameter update as TRL's padded micro-batches.

The fixed-batch layouts of test_denominator (`run_layout` in tests/helpers.py: plain SGD, lr 1, so the update is minus
the gradient) run once with `padding_free=false` (TRL's padded micro-batches) and once padding-free, packed rows, with
and without a token budget that splits micro-batches into several backward passes; prompts are left-padded to
different lengths and a third of the rows carry a masked tool reply. Dynamic sampling runs with groups straddling two
processes compare the final weights and the logged metrics, also with sequence parallelism over the 2 processes.
"""

import json

import pytest
import torch

from .helpers import SCRIPTS, python_command, run_command, run_layout

pytestmark = pytest.mark.e2e
LOGGED = ("entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")


def assert_same_update(expected: dict, actual: dict) -> None:
    for name, value in expected.items():
        torch.testing.assert_close(actual[name], value, atol=1e-6, rtol=0, msg=lambda m, n=name: f"{n}: {m}")


def logged(out, names=LOGGED) -> list[dict]:
    history = json.loads((out / "log_history.json").read_text())
    return [{name: entry[name] for name in names if name in entry} for entry in history if "loss" in entry]


@pytest.fixture(scope="module")
def padded_layout(tmp_path_factory):
    """TRL's padded run of a layout, run once per layout for the module (the budget cases share theirs)."""
    runs = {}

    def run(*layout: int):
        if layout not in runs:
            runs[layout] = run_layout(tmp_path_factory.mktemp("padded"), *layout, "padding_free=false")
        return runs[layout]

    return run


@pytest.mark.parametrize(
    "processes,accumulation,steps_per_generation,budget",
    [(1, 4, 4, None), (1, 2, 4, None), (2, 2, 2, None), (1, 4, 4, 20), (2, 2, 2, 10)],
    ids=["1proc-K4-S4", "1proc-K2-S4", "2proc-K2-S2", "1proc-budget", "2proc-budget"],
)
def test_padding_free_update_equals_padded(
    tmp_path, padded_layout, processes, accumulation, steps_per_generation, budget
):
    layout = (tmp_path, processes, accumulation, steps_per_generation)
    padded, padded_rows, padded_model = padded_layout(processes, accumulation, steps_per_generation)
    extra = () if budget is None else (f"max_tokens_per_microbatch={budget}",)
    packed, packed_rows, packed_model = run_layout(*layout, *extra)
    assert sorted(padded_rows) == sorted(packed_rows)  # the same rows in the optimizer step
    assert_same_update(padded, packed)
    off, on = logged(padded_model.parent), logged(packed_model.parent)
    for a, b in zip(off, on, strict=True):
        assert a.keys() == b.keys() and all(b[k] == pytest.approx(a[k], abs=1e-6) for k in a)


def test_dynamic_sampling_with_straddling_groups_on_two_processes(tmp_path):
    """12 rows of groups of 4 on 2 processes (the second group straddles them); rows dealt by tokens when on. With
    sequence parallelism (the 2 processes one group, every forward sharded) the 2 steps give the same weights."""
    script = str(SCRIPTS / "dynamic_sampling_run.py")
    sgd = ("optim=sgd", "learning_rate=1.0", "weight_decay=0.0", "max_grad_norm=0.0", "mixed_share=0.3")
    runs = {}
    for name, extra in (("off", ("padding_free=false",)), ("on", ()), ("sp", ("sequence_parallel_size=2",))):
        runs[name] = tmp_path / name
        run_command(python_command(script, str(runs[name]), "6", "2", *sgd, *extra, num_processes=2))
    for name in ("on", "sp"):
        assert_same_update(torch.load(runs["off"] / "final_params.pt"), torch.load(runs[name] / "final_params.pt"))
    assert all(int((runs["sp"] / f"sharded_forwards_rank{rank}.txt").read_text()) > 0 for rank in range(2))
    names = (*LOGGED, "completions/mean_length", "completions/max_length", "dynamic_sampling/groups_kept")
    for a, b, c in zip(*(logged(runs[name], names) for name in runs), strict=True):
        assert a.keys() == b.keys() == c.keys()
        assert all(b[k] == pytest.approx(a[k], abs=1e-6) and c[k] == pytest.approx(a[k], abs=1e-5) for k in a)


def test_a_row_averaged_loss_split_by_processes_shards_and_budget_trains_the_padded_update(tmp_path):
    """loss_type grpo (each row's token mean, then the rows): 2 processes padded, against 2 processes as one
    sequence-parallel group with a token budget of 24 (several backward passes): the same weights after 2 steps."""
    script = str(SCRIPTS / "dynamic_sampling_run.py")
    sgd = ("optim=sgd", "learning_rate=1.0", "weight_decay=0.0", "max_grad_norm=0.0", "mixed_share=0.3")
    sgd += ("loss_type=grpo",)
    runs = {"off": ("padding_free=false",), "split": ("sequence_parallel_size=2", "max_tokens_per_microbatch=24")}
    for name, extra in runs.items():
        run_command(python_command(script, str(tmp_path / name), "6", "2", *sgd, *extra, num_processes=2))
    padded, split = (torch.load(tmp_path / name / "final_params.pt") for name in runs)
    assert_same_update(padded, split)


class _OneProcess:
    """What StepPlanner needs of an accelerator, for one process."""

    device = torch.device("cpu")

    @staticmethod
    def reduce(tensor, reduction):
        return tensor


def test_budget_splits_a_micro_batch_and_keeps_long_rows_whole(caplog):
    from dapo_trl import DAPOConfig
    from dapo_trl.training.step.batching import StepPlanner, fed_tokens

    from .scripts.denominator_run import fixed_global_batch

    batch = {k: v for k, v in fixed_global_batch(500).items()}
    config = DAPOConfig(
        output_dir="unused",
        per_device_train_batch_size=16,
        num_generations=2,
        max_tokens_per_microbatch=10,
        report_to="none",
    )
    planner = StepPlanner(config, _OneProcess(), "dapo")
    with caplog.at_level("WARNING"):
        (planned,) = planner.plan([batch])
    assert "exceeds max_tokens_per_microbatch=10" in caplog.text
    parts = planner.parts(planned)
    assert len(parts) == planned["backward_passes"] > 1
    assert sorted(i for part in parts for i in part["row_index"].tolist()) == list(range(16))  # nothing dropped
    for part in parts:
        tokens = fed_tokens(part)
        assert int(tokens.sum()) <= 10 or len(tokens) == 1  # within the budget, or one long row alone
    assert sum(int((p["completion_mask"] * p["tool_mask"]).sum()) for p in parts) == int(
        (batch["completion_mask"] * batch["tool_mask"]).sum()
    )
