"""Dynamic sampling end to end on prompts of known difficulty (see tests/scripts/dynamic_sampling_run.py)."""

import json
from collections import Counter, defaultdict

import numpy as np
import pytest
import torch

from .helpers import (
    SCRIPTS,
    python_command,
    read_jsonl,
    run_command,
    run_unchecked,
    step_metrics,
    trained_by_step,
)

pytestmark = pytest.mark.e2e
SCRIPT = str(SCRIPTS / "dynamic_sampling_run.py")
GROUP = 4


def run(out, per_device: int, steps: int, *overrides: str, processes: int = 1):
    return run_command(
        python_command(SCRIPT, str(out), str(per_device), str(steps), *overrides, num_processes=processes)
    )


@pytest.mark.parametrize("iterable", [False, True], ids=["map-style", "IterableDataset"])
def test_every_trained_group_has_spread_and_the_batch_is_exact(tmp_path, iterable):
    out = tmp_path / "run"
    run(out, 8, 3, "mixed_share=0.25", "save_strategy=steps", "save_steps=2", f"iterable={iterable}")
    trained = trained_by_step(out)
    assert sorted(trained) == [0, 1, 2]
    for rows in trained.values():
        assert len(rows) == 8  # exactly the target: 2 groups of 4
        per_prompt = defaultdict(list)
        for prompt, advantage, _ in rows:
            per_prompt[prompt].append(advantage)
        assert all(prompt.startswith("mixed") for prompt in per_prompt)
        for advantages in per_prompt.values():
            assert len(advantages) == GROUP and min(advantages) < 0 < max(advantages)
    metrics = step_metrics(out)
    assert len(metrics) == 3
    for entry in metrics:
        assert entry["dynamic_sampling/groups_kept"] >= 2
        assert entry["dynamic_sampling/keep_rate"] == pytest.approx(
            entry["dynamic_sampling/groups_kept"] / entry["dynamic_sampling/groups_generated"]
        )
        assert entry["dynamic_sampling/filler_groups"] == 0
    assert sum(entry["dynamic_sampling/rounds"] for entry in metrics) > 3  # a 25% keep rate needs extra rounds
    # Accounting is in optimizer steps whatever the rounds: the linear LR schedule spans 3 steps, a checkpoint
    # is written at save_steps and at the end (verl #991, #2619), each with the sampling state.
    assert [entry["learning_rate"] for entry in metrics] == pytest.approx([1e-6, 2e-6 / 3, 1e-6 / 3])
    for step in (2, 3):
        assert (out / "run" / f"checkpoint-{step}" / "dapo_sampling_state.pt").exists()


def test_exhausted_rounds_raise_with_the_fix(tmp_path):
    command = python_command(
        SCRIPT,
        str(tmp_path / "run"),
        "8",
        "2",
        "mixed_share=0",
        "max_filter_gen_batches=2",
        "filter_groups_on_exhausted=error",
    )
    result = run_unchecked(command, timeout=300)
    assert result.returncode != 0
    assert "kept 0 of the 2 groups a step needs after 2 rounds" in result.stderr
    assert "raise max_filter_gen_batches" in result.stderr


def test_exhausted_rounds_fill_with_inert_groups(tmp_path):
    out = tmp_path / "run"
    run(out, 8, 2, "mixed_share=0", "max_filter_gen_batches=2")
    for rows in trained_by_step(out).values():
        assert len(rows) == 8
        assert all(advantage == 0 and tokens == 0 for _, advantage, tokens in rows)  # no loss, no denominator
    for entry in step_metrics(out):
        assert entry["dynamic_sampling/filler_groups"] == 2 and entry["dynamic_sampling/rounds"] == 2


def test_oversampling_and_carried_surplus(tmp_path):
    out = tmp_path / "run"
    run(out, 8, 3, "mixed_share=0.5", "filter_groups_oversample=3", "filter_groups_carry_surplus=true")
    metrics = step_metrics(out)
    assert metrics[0]["dynamic_sampling/groups_generated"] == 6  # 3 generation batches of 2 groups in round 1
    carried = [entry["dynamic_sampling/surplus_carried_groups"] for entry in metrics]
    carried_in = [entry["dynamic_sampling/carried_in_groups"] for entry in metrics]
    assert carried_in[1:] == carried[:-1] and carried_in[0] == 0
    assert any(carried)
    for entry in metrics:  # only this step's groups are carried: the backlog and staleness stay one step
        assert entry["dynamic_sampling/surplus_carried_groups"] <= entry["dynamic_sampling/groups_kept"]
    for rows in trained_by_step(out).values():
        assert len(rows) == 8 and all(prompt.startswith("mixed") for prompt, _, _ in rows)


@pytest.mark.parametrize("iterable", [False, True], ids=["map-style", "IterableDataset"])
def test_two_processes_with_straddling_groups_match_one_process(tmp_path, iterable):
    # 12 rows of groups of 4 over 2 processes: 6 rows each, so the second group straddles the process boundary.
    # With an IterableDataset, both processes read the whole stream and draw the same fresh prompts.
    one, two = tmp_path / "one", tmp_path / "two"
    run(one, 12, 3, "mixed_share=0.3", f"iterable={iterable}")
    run(two, 6, 3, "mixed_share=0.3", f"iterable={iterable}", processes=2)
    trained_one, trained_two = trained_by_step(one), trained_by_step(two, processes=2)
    assert sorted(trained_one) == sorted(trained_two) == [0, 1, 2]
    for step in trained_one:
        rank_rows = [[r for r in read_jsonl(two / f"trained_rank{rank}.jsonl") if r["step"] == step] for rank in (0, 1)]
        assert sum(len(r["prompts"]) for r in rank_rows[0]) == sum(len(r["prompts"]) for r in rank_rows[1]) == 6
        assert Counter(p for p, _, _ in trained_one[step]) == Counter(p for p, _, _ in trained_two[step])
    metrics_one, metrics_two = step_metrics(one), step_metrics(two)
    for a, b in zip(metrics_one, metrics_two, strict=True):
        assert a["dynamic_sampling/rounds"] == b["dynamic_sampling/rounds"]
        assert a["dynamic_sampling/groups_kept"] == b["dynamic_sampling/groups_kept"]


def prompts_seen(out) -> list[tuple[int, tuple[str, ...]]]:
    return [(r["step"], tuple(r["prompts"])) for r in read_jsonl(out / "prompts_seen_rank0.jsonl")]


@pytest.mark.parametrize("iterable", [True], ids=["IterableDataset"])
def test_kill_and_resume_sees_the_same_prompts(tmp_path, iterable):
    """With an IterableDataset, the checkpoint holds the stream's exact position: shard, offset, buffered rows and
    the shuffle's random state (datasets' own shuffled-stream state_dict drops the buffer). A map-style dataset
    killed and resumed: tests/test_preemption.py (the final weights, bit for bit)."""
    common = (
        "mixed_share=0.3",
        "filter_groups_carry_surplus=true",
        "filter_groups_oversample=2",
        "save_strategy=steps",
        "save_steps=2",
        f"iterable={iterable}",
    )
    full, crashed = tmp_path / "full", tmp_path / "crashed"
    run(full, 8, 4, *common)
    result = run_unchecked(python_command(SCRIPT, str(crashed), "8", "4", *common, "crash_after_save=2"), timeout=300)
    assert result.returncode == 3, result.stderr[-2000:]
    checkpoint = crashed / "run" / "checkpoint-2"
    assert (checkpoint / "dapo_sampling_state.pt").exists()
    run(crashed, 8, 4, *common, f"resume={checkpoint}")
    seen_full = [entry for entry in prompts_seen(full) if entry[0] >= 2]
    seen_resumed = [entry for entry in prompts_seen(crashed) if entry[0] >= 2]
    assert seen_resumed and seen_resumed == seen_full
    trained_full, trained_resumed = trained_by_step(full), trained_by_step(crashed)
    for step in (2, 3):
        assert Counter(p for p, _, _ in trained_full[step]) == Counter(p for p, _, _ in trained_resumed[step])


# ------------------------------------------------------------------------ scale_rewards="batch" on the final batch
def records(out, processes: int = 1) -> list[dict]:
    return [record for rank in range(processes) for record in read_jsonl(out / f"trained_rank{rank}.jsonl")]


def reward_of(prompt: str, ids: list[int]) -> float:
    """A row's shaped reward under the script's reward=ids: accuracy (easy +1, hard -1, mixed +1 when the completion's
    ids sum to an even number, else -1) plus 0.1 x (sum of ids mod 7), both with weight 1."""
    kind = prompt.split()[0]
    accuracy = 1.0 if kind == "easy" else -1.0 if kind == "hard" else (1.0 if sum(ids) % 2 == 0 else -1.0)
    return accuracy + 0.1 * (sum(ids) % 7)


def reference_batch_advantages(rewards: list[float], groups: list[str]) -> list[float]:
    """TRL's scale_rewards="batch" written out with numpy: (R - group mean) / (sample std of the batch + 1e-4)."""
    values = np.array(rewards, dtype=np.float64)
    std = values.std(ddof=1)
    means = {group: values[[g == group for g in groups]].mean() for group in set(groups)}
    return [(value - means[group]) / (std + 1e-4) for value, group in zip(values, groups, strict=True)]


@pytest.mark.parametrize(
    "overrides",
    [
        ("mixed_share=0.5", "max_filter_gen_batches=0", "filter_groups_carry_surplus=true"),
        ("mixed_share=0.2", "max_filter_gen_batches=1"),
    ],
    ids=["several-rounds-and-carried-groups", "with-filler"],
)
def test_batch_scaled_advantages_are_over_the_final_batch(tmp_path, overrides):
    """Every trained row's advantage is TRL's batch formula over the rows actually trained in that step (filler
    left out): rewards vary within groups (reward=ids), and kept groups come from several rounds."""
    out = tmp_path / "run"
    run(out, 8, 3, "reward=ids", "scale_rewards=batch", *overrides)
    steps = defaultdict(list)
    for record in records(out):
        columns = ("prompts", "completion_ids", "advantages", "active_tokens")
        steps[record["step"]].extend(zip(*(record[column] for column in columns), strict=True))
    filler_rows, trained_steps = 0, 0
    for rows in steps.values():
        assert len(rows) == 8
        trained = [row for row in rows if row[3] > 0]
        filler_rows += len(rows) - len(trained)
        assert all(advantage == 0 for _, _, advantage, tokens in rows if tokens == 0)
        if not trained:
            continue
        trained_steps += 1
        assert Counter(prompt for prompt, *_ in trained).most_common(1)[0][1] == GROUP  # one group per prompt
        expected = reference_batch_advantages([reward_of(p, ids) for p, ids, _, _ in trained], [p for p, *_ in trained])
        assert [advantage for _, _, advantage, _ in trained] == pytest.approx(expected, rel=1e-5, abs=1e-5)
    assert trained_steps and (filler_rows > 0) == ("max_filter_gen_batches=1" in overrides)


# ------------------------------------------------------------------------- optimizer steps across generations
def test_optimizer_steps_spanning_generation_batches_have_exact_denominators(tmp_path):
    """steps_per_generation=3, gradient_accumulation_steps=2: every other optimizer step trains the last micro-batch
    of one generation batch and the first of the next; each micro-batch's num_items is its optimizer step's exact
    token count (x S / K for TRL's normaliser)."""
    out = tmp_path / "run"
    run(out, 4, 3, "mixed_share=0.5", "steps_per_generation=3", "gradient_accumulation_steps=2")
    micro_batches = records(out)
    assert len(micro_batches) == 6
    for first in range(0, 6, 2):
        window = micro_batches[first : first + 2]
        tokens = sum(sum(record["active_tokens"]) for record in window)
        assert [record["num_items"] for record in window] == pytest.approx([tokens * 3 / 2] * 2)
    assert sum(entry["dynamic_sampling/rounds"] for entry in step_metrics(out)) >= 2  # two generation batches


# ------------------------------------------------------------------------------------- steps with nothing to train
def snapshot(out, name: str) -> dict:
    return torch.load(out / f"snapshot_{name}.pt")


def assert_identical(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]) if torch.is_tensor(a[key]) else a[key] == b[key], key


SGD_LIKE_ADAMW = ("learning_rate=0.01", "weight_decay=0.1", "lr_scheduler_type=linear")


def test_all_filler_steps_leave_weights_and_optimizer_untouched_on_two_processes(tmp_path):
    """Every group is all-wrong: each step is zero-advantage filler without a loss token. Both processes skip the
    optimizer step together; global_step and the LR schedule still advance; skipped_steps counts them."""
    out = tmp_path / "run"
    run(out, 4, 2, "mixed_share=0", "max_filter_gen_batches=2", "snapshots=true", *SGD_LIKE_ADAMW, processes=2)
    start, end = snapshot(out, "start"), snapshot(out, "2")
    assert_identical(start["params"], end["params"])
    assert start["optimizer"] == end["optimizer"] == {}  # AdamW never stepped: no moments, no step count
    metrics = step_metrics(out)
    assert [entry["skipped_steps"] for entry in metrics] == [1.0, 1.0]
    assert [entry["learning_rate"] for entry in metrics] == pytest.approx([0.01, 0.005])  # the schedule advances
    assert [entry["step"] for entry in metrics] == [1, 2]


@pytest.mark.parametrize("skip_empty", [True, False], ids=["skipped", "control-without-skipping"])
def test_a_skipped_step_keeps_weight_decay_and_momentum_from_acting(tmp_path, skip_empty):
    """Step 1 trains (every prompt mixed; AdamW moments, weight decay 0.1); from step 2 every reward is constant, so
    steps 2 and 3 are filler only. Skipped, they leave weights, exp_avg, exp_avg_sq and the step count
    bit-identical; the control without skipping shows that they would otherwise move (decay, moment decay)."""
    out = tmp_path / "run"
    run(
        out,
        8,
        3,
        "mixed_share=1.0",
        "max_filter_gen_batches=1",
        "constant_from_step=1",
        "snapshots=true",
        *SGD_LIKE_ADAMW,
        f"skip_empty={skip_empty}",
    )
    start, first, last = snapshot(out, "start"), snapshot(out, "1"), snapshot(out, "3")
    assert not torch.equal(start["params"]["lm_head.weight"], first["params"]["lm_head.weight"])  # step 1 trained
    assert any(key.endswith(".step") for key in first["optimizer"])
    if skip_empty:
        assert_identical(first["params"], last["params"])
        assert_identical(first["optimizer"], last["optimizer"])
    else:
        assert not torch.equal(first["params"]["lm_head.weight"], last["params"]["lm_head.weight"])
        assert any(not torch.equal(first["optimizer"][key], last["optimizer"][key]) for key in first["optimizer"])
    if skip_empty:
        assert [entry["skipped_steps"] for entry in step_metrics(out)] == [0.0, 1.0, 1.0]


def test_every_completion_masked_by_overlong_filtering_skips_the_step(tmp_path):
    """Without dynamic sampling: every completion is truncated and `mask_truncated_completions` masks it, so the
    step has no loss token and is skipped."""
    out = tmp_path / "run"
    run(out, 8, 2, "filter_groups_enable=false", "mask_truncated_completions=true", "snapshots=true", *SGD_LIKE_ADAMW)
    history = [entry for entry in json.loads((out / "log_history.json").read_text()) if "skipped_steps" in entry]
    assert [entry["completions/clipped_ratio"] for entry in history] == [1.0, 1.0]  # the precondition
    assert [entry["skipped_steps"] for entry in history] == [1.0, 1.0]
    assert_identical(snapshot(out, "start")["params"], snapshot(out, "2")["params"])
