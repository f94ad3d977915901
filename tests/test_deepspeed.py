"""DeepSpeed ZeRO-3 under Accelerate with two real processes on CPU (DeepSpeed falls back to gloo).

The config shards every parameter (`stage3_param_persistence_threshold: 0`; the test checks each process holds
none of them whole). The optimizer update must equal paper Eq. 11's gradient and the 1-process DDP update,
dynamic sampling must take the same decisions as a one-process run, and a LoRA run must train the adapter alone.
"""

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from .helpers import (
    REPO,
    SCRIPTS,
    assert_update_is_minus_gradient,
    python_command,
    reference_gradient,
    run_command,
    run_layout,
    step_metrics,
    trained_by_step,
)

pytestmark = pytest.mark.e2e
ZERO3 = str(REPO / "configs" / "deepspeed" / "zero3_cpu_test.json")


@pytest.fixture(autouse=True)
def deepspeed_installed():
    """The install command (pip install -e '.[dev,deepspeed]') installs DeepSpeed: missing, these tests fail."""
    if importlib.util.find_spec("deepspeed") is None:
        pytest.fail("DeepSpeed is not installed: pip install -e '.[dev,deepspeed]'", pytrace=False)


def test_zero3_update_is_exact_and_matches_ddp(tmp_path):
    out = tmp_path / "zero3"
    run_command(
        python_command(str(SCRIPTS / "denominator_run.py"), str(out), "2", "2", num_processes=2, deepspeed_config=ZERO3)
    )
    for rank in (0, 1):
        shards = json.loads((out / f"zero3_rank{rank}.json").read_text())
        assert shards["local_numel"] == 0 and shards["total_numel"] > 100_000  # really partitioned
    delta = torch.load(out / "delta.pt")
    rows = [row for rank in (0, 1) for batch in torch.load(out / f"rows_rank{rank}.pt")["rows"] for row in batch]
    assert sorted(rows) == list(range(16))
    assert_update_is_minus_gradient(delta, reference_gradient(out / "model", rows))
    ddp_delta, _, _ = run_layout(tmp_path, 1, 4, 4)
    for name in delta:
        torch.testing.assert_close(delta[name], ddp_delta[name], atol=2e-5, rtol=2e-3)


def test_zero3_dynamic_sampling_matches_one_process(tmp_path):
    one, zero3 = tmp_path / "one", tmp_path / "zero3"
    script = str(SCRIPTS / "dynamic_sampling_run.py")
    run_command(python_command(script, str(one), "8", "2", "mixed_share=0.3"))
    run_command(
        python_command(script, str(zero3), "4", "2", "mixed_share=0.3", num_processes=2, deepspeed_config=ZERO3)
    )
    trained_one, trained_zero3 = trained_by_step(one), trained_by_step(zero3, processes=2)
    assert sorted(trained_one) == sorted(trained_zero3) == [0, 1]
    for step, rows in trained_one.items():
        assert sorted(p for p, _, _ in rows) == sorted(p for p, _, _ in trained_zero3[step])
    for a, b in zip(step_metrics(one), step_metrics(zero3), strict=True):
        assert a["dynamic_sampling/groups_kept"] == b["dynamic_sampling/groups_kept"]
        assert a["dynamic_sampling/rounds"] == b["dynamic_sampling/rounds"]


def test_zero3_lora_trains_only_the_adapter(tmp_path):
    """A LoRA adapter under ZeRO-3 (base and adapter sharded alike): after two DAPO steps the gathered base weights
    are bit-identical to the model on disk and every adapter tensor trained (lora_B starts at zero). With activation
    checkpointing on, as by default: TRL makes it reentrant for PEFT under ZeRO-3, where DeepSpeed fails a backward
    pass that meets a module twice, so the padding-free training forward runs all its rows at once."""
    out = tmp_path / "zero3"
    script = str(SCRIPTS / "dynamic_sampling_run.py")
    run = run_command(
        python_command(
            script,
            str(out),
            "4",
            "2",
            "mixed_share=0.3",
            "lora=8",
            "learning_rate=1e-3",
            "activation_checkpointing=true",
            "max_tokens_per_microbatch=16",
            num_processes=2,
            deepspeed_config=ZERO3,
        )
    )
    # TRL made the checkpointing reentrant, so the one-forward path ran (and said the budget is not applied).
    assert "max_tokens_per_microbatch=16 is not applied to training forwards" in run.stdout + run.stderr
    final = torch.load(out / "final_params.pt")  # gathered from the shards
    on_disk = dict(AutoModelForCausalLM.from_pretrained(tmp_path / "tiny").named_parameters())
    base = {
        name.replace("base_model.model.", "", 1).replace(".base_layer", ""): value
        for name, value in final.items()
        if "lora_" not in name
    }
    assert base.keys() == on_disk.keys()
    for name, value in base.items():
        assert torch.equal(value, on_disk[name].detach()), name
    lora_b = [value for name, value in final.items() if "lora_B" in name]
    assert lora_b and all(value.abs().max() > 1e-4 for value in lora_b)
    assert sorted(trained_by_step(out, processes=2)) == [0, 1]


@pytest.mark.parametrize(
    "stage,sequence_parallel", [(3, 1), (3, 2), (2, 2)], ids=["zero3-sp1", "zero3-sp2", "zero2-sp2"]
)
def test_deepspeed_token_budget_splits_backward_passes_exactly(tmp_path, stage, sequence_parallel):
    """Under ZeRO-3 a token budget of 10 splits micro-batches into several backward passes (rows longer than the
    budget alone, equal passes and rows on both processes); the update still equals Eq. 11's gradient, also with
    every forward sharded across the 2 processes (sequence parallelism: the group's passes hold 2 x 10 tokens), and
    under ZeRO-2."""
    config = ZERO3
    if stage == 2:
        settings = json.loads(Path(ZERO3).read_text())
        settings["zero_optimization"] = {"stage": 2, "overlap_comm": False, "contiguous_gradients": True}
        config = str(tmp_path / "zero2.json")
        Path(config).write_text(json.dumps(settings))
    extra = ("max_tokens_per_microbatch=10", f"sequence_parallel_size={sequence_parallel}")
    delta, rows, model_dir = run_layout(tmp_path, 2, 2, 2, *extra, deepspeed_config=config)
    assert sorted(rows) == list(range(16))
    assert_update_is_minus_gradient(delta, reference_gradient(model_dir, rows))
    sharded = [torch.load(model_dir.parent / f"rows_rank{rank}.pt")["sharded_forwards"] for rank in range(2)]
    assert (sharded[0] > 0) == (sequence_parallel > 1) and sharded[0] == sharded[1]
