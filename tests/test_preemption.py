"""Preemption (`dapo_trl.training.preemption`): SIGTERM / SIGUSR1 save a complete checkpoint after the current
optimizer step on every process and end the run with exit code 0; the same command with `latest` then ends with the
uninterrupted run's weights, bit for bit, with one process, two, and two under ZeRO-3. A signal is sent at a chosen
step (tests/scripts/dynamic_sampling_run.py's preempt_at_step), or to run_dapo.sh once a checkpoint exists.
"""

import os
import signal
import subprocess
import threading
import time

import pytest
import torch
from transformers import TrainerControl, TrainerState

from dapo_trl.config import DAPOConfig
from dapo_trl.training.checkpoints import mark_complete
from dapo_trl.training.preemption import Preemption, parse_signals, torchrun_warning

from .helpers import REPO, SCRIPTS, offline_environment, python_command, read_jsonl, run_command

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
    preemption = Preemption(
        [signal.SIGTERM],
        0.05,
        lambda flag: flag,
        str(tmp_path),
        exit_process=lambda code: (codes.append(code), exited.set()),
    )
    state, control = TrainerState(), TrainerControl()
    preemption.on_train_begin(None, state, control)
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        assert exited.wait(10)
    finally:
        preemption.on_train_end(None, state, control)
    assert codes == [128 + signal.SIGTERM]
    error = capsys.readouterr().err
    assert "preemption_grace_seconds=0.05" in error and str(tmp_path / "checkpoint-4") in error


# ------------------------------------------------------------------------------------------------ end to end
def final_params(out) -> dict:
    return torch.load(out / "final_params.pt")


@pytest.mark.e2e
@pytest.mark.parametrize(
    "processes, deepspeed", [(1, None), (2, None), (2, ZERO3)], ids=["1-process", "2-processes", "2-processes-zero3"]
)
def test_a_preempted_and_requeued_run_ends_with_the_uninterrupted_weights_bit_for_bit(tmp_path, processes, deepspeed):
    """SIGTERM reaches one process (the last) as step 2 begins; every process finishes step 2, checkpoint-2 is
    written complete, every process exits 0; the same command with resume=latest ends where the uninterrupted run
    ends, to the bit. With one process, a run killed -9 halfway through writing checkpoint-2 resumes from
    checkpoint-1 and ends there too, and a SIGTERM while checkpoint-1 is written lets that save finish and stops
    after step 2 (a signal only sets a flag: where in a save it lands does not matter)."""
    script, batch = str(SCRIPTS / "dynamic_sampling_run.py"), str(8 // processes)
    common = ("mixed_share=0.3", "save_strategy=steps", "save_steps=100")
    launch = {"num_processes": processes, "deepspeed_config": deepspeed}
    full, preempted = tmp_path / "full", tmp_path / "preempted"
    run_command(python_command(script, str(full), batch, "4", *common, **launch))
    signalled = ("preempt_at_step=1", f"preempt_rank={processes - 1}")
    result = run_command(python_command(script, str(preempted), batch, "4", *common, *signalled, **launch))
    assert "SIGTERM received" in result.stderr
    assert [(preempted / f"preempted_rank{rank}.txt").read_text() for rank in range(processes)] == ["True"] * processes
    assert [path.name for path in (preempted / "run").glob("checkpoint-*")] == ["checkpoint-2"]
    assert (preempted / "run" / "checkpoint-2" / "dapo_checkpoint.json").exists()
    run_command(python_command(script, str(preempted), batch, "4", *common, "resume=latest", **launch))
    assert_same_weights(final_params(full), final_params(preempted))
    if processes == 1:  # killed -9 halfway through a save: the requeued run resumes from the one before
        killed, every_step = tmp_path / "killed", ("mixed_share=0.3", "save_strategy=steps", "save_steps=1")
        command = python_command(
            script, str(killed), batch, "4", *every_step, "kill_while_writing=checkpoint-2/dapo_sampling_state.pt"
        )
        result = subprocess.run(command, cwd=REPO, env=offline_environment(), capture_output=True, timeout=300)
        assert result.returncode == -signal.SIGKILL
        killed_at = len(read_jsonl(killed / "prompts_seen_rank0.jsonl"))
        run_command(python_command(script, str(killed), batch, "4", *every_step, "resume=latest"))
        assert read_jsonl(killed / "prompts_seen_rank0.jsonl")[killed_at]["step"] == 1  # resumed after step 1
        assert_same_weights(final_params(full), final_params(killed))
        # SIGTERM while checkpoint-1 is being written: that save completes, step 2 runs, checkpoint-2 stops the run.
        during_save = tmp_path / "during_save"
        signalled = ("sigterm_while_writing=checkpoint-1/dapo_sampling_state.pt",)
        run_command(python_command(script, str(during_save), batch, "4", *every_step, *signalled))
        saved = sorted(path.name for path in (during_save / "run").glob("checkpoint-*"))
        assert saved == ["checkpoint-1", "checkpoint-2"]
        assert all((during_save / "run" / name / "dapo_checkpoint.json").exists() for name in saved)
        run_command(python_command(script, str(during_save), batch, "4", *every_step, "resume=latest"))
        assert_same_weights(final_params(full), final_params(during_save))


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
def test_run_dapo_forwards_sigterm_and_the_requeued_command_resumes(tmp_path):
    """The scheduler signals run_dapo.sh (2 processes under torchrun): it forwards the signal to the training
    processes, which save and stop; the script exits 0 within the grace period, and the same command resumes."""
    out = tmp_path / "out"
    env = offline_environment({**RUN_DAPO_TINY, "OUTPUT_DIR": str(out), "MASTER_PORT": str(29700 + os.getpid() % 200)})
    command = ["./run_dapo.sh", "--max_steps", "60", "--resume_from_checkpoint", "latest"]
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while not (out / "checkpoint-1" / "dapo_checkpoint.json").exists():  # training has begun
            assert process.poll() is None and time.monotonic() < deadline, process.communicate()
            time.sleep(0.1)
        process.send_signal(signal.SIGTERM)
        stdout, stderr = process.communicate(timeout=120)
    finally:
        process.kill()
    assert process.returncode == 0, stderr[-4000:]
    assert "preempted after step" in stdout and "SIGTERM received" in stderr
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
