"""Preemption: a signal saves a complete checkpoint at the end of the current optimizer step, then training stops.

SLURM (`--signal`), Kubernetes and most schedulers give a job a signal and a grace period before they kill it. Here
SIGTERM and SIGUSR1 (`preemption_signals`) only raise a flag; at the end of every optimizer step the processes agree
on it (one all-reduce of one number), so a signal that reached any one process stops all of them after the same
step, with a checkpoint written by all. `train()` then returns, `trainer.preempted` is true, and `train_dapo.py`
exits 0; the same command with `--resume_from_checkpoint latest` continues exactly where it stopped.

If the step and the save do not end within `preemption_grace_seconds` of the signal, the process exits with
128 + the signal's number, naming the newest complete checkpoint (the one a requeued run resumes from).

Ctrl-C (SIGINT) still interrupts at once, after `on_interrupt` (the trainer shuts down the HTTP requests in flight,
which TRL's client would otherwise wait for, up to their timeout, before the KeyboardInterrupt got out).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from transformers import TrainerCallback

from .checkpoints import complete_checkpoints

logger = logging.getLogger(__name__)

UNCATCHABLE = {"SIGKILL", "SIGSTOP"}
TORCHRUN_SHUTDOWN_DEFAULT = 30  # seconds torchrun waits after forwarding a signal before it kills its workers


def parse_signals(names: str) -> list[signal.Signals]:
    """`"SIGTERM,SIGUSR1"` -> the signals; "" -> none. Raises ValueError naming the field on a bad name."""
    found = []
    for name in filter(None, (part.strip().upper() for part in names.split(","))):
        name = name if name.startswith("SIG") else f"SIG{name}"
        if name in UNCATCHABLE or not isinstance(getattr(signal, name, None), signal.Signals):
            raise ValueError(
                f"preemption_signals={names!r}: {name} is not a signal a process can catch; use names such as "
                "SIGTERM,SIGUSR1 (or '' to leave signals to their default action)."
            )
        found.append(getattr(signal, name))
    return found


def torchrun_warning(grace_seconds: float, environ: dict[str, str]) -> str | None:
    """What to export when this process runs under torchrun (`accelerate launch --multi_gpu`), whose agent kills
    its workers TORCH_ELASTIC_SHUTDOWN_TIMEOUT seconds after forwarding a SIGTERM: earlier than the grace period."""
    if "TORCHELASTIC_RUN_ID" not in environ:
        return None
    shutdown = int(environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", TORCHRUN_SHUTDOWN_DEFAULT))
    if shutdown >= grace_seconds:
        return None
    return (
        f"torchrun kills the training processes {shutdown} s after it forwards SIGTERM, before "
        f"preemption_grace_seconds={grace_seconds:g} ends: export "
        f"TORCH_ELASTIC_SHUTDOWN_TIMEOUT={int(grace_seconds) + 60} before accelerate launch "
        "(run_dapo.sh does), or signal the training processes themselves."
    )


class Preemption(TrainerCallback):
    """Installs the signal handlers for the length of `train()`; at each optimizer step's end, asks every process
    (`agree(flag) -> any process's flag`) whether one was signalled, and if so saves and stops the run."""

    def __init__(
        self,
        signals: list[signal.Signals],
        grace_seconds: float,
        agree: Callable[[bool], bool],
        output_dir: str,
        exit_process: Callable[[int], Any] = os._exit,
        on_interrupt: Callable[[], Any] = lambda: None,
    ):
        self.signals = signals
        self.grace_seconds = grace_seconds
        self.agree = agree
        self.output_dir = output_dir
        self.exit_process = exit_process
        self.on_interrupt = on_interrupt
        self.received: signal.Signals | None = None  # the first preemption signal this process got
        self.preempted = False  # every process agreed to stop: the run saved its checkpoint and stopped
        self._previous: dict[signal.Signals, Any] = {}
        self._deadline: threading.Timer | None = None
        self._step_started = self._last_step_seconds = self._last_save_seconds = 0.0

    # ---------------------------------------------------------------------------------------------- handlers
    def on_train_begin(self, args, state, control, **kwargs):
        self.received, self.preempted = None, False
        if threading.current_thread() is not threading.main_thread():
            if self.signals:
                logger.warning("training runs outside the main thread: preemption signals keep their default action")
            return
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._on_signal)
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not a handler of the caller's own
            self._previous[signal.SIGINT] = signal.signal(signal.SIGINT, self._on_interrupt)
        warning = torchrun_warning(self.grace_seconds, dict(os.environ)) if self.signals else None
        if warning and state.is_local_process_zero:
            logger.warning(warning)

    def on_train_end(self, args, state, control, **kwargs):
        self.restore_signals()

    def restore_signals(self) -> None:
        """The handlers from before `train()` back, the grace timer off (also when `train()` raised)."""
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()
        if self._deadline is not None:  # stopped in time: the checkpoint is written
            self._deadline.cancel()
            self._deadline = None

    def _on_signal(self, signum: int, frame: Any) -> None:
        sig = signal.Signals(signum)
        if self.received is not None:
            logger.warning("%s received: already stopping after this step (since %s)", sig.name, self.received.name)
            return
        self.received = sig
        self._deadline = threading.Timer(self.grace_seconds, self._give_up)
        self._deadline.daemon = True
        self._deadline.start()
        elapsed = time.monotonic() - self._step_started
        logger.warning(
            "%s received: saving a checkpoint once this optimizer step ends, then stopping (within "
            "preemption_grace_seconds=%g; the step has run %.0f s, the last one took %.0f s and the last save %.0f s)",
            sig.name,
            self.grace_seconds,
            elapsed,
            self._last_step_seconds,
            self._last_save_seconds,
        )

    def _on_interrupt(self, signum: int, frame: Any) -> None:
        try:
            self.on_interrupt()
        finally:
            signal.default_int_handler(signum, frame)  # KeyboardInterrupt, as without this handler

    def _give_up(self) -> None:
        """The grace period passed before the step and its checkpoint were done: exit, as the signal would have."""
        complete = complete_checkpoints(self.output_dir)
        newest = str(complete[-1]) if complete else "none (a requeued run starts fresh)"
        print(
            f"error: the optimizer step and its checkpoint did not end within preemption_grace_seconds="
            f"{self.grace_seconds:g} after {self.received.name}; exiting without a new checkpoint. The newest "
            f"complete checkpoint is {newest}. Give the run a longer grace period (the scheduler's and "
            "--preemption_grace_seconds) than one step plus one save.",
            file=sys.stderr,
            flush=True,
        )
        sys.stdout.flush()
        self.exit_process(128 + self.received.value)

    # ------------------------------------------------------------------------------------------------ steps
    def on_step_begin(self, args, state, control, **kwargs):
        self._step_started = time.monotonic()

    def on_step_end(self, args, state, control, **kwargs):
        self._last_step_seconds = time.monotonic() - self._step_started
        if self.signals and self.agree(self.received is not None):
            self.preempted = True
            control.should_save = True
            control.should_training_stop = True
            logger.warning("preempted: saving checkpoint-%d, then stopping", state.global_step)

    def on_save(self, args, state, control, **kwargs):
        self._last_save_seconds = time.monotonic() - self._step_started - self._last_step_seconds


def agreement(accelerator: Any) -> Callable[[bool], bool]:
    """`agree(flag)`: whether any process's flag is set (one all-reduce; no collective with one process)."""
    import torch

    def agree(flag: bool) -> bool:
        if accelerator.num_processes == 1:
            return flag
        count = accelerator.reduce(torch.tensor([int(flag)], device=accelerator.device), reduction="sum")
        return bool(count.item())

    return agree
