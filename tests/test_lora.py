"""LoRA (PEFT) end to end on two real processes (tests/scripts/dynamic_sampling_run.py with `lora=8`): only the
adapter trains, the base stays bit-identical, and a run killed after a checkpoint resumes from the checkpoint's
adapter, optimizer and sampler state to exactly what the uninterrupted run gives.

The other LoRA tests: ZeRO-3 in test_deepspeed.py, weight sync to a vLLM server in test_vllm.py, KL in the reward
against the adapter-off reference in test_kl_in_reward.py, verl's LoRA example through from_verl and train_dapo.py in
test_from_verl.py.
"""

import subprocess
from collections import Counter

import pytest
import torch
from safetensors.torch import load_file

from .helpers import (
    SCRIPTS,
    python_command,
    read_jsonl,
    run_command,
    run_unchecked,
    trained_by_step,
)

pytestmark = pytest.mark.e2e
SCRIPT = str(SCRIPTS / "dynamic_sampling_run.py")
# lr 1e-3: each step moves the adapter visibly; a checkpoint after step 2 of 3.
LORA_RUN = ("mixed_share=0.3", "lora=8", "learning_rate=1e-3", "snapshots=true", "save_strategy=steps", "save_steps=2")


def launch(out, *extra: str, check: bool = True) -> subprocess.CompletedProcess:
    command = python_command(SCRIPT, str(out), "4", "3", *LORA_RUN, *extra, num_processes=2)
    if check:
        return run_command(command)
    return run_unchecked(command, timeout=600, warm=False)  # the real launcher: its report of both ranks


def snapshot(out, name: str) -> dict:
    return torch.load(out / f"snapshot_{name}.pt")


def adapter(params: dict) -> dict:
    return {name: value for name, value in params.items() if "lora_" in name}


def prompts_from_step_2(out) -> list:
    return [(r["step"], r["prompts"]) for r in read_jsonl(out / "prompts_seen_rank0.jsonl") if r["step"] >= 2]


def assert_same(a: dict, b: dict, atol: float = 0.0) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=atol, rtol=0, msg=lambda m, n=name: f"{n}: {m}")


def test_lora_on_two_processes_trains_only_the_adapter_and_resumes_as_uninterrupted(tmp_path):
    full, crashed = tmp_path / "full", tmp_path / "crashed"
    launch(full)
    start, end = snapshot(full, "start")["params"], snapshot(full, "3")["params"]
    lora = adapter(end)
    assert lora and all("lora_A" in name or "lora_B" in name for name in lora)
    assert_same({n: v for n, v in start.items() if n not in lora}, {n: v for n, v in end.items() if n not in lora})
    assert all(not start[name].any() for name in lora if "lora_B" in name)  # B starts at zero (PEFT's init) ...
    assert all(not torch.equal(start[name], end[name]) for name in lora)  # ... and every adapter tensor trained
    optimizer = snapshot(full, "3")["optimizer"]
    assert len({key.split(".")[0] for key in optimizer}) == len(lora)  # AdamW state for the adapter only
    assert sorted(trained_by_step(full, processes=2)) == [0, 1, 2]

    result = launch(crashed, "crash_after_save=2", check=False)
    assert result.returncode != 0 and "exitcode  : 3" in result.stderr, result.stderr[-3000:]  # both ranks died
    checkpoint = crashed / "run" / "checkpoint-2"
    assert (checkpoint / "adapter_model.safetensors").exists() and not (checkpoint / "model.safetensors").exists()
    assert (checkpoint / "dapo_sampling_state.pt").exists()
    launch(crashed, f"resume={checkpoint}")

    # The resumed run starts from the checkpoint's adapter and optimizer state: the uninterrupted run's after step 2.
    resumed_start, full_step2 = snapshot(crashed, "start"), snapshot(full, "2")
    assert_same(adapter(resumed_start["params"]), adapter(full_step2["params"]))
    saved = load_file(checkpoint / "adapter_model.safetensors")
    assert {name.replace(".default", "") for name in lora} == set(saved)
    for name in lora:
        assert torch.equal(saved[name.replace(".default", "")], resumed_start["params"][name]), name
    assert_same(resumed_start["optimizer"], full_step2["optimizer"])
    # ... draws the prompts the uninterrupted run drew, and ends where it ended.
    assert prompts_from_step_2(crashed) and prompts_from_step_2(crashed) == prompts_from_step_2(full)
    trained_full, trained_resumed = trained_by_step(full, processes=2), trained_by_step(crashed, processes=2)
    assert Counter(p for p, _, _ in trained_full[2]) == Counter(p for p, _, _ in trained_resumed[2])
    assert_same(adapter(snapshot(crashed, "3")["params"]), lora, atol=1e-6)
    assert_same(snapshot(crashed, "3")["params"], end, atol=1e-6)  # the base too (untouched in both)
