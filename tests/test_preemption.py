"""Preemption (`dapo_trl.training.faults.preemption`): SIGTERM / SIGUSR1 make every process abandon the optimizer
step in progress at its next safe point (between dynamic-sampling rounds, while waiting for a streamed wave, before a
training forward), write a complete checkpoint of the last completed step and exit 0; the same command with `latest`
then ends with the uninterrupted run's weights, bit for bit, with one process, two, two under ZeRO-3, and streaming.
The signal is sent from inside the step (tests/scripts/dynamic_sampling_run.py's preempt_during: the reward scoring a
round, a training forward; streaming_run.py's engine holding a wave, or a tool call), or to run_dapo.sh once a
checkpoint exists.
"""

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist
from transformers import TrainerControl, TrainerState

from dapo_trl.config import DAPOConfig
from dapo_trl.training.faults.checkpoints import mark_complete
from dapo_trl.training.faults.preemption import (
    Preemption,
    SignalRelay,
    StepAbandoned,
    StepEndState,
    parse_signals,
    torchrun_warning,
)
from dapo_trl.training.step.steps import OptimizerSteps

from .helpers import (
    REPO,
    SCRIPTS,
    lowest_versions_python,
    offline_environment,
    python_command,
    read_jsonl,
    run_command,
    run_unchecked,
)

ZERO3 = str(REPO / "configs" / "deepspeed" / "zero3_cpu_test.json")


# ------------------------------------------------------------------------------------------------------ units
def test_signal_names_are_parsed_and_a_bad_one_names_the_field(tmp_path):
    assert parse_signals("SIGTERM, usr1") == [signal.SIGTERM, signal.SIGUSR1]
    assert parse_signals("") == []
    for bad in ("SIGKILL", "SIGNOPE"):
        with pytest.raises(ValueError, match="preemption_signals="):
            parse_signals(bad)
    with pytest.raises(ValueError, match="preemption_grace_seconds=0"):
        DAPOConfig(str(tmp_path), preemption_grace_seconds=0)


def test_torchrun_killing_before_the_grace_period_ends_is_named():
    assert torchrun_warning(300, {}) is None  # not under torchrun
    message = torchrun_warning(300, {"TORCHELASTIC_RUN_ID": "x"})
    assert "30 s" in message and "TORCH_ELASTIC_SHUTDOWN_TIMEOUT=360" in message
    assert torchrun_warning(300, {"TORCHELASTIC_RUN_ID": "x", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "360"}) is None


def test_a_signal_on_any_process_stops_every_process_after_the_step():
    """The flag is agreed at each step's end: this process unsignalled still stops when another was signalled."""
    others_signalled = []
    preemption = Preemption([signal.SIGUSR1], 60, lambda flag: flag or bool(others_signalled), "unused")
    previous = signal.getsignal(signal.SIGUSR1)
    state, control = TrainerState(), TrainerControl()
    preemption.on_train_begin(None, state, control)
    try:
        preemption.on_step_end(None, state, control)
        assert not (control.should_save or control.should_training_stop or preemption.preempted)
        others_signalled.append(True)  # another process got the signal
        preemption.on_step_end(None, state, control)
        assert control.should_save and control.should_training_stop and preemption.preempted
        assert preemption.received is None  # not this one
        os.kill(os.getpid(), signal.SIGUSR1)  # handled, not the default action (which would end pytest)
        assert preemption.received == signal.SIGUSR1
    finally:
        preemption.on_train_end(None, state, control)
    assert signal.getsignal(signal.SIGUSR1) is previous  # the caller's handler is back after train()


def test_a_step_that_outlasts_the_grace_period_exits_with_the_signals_code_naming_the_newest_checkpoint(
    tmp_path, capsys
):
    (tmp_path / "checkpoint-4").mkdir()
    mark_complete(tmp_path / "checkpoint-4")
    (tmp_path / "checkpoint-6").mkdir()  # interrupted save: not the one to resume
    exited, codes = threading.Event(), []

    def give_up():  # the run guard's: resume a vLLM server held paused; it runs first, even when it fails
        codes.append("released")
        raise RuntimeError("the server did not answer")

    preemption = Preemption(
        [signal.SIGTERM],
        0.05,
        lambda flag: flag,
        str(tmp_path),
        exit_process=lambda code: (codes.append(code), exited.set()),
        on_give_up=give_up,
    )
    state, control = TrainerState(), TrainerControl()
    preemption.on_train_begin(None, state, control)
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        assert exited.wait(10)
    finally:
        preemption.on_train_end(None, state, control)
    assert codes == ["released", 128 + signal.SIGTERM]
    error = capsys.readouterr().err
    assert "preemption_grace_seconds=0.05" in error and str(tmp_path / "checkpoint-4") in error


def test_a_safe_point_inside_a_step_abandons_it_on_every_process_once_any_was_signalled():
    """Safe points agree on the flag like a step's end (`agree`), but only inside a step, and raise StepAbandoned."""
    others_signalled = []
    preemption = Preemption([signal.SIGUSR1], 60, lambda flag: flag or bool(others_signalled), "unused")
    state, control = TrainerState(), TrainerControl()
    preemption.on_train_begin(None, state, control)
    try:
        preemption.on_step_begin(None, state, control)
        preemption.safe_point("before a training forward")  # nobody signalled: the step goes on
        others_signalled.append(True)
        with pytest.raises(StepAbandoned, match="before a training forward"):
            preemption.safe_point("before a training forward")
        assert not preemption.requested()  # this process was not signalled (and is not the main one's relay)
        os.kill(os.getpid(), signal.SIGUSR1)
        assert preemption.requested()
        preemption.on_step_end(None, state, control)
        preemption.safe_point("between steps")  # outside a step: the step's end decides (it stops the run)
        assert control.should_training_stop
    finally:
        preemption.on_train_end(None, state, control)


class Part:
    """A run-state part whose state holds containers the run edits in place later."""

    def __init__(self):
        self.batches = [{"ids": torch.tensor([1, 2])}]

    def state_dict(self):
        return {"micro_batches": self.batches}

    def load_state_dict(self, state, device=None):
        self.batches = state["micro_batches"]


def test_the_step_end_snapshot_is_not_reached_by_later_edits_and_restores_the_random_generators():
    part = Part()
    snapshot = StepEndState.capture(3, {"run.pt": part}, {}, {})
    part.batches[0]["num_items_in_batch"] = 7  # the next step writes into its micro-batches
    part.batches.append({"ids": torch.tensor([3])})
    drawn = (torch.rand(3), np.random.rand(), __import__("random").random())
    snapshot.restore({"run.pt": part}, {}, "cpu")
    assert part.batches == [{"ids": part.batches[0]["ids"]}] and "num_items_in_batch" not in part.batches[0]
    assert torch.equal(torch.rand(3), drawn[0]) and np.random.rand() == drawn[1]
    assert __import__("random").random() == drawn[2]


def test_optimizer_steps_restore_the_state_they_saved():
    """A step abandoned half-way puts its process state back to the last step's end: the saved state, again."""
    steps = OptimizerSteps(DAPOConfig("unused", steps_per_generation=4, gradient_accumulation_steps=2), "cpu", True)
    steps.begin(4, ["a", "b"])
    steps.buffer = [{"ids": torch.tensor([index])} for index in range(4)]
    saved = steps.state_dict()  # the end of the step of micro-steps 4-5: inside the generation batch
    steps.begin(6, ["c", "d"])  # the next step begins, then is abandoned
    steps.load_state_dict(saved)
    assert steps.state_dict() == saved and saved["micro_step"] == 6


def test_a_signal_that_reaches_a_process_blocked_outside_python_reaches_the_main_process():
    """The relay's thread sees the signal's wakeup byte (Python runs the handler only once the main thread is back
    from its collective), records it and sets the launcher's store key, which the main process's relay watches."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    connect = lambda: dist.TCPStore("127.0.0.1", server.port, is_master=False)  # noqa: E731
    seen = threading.Event()
    previous = signal.signal(signal.SIGUSR1, lambda *args: None)  # a Python handler: its wakeup byte is written
    try:
        signalled = SignalRelay(1, connect, poll_seconds=0.01)
        signalled.start("key", [signal.SIGUSR1], lambda sig: seen.set())
        os.kill(os.getpid(), signal.SIGUSR1)
        assert seen.wait(10)
        deadline = time.monotonic() + 10
        while not server.check(["key"]):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        signalled.stop()
        main = SignalRelay(0, connect, poll_seconds=0.01)
        main.start("key", [signal.SIGUSR1], lambda sig: None)
        try:
            assert main.peer_signalled.wait(10)
        finally:
            main.stop()
    finally:
        signal.signal(signal.SIGUSR1, previous)


# ------------------------------------------------------------------------------------------------ end to end
def final_params(out) -> dict:
    return torch.load(out / "final_params.pt")


def checkpoints(out) -> list[str]:
    """The run's checkpoints, each asserted complete."""
    found = sorted(path.name for path in (out / "run").glob("checkpoint-*"))
    assert all((out / "run" / name / "dapo_checkpoint.json").exists() for name in found), found
    return found


@pytest.mark.e2e
@pytest.mark.parametrize(
    "processes, deepspeed, environment",
    [(1, None, "newest"), (2, ZERO3, "newest"), (2, None, "lowest")],
    ids=["1-process", "2-processes-zero3", "2-processes-lowest-versions"],
)
def test_a_step_abandoned_mid_step_saves_the_last_one_and_the_requeued_run_ends_bit_for_bit(
    tmp_path, processes, deepspeed, environment
):
    """Steps of two micro-batches, dynamic sampling in rounds. SIGTERM reaches one process (the last) while the reward
    scores step 2's first round, a reward that then takes 120 s on every process (past the 30 s grace): every process
    interrupts it and abandons step 2 while scoring rewards (its second round is never generated), writes
    checkpoint-1 complete and exits 0. Requeued with latest, it is signalled during step 3's first
    training forward: abandoned before micro-batch 1, checkpoint-2. Requeued again, it ends with the uninterrupted
    run's weights, to the bit. With one process, step 2 is abandoned in its training, and the requeued run (saving
    every 2 steps) gets SIGTERM while checkpoint-2 is written: that save finishes, step 3 is abandoned before it
    generates and nothing is saved twice; and a run killed -9 halfway through writing checkpoint-2 resumes from
    checkpoint-1 and ends with the uninterrupted weights too. `lowest`: in the environment of the lowest supported
    transformers and TRL (tests/test_lowest_versions.py), where a 2-process resume once failed; at the newest, the
    ZeRO-3 case (and tests/test_lora.py's 2-process resume) cover it."""
    script, batch, last = str(SCRIPTS / "dynamic_sampling_run.py"), str(4 // processes), str(processes - 1)
    common = ("mixed_share=0.3", "save_strategy=steps", "save_steps=100", "gradient_accumulation_steps=2")
    python = lowest_versions_python() if environment == "lowest" else sys.executable
    launch = {"num_processes": processes, "deepspeed_config": deepspeed, "python": python}
    full, preempted = tmp_path / "full", tmp_path / "preempted"
    run_command(python_command(script, str(full), batch, "3", *common, **launch))
    if processes == 1:  # a resumed run keeps the checkpoint's save_steps
        first = ("save_steps=2", "preempt_at_step=1", "preempt_during=training")
        second = ("sigterm_while_writing=checkpoint-2/dapo_sampling_state.pt", "resume=latest")
        where = ("step 2 before a training forward", "step 3 before generating a batch")
    else:  # the reward then takes 120 s on every process: interrupted, not waited for past the 30 s grace
        slow = ("slow_reward_at_step=1", "slow_reward_seconds=120", "preemption_grace_seconds=30")
        first = ("preempt_at_step=1", "preempt_during=round", f"preempt_rank={last}", *slow)
        second = ("preempt_at_step=2", "preempt_during=training", f"preempt_rank={last}", "resume=latest")
        where = ("step 2 while scoring rewards", "step 3 before a training forward")
    result = run_command(python_command(script, str(preempted), batch, "3", *common, *first, **launch))
    assert "SIGTERM received" in result.stderr and f"abandoned optimizer {where[0]}" in result.stderr, result.stderr
    assert [(preempted / f"preempted_rank{rank}.txt").read_text() for rank in range(processes)] == ["True"] * processes
    assert checkpoints(preempted) == ["checkpoint-1"]
    if processes > 1:  # step 2 generated the round being scored, and trained nothing
        assert [record["step"] for record in read_jsonl(preempted / "prompts_seen_rank0.jsonl")].count(1) == 1
        assert all(record["step"] == 0 for record in read_jsonl(preempted / "trained_rank0.jsonl"))
    result = run_command(python_command(script, str(preempted), batch, "3", *common, *second, **launch))
    assert f"abandoned optimizer {where[1]}" in result.stderr, result.stderr[-3000:]
    if processes == 1:  # the save the signal came during is the newest state: it is not written again
        assert "nothing newer than checkpoint-2" in result.stderr, result.stderr[-3000:]
    assert checkpoints(preempted) == ["checkpoint-1", "checkpoint-2"]
    run_command(python_command(script, str(preempted), batch, "3", *common, "resume=latest", **launch))
    assert_same_weights(final_params(full), final_params(preempted))
    if processes == 1:  # killed -9 halfway through a save: the requeued run resumes from the one before
        killed, every_step = tmp_path / "killed", (*common[:2], "save_steps=1", common[3])
        command = python_command(
            script, str(killed), batch, "3", *every_step, "kill_while_writing=checkpoint-2/dapo_sampling_state.pt"
        )
        result = run_unchecked(command, timeout=300)
        assert result.returncode == -signal.SIGKILL, result.stderr[-3000:]
        killed_at = len(read_jsonl(killed / "prompts_seen_rank0.jsonl"))
        run_command(python_command(script, str(killed), batch, "3", *every_step, "resume=latest"))
        assert read_jsonl(killed / "prompts_seen_rank0.jsonl")[killed_at]["step"] == 1  # resumed after step 1
        assert_same_weights(final_params(full), final_params(killed))


@pytest.mark.e2e
def test_a_signal_while_the_main_process_waits_for_a_streamed_wave_stops_every_process(tmp_path):
    """Streaming from the fake engine, 2 processes: as step 2 asks for its groups, process 1 gets SIGTERM and the
    engine holds those groups for 120 s, so the main process waits for the wave while process 1 waits in its
    broadcast (where Python cannot run its handler). The signal reaches the main process through the launcher's
    store; it broadcasts a preempted wave, every process abandons step 2 and exits 0 within seconds with checkpoint-1
    complete; requeued, the run ends with the uninterrupted run's weights, to the bit."""
    script, launch = str(SCRIPTS / "streaming_run.py"), {"num_processes": 2}
    common = ("rollout_streaming=true", "filter_groups_enable=true", "save_strategy=steps", "save_steps=100")
    full, preempted, weights = tmp_path / "full", tmp_path / "preempted", "final_params=true"
    run_command(python_command(script, str(full), "4", "2", *common, weights, **launch))
    result = run_command(python_command(script, str(preempted), "4", "2", *common, "preempt_wave_at_step=1", **launch))
    where = "abandoned optimizer step 2 while waiting for a streamed wave, ([0-9.]+) s after this process's signal"
    found = re.search(where, result.stderr)  # process 1's line
    assert found and float(found.group(1)) < 30, result.stderr[-3000:]  # not once the held groups (120 s) came
    assert checkpoints(preempted) == ["checkpoint-1"]
    run_command(python_command(script, str(preempted), "4", "2", *common, "resume=latest", weights, **launch))
    assert_same_weights(final_params(full), final_params(preempted))


@pytest.mark.e2e
@pytest.mark.parametrize("mode, processes", [("rounds", 1), ("streaming", 2)], ids=["rounds-1-process", "stream-2"])
def test_a_reward_that_holds_the_step_is_interrupted_and_the_requeued_run_ends_bit_for_bit(tmp_path, mode, processes):
    """A reward that takes 120 s (a judge, a sandbox, a remote service) on every process from step 2, and SIGTERM to
    process 0 as it begins, with a grace period of 20 s: the reward is interrupted on every process (the signalled
    one by its handler, the other through the launcher's store), every process abandons step 2 while scoring
    rewards, writes checkpoint-1 and exits 0 well within the grace; requeued, the run ends with the uninterrupted
    run's weights, to the bit. Rounds on one process; streaming (k = 0) on two. Before, the step waited for the
    reward, and the grace exit (143) left no checkpoint."""
    streaming = mode == "streaming"
    script = str(SCRIPTS / ("streaming_run.py" if streaming else "dynamic_sampling_run.py"))
    common = ("save_strategy=steps", "save_steps=100", "preemption_grace_seconds=20")
    common += ("rollout_streaming=true",) if streaming else ("mixed_share=0.3", "gradient_accumulation_steps=2")
    launch, batch = {"num_processes": processes}, str(4 // processes * (2 if streaming else 1))
    weights = ("final_params=true",) if streaming else ()  # dynamic_sampling_run.py always writes them
    full, preempted = tmp_path / "full", tmp_path / "preempted"
    run_command(python_command(script, str(full), batch, "3", *common, *weights, **launch))
    hold = ("preempt_at_step=1", "preempt_during=round", "preempt_rank=0")
    hold += ("slow_reward_at_step=1", "slow_reward_seconds=120")
    started = time.monotonic()
    result = run_command(python_command(script, str(preempted), batch, "3", *common, *hold, **launch))
    assert time.monotonic() - started < 60, result.stderr[-3000:]  # not the reward's 120 s
    assert result.stderr.count("abandoned optimizer step 2 while scoring rewards") == processes, result.stderr[-3000:]
    assert checkpoints(preempted) == ["checkpoint-1"]
    run_command(python_command(script, str(preempted), batch, "3", *common, "resume=latest", *weights, **launch))
    assert_same_weights(final_params(full), final_params(preempted))


@pytest.mark.e2e
def test_a_tool_call_that_holds_the_step_is_interrupted_and_the_requeued_run_ends_bit_for_bit(tmp_path):
    """TRL's tool loop (streaming, two processes; half of the first turns call the `add` tool) with every tool call
    taking 120 s from step 2, and SIGTERM to process 1 as its first call begins, with a grace period of 20 s: the
    call is interrupted (by the signal's handler; a call running on the other process, through the launcher's store),
    later calls return at once without running, every process abandons step 2 at its next safe point (the agreement
    before the rewards' gather), writes checkpoint-1 and exits 0 within the grace; requeued, the run ends with the
    uninterrupted run's weights, to the bit. Before, the step waited for the tool calls, and the grace exit (143)
    left no checkpoint."""
    script, launch = str(SCRIPTS / "streaming_run.py"), {"num_processes": 2}
    common = ("tools=true", "rollout_streaming=true", "save_strategy=steps", "save_steps=100")
    common += ("preemption_grace_seconds=20", "final_params=true")
    full, preempted = tmp_path / "full", tmp_path / "preempted"
    run_command(python_command(script, str(full), "2", "3", *common, **launch))
    hold = ("preempt_at_step=1", "preempt_during=tool", "preempt_rank=1", "slow_tool_at_step=1")
    started = time.monotonic()
    result = run_command(
        python_command(script, str(preempted), "2", "3", *common, *hold, "slow_tool_seconds=120", **launch)
    )
    assert time.monotonic() - started < 60, result.stderr[-3000:]  # not the tool's 120 s
    assert result.stderr.count("abandoned optimizer step 2") == 2, result.stderr[-3000:]
    assert checkpoints(preempted) == ["checkpoint-1"]
    run_command(python_command(script, str(preempted), "2", "3", *common, "resume=latest", **launch))
    assert_same_weights(final_params(full), final_params(preempted))


@pytest.mark.e2e
def test_an_environments_tool_method_that_holds_the_step_is_interrupted(tmp_path):
    """The same tool as the method of a TRL environment (`environment_factory`, one instance per rollout, its methods
    bound and tabled anew every batch; round by round, one process): every call of step 2 takes 120 s and SIGTERM
    comes as the first begins, grace 20 s: the call is interrupted, step 2 abandoned, checkpoint-1 written and exit 0
    well within the grace. Unwrapped, the method held the step past the grace (exit 143, no checkpoint)."""
    script = str(SCRIPTS / "streaming_run.py")
    hold = ("tools=environment", "save_strategy=steps", "save_steps=100", "preemption_grace_seconds=20")
    hold += ("preempt_at_step=1", "preempt_during=tool", "preempt_rank=0", "slow_tool_at_step=1")
    started = time.monotonic()
    result = run_command([sys.executable, script, str(tmp_path), "4", "3", *hold, "slow_tool_seconds=120"])
    assert time.monotonic() - started < 60, result.stderr[-3000:]  # not the tool's 120 s
    assert "abandoned optimizer step 2" in result.stderr, result.stderr[-3000:]
    assert checkpoints(tmp_path) == ["checkpoint-1"]


@pytest.mark.e2e
def test_a_preemption_checkpoint_keeps_the_groups_generated_ahead(tmp_path):
    """k = 1 with in-flight weight updates (the fake engine loads each version as it is published and checkpoints
    keep the groups generated ahead): SIGTERM as step 3 asks for its groups. The preemption's checkpoint-2 keeps
    the groups the engine had generated ahead, as a periodic checkpoint would (before: none, the rollout was
    withdrawn before the save), the resumed run restores them (`rollout/groups_restored`), and every step trains
    the prompts the uninterrupted run trains: none lost, none twice."""
    script = str(SCRIPTS / "streaming_run.py")
    common = (
        "rollout_streaming=true",
        "rollout_max_staleness=1",
        "in_flight=true",
        "filter_groups_enable=false",  # every step trains its stream's prompts, whatever the timing
        "steps_per_generation=2",
        "gradient_accumulation_steps=1",
        "save_strategy=steps",
        "save_steps=100",
        "preempt_rank=0",
    )
    full, preempted = tmp_path / "full", tmp_path / "preempted"
    run_command(python_command(script, str(full), "4", "6", *common))
    result = run_command(
        python_command(script, str(preempted), "4", "6", *common, "preempt_wave_at_step=2", "hold_seconds=60")
    )
    assert "abandoned optimizer step 3" in result.stderr, result.stderr[-3000:]
    kept = torch.load(preempted / "run" / "checkpoint-2" / "dapo_rollout_state.pt", weights_only=True)["groups"]
    assert kept, "the preemption's checkpoint kept no group generated ahead"
    first_leg = len(read_jsonl(preempted / "trained_rank0.jsonl"))  # its abandoned step's forward is recorded too
    run_command(python_command(script, str(preempted), "4", "6", *common, "resume=latest"))
    history = read_json(preempted / "log_history.json")
    restored = [entry["rollout/groups_restored"] for entry in history if "rollout/groups_restored" in entry]
    assert restored[1] == len(kept), restored  # after checkpoint-2's history, the resumed run's first batch: all

    def prompts(records: list[dict]) -> dict[int, list]:
        steps: dict[int, list] = {}
        for record in records:
            steps.setdefault(record["step"], []).extend(record["prompts"])
        return {step: sorted(rows) for step, rows in steps.items()}

    legs = read_jsonl(preempted / "trained_rank0.jsonl")
    completed = [record for record in legs[:first_leg] if record["step"] < 2]  # steps 1-2, saved in checkpoint-2
    trained, uninterrupted = prompts(completed + legs[first_leg:]), prompts(read_jsonl(full / "trained_rank0.jsonl"))
    assert sorted(uninterrupted) == list(range(6)) and trained == uninterrupted


def read_json(path):
    import json

    return json.loads(path.read_text())


def assert_same_weights(expected: dict, got: dict) -> None:
    assert expected.keys() == got.keys()
    for name in expected:
        assert torch.equal(expected[name], got[name]), name


RUN_DAPO_TINY = {
    "MODEL_PATH": "builtin:tiny",
    "DATASET": "builtin:arithmetic",
    "NUM_PROCESSES": "2",
    "BF16": "false",
    "REPORT_TO": "none",
    "SAVE_STEPS": "1",
    "NUM_GENERATIONS": "4",
    "PER_DEVICE_BATCH_SIZE": "4",
    "GRADIENT_ACCUMULATION_STEPS": "1",
    "MAX_PROMPT_LENGTH": "256",
    "MAX_COMPLETION_LENGTH": "16",
    "OVERLONG_BUFFER_LEN": "4",
    "MAX_FILTER_GEN_BATCHES": "3",
    "WARMUP_STEPS": "0",
}


@pytest.mark.e2e
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1], ids=["SIGTERM", "SIGUSR1"])
def test_run_dapo_forwards_the_signal_and_the_requeued_command_resumes(tmp_path, sig):
    """The scheduler signals run_dapo.sh (2 processes under torchrun): SIGTERM (Kubernetes, SLURM's preemption) or
    SIGUSR1 (SLURM's warning, `--signal=B:USR1@600` in examples/slurm_dapo.sbatch; torchrun kills its workers on it
    unless told to forward it). The script forwards it to the training processes, which save and stop; the script
    exits 0 within the grace period, and the same command resumes."""
    out = tmp_path / "out"
    env = offline_environment({**RUN_DAPO_TINY, "OUTPUT_DIR": str(out), "MASTER_PORT": str(29700 + os.getpid() % 200)})
    command = ["./run_dapo.sh", "--max_steps", "60", "--resume_from_checkpoint", "latest"]
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while not (out / "checkpoint-1" / "dapo_checkpoint.json").exists():  # training has begun
            assert process.poll() is None and time.monotonic() < deadline, process.communicate()
            time.sleep(0.1)
        process.send_signal(sig)
        stdout, stderr = process.communicate(timeout=120)
    finally:
        process.kill()
    assert process.returncode == 0, stderr[-4000:]
    assert "preempted after step" in stdout and f"{sig.name} received" in stderr
    stopped = int(stdout.split("preempted after step ")[1].split(":")[0])
    assert stopped < 60 and (out / f"checkpoint-{stopped}" / "dapo_checkpoint.json").exists()
    again = run_command([*command[:2], str(stopped + 1), *command[3:]], env=env)
    assert f"resuming from the newest complete checkpoint, {out / f'checkpoint-{stopped}'}" in again.stderr
    assert (out / f"checkpoint-{stopped + 1}" / "dapo_checkpoint.json").exists()


def test_ctrl_c_interrupts_at_once_after_aborting_the_requests_in_flight():
    aborted = []
    preemption = Preemption([signal.SIGTERM], 60, lambda flag: flag, "unused", on_interrupt=lambda: aborted.append(1))
    state, control = TrainerState(), TrainerControl()
    preemption.on_train_begin(None, state, control)
    try:
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)  # interrupted by the handler long before this ends
        assert aborted == [1]
    finally:
        preemption.on_train_end(None, state, control)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_reward_waiting_on_its_async_work_is_interrupted_and_the_processes_agree(tmp_path):
    """Inside a user-code region (`Preemption.user_code`, what DAPOTrainer scores rewards in) the main thread waits
    for an async reward's future, as TRL waits for its async reward functions: a signal arriving during the wait
    interrupts it at once, and the region ends in `StepAbandoned`. A region whose code finishes abandons nothing."""
    from concurrent.futures import ThreadPoolExecutor

    preemption = Preemption([signal.SIGUSR1], 60, lambda flag: flag, str(tmp_path))
    state, control = TrainerState(), TrainerControl()
    preemption.on_train_begin(None, state, control)
    pool, started, release = ThreadPoolExecutor(1), threading.Event(), threading.Event()
    try:
        preemption.on_step_begin(None, state, control)
        with preemption.user_code("while scoring rewards") as finished:
            finished()  # a reward that returned: nothing to abandon
        signaller = threading.Thread(target=lambda: (started.wait(10), os.kill(os.getpid(), signal.SIGUSR1)))
        signaller.start()
        begun = time.monotonic()
        with pytest.raises(StepAbandoned, match="while scoring rewards"):
            with preemption.user_code("while scoring rewards") as finished:
                future = pool.submit(lambda: (started.set(), release.wait(120)))
                future.result()  # interrupted here
                finished()
        assert time.monotonic() - begun < 10
        signaller.join()
    finally:
        release.set()
        pool.shutdown()
        preemption.on_train_end(None, state, control)


def test_an_interruptible_tool_keeps_its_schema_and_returns_at_once_when_the_run_stops():
    """`interruptible_tool`: the tool's schema (TRL builds it from name, docstring and signature) unchanged; a sync
    call interrupted inside its region, or made once the run is stopping, returns `STOPPED_TOOL_RESULT`; an async
    call is cancelled within a poll of the stop."""
    import asyncio
    import contextlib

    from transformers.utils import get_json_schema

    from dapo_trl.training.faults.user_code import STOPPED_TOOL_RESULT, UserCodeInterrupted, interruptible_tool

    def search(query: str) -> str:
        """Search the web.

        Args:
            query: What to look for.
        """
        return f"results for {query}"

    stopping = [False]
    tool = interruptible_tool(search, contextlib.nullcontext, lambda: stopping[0])
    assert get_json_schema(tool) == get_json_schema(search) and tool("dapo") == "results for dapo"

    @contextlib.contextmanager
    def signalled():
        yield
        raise UserCodeInterrupted("SIGTERM received")

    assert interruptible_tool(search, signalled, lambda: True)("dapo") == STOPPED_TOOL_RESULT

    async def slow_search(query: str) -> str:
        """Search slowly.

        Args:
            query: What to look for.
        """
        await asyncio.sleep(30)
        return query

    async def stop_soon():
        asyncio.get_running_loop().call_later(0.2, stopping.__setitem__, 0, True)
        return await interruptible_tool(slow_search, contextlib.nullcontext, lambda: stopping[0])("dapo")

    started = time.monotonic()
    assert asyncio.run(stop_soon()) == STOPPED_TOOL_RESULT and time.monotonic() - started < 5


def test_region_outcomes_agree_through_the_store_without_a_collective():
    """Two processes (threads here, each with its own store client) report each region's outcome: any interrupted
    one makes both abandon; both finished, neither; the region's keys are gone once both have read them."""
    from dapo_trl.training.faults.user_code import RegionOutcomes

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    master = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    connect = lambda: dist.TCPStore("127.0.0.1", port, is_master=False)  # noqa: E731
    outcomes = [RegionOutcomes(connect, 2, "test/user_code") for _ in range(2)]
    for serial, interrupted in ((1, [False, False]), (2, [False, True]), (3, [True, True])):
        decided = [None, None]

        def report(rank: int, serial: int = serial, interrupted: list = interrupted, decided: list = decided) -> None:
            decided[rank] = outcomes[rank].agree(serial, interrupted[rank])

        threads = [threading.Thread(target=report, args=(rank,)) for rank in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(10)
        assert decided == [any(interrupted)] * 2
        assert not master.check([f"test/user_code/{serial}"])
    assert RegionOutcomes(None, 1, "x").agree(1, True) and not RegionOutcomes(None, 2, "x").available
