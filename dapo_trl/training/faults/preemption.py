"""Preemption: a signal abandons the optimizer step in progress, saves the last completed one, and training stops.

SLURM (`--signal`), Kubernetes and most schedulers give a job a signal and a grace period before they kill it; a DAPO
step at the paper's scale (25-50 minutes) does not fit in one. Here SIGTERM and SIGUSR1 (`preemption_signals`) only
raise a flag, which the processes agree on at "safe points" that every process reaches in the same order: before a
generation batch, between dynamic-sampling rounds, during a generation round (server mode: the main process aborts
its request, and TRL hands every process `AbandonedRound` markers in place of completions), while waiting for a
streamed wave, before every training forward (each micro-batch and token-budget part), and at each optimizer step's
end. Scoring rewards is one too: the user's reward functions (judges, sandboxes, remote services) are interrupted
by the signal in the main thread and every process agrees before TRL's gather (`user_code`); a tool call is
interrupted the same way, later ones return at once, and the step goes on to its next safe point. Colocated vLLM and
transformers' generate finish their round first (there is no request to abort). At a safe
point inside a step every process raises `StepAbandoned`; `RunGuard` then writes the checkpoint of the last
completed optimizer step and `train()` returns, `trainer.preempted` is true, and `train_dapo.py` exits 0. The same
command with `--resume_from_checkpoint latest` continues exactly: it regenerates the abandoned step from the same
prompts and seeds.

Weights, optimizer and LR schedule change only at a step's end, so mid-step they still are the last completed step's.
What a step changes before its end (the RNG states, DAPO's run state: prompt stream, carried groups, streaming
cursor, KL coefficient, and each process's place in its generation batch) is snapshotted at every step's end
(`StepEndState`), right where a periodic checkpoint would be written, and put back before the save.

If no safe point and save end within `preemption_grace_seconds` of the signal, the process exits with 128 + the
signal's number, naming the newest complete checkpoint (the one a requeued run resumes from).

Ctrl-C (SIGINT) still interrupts at once, after `on_interrupt` (the trainer shuts down the HTTP requests in flight,
which TRL's client would otherwise wait for, up to their timeout, before the KeyboardInterrupt got out).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import random
import select
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from transformers import TrainerCallback

from .checkpoints import complete_checkpoints
from .user_code import RELAY_SIGNAL, RegionOutcomes, UserCodeInterrupted

logger = logging.getLogger(__name__)

UNCATCHABLE = {"SIGKILL", "SIGSTOP"}
TORCHRUN_SHUTDOWN_DEFAULT = 30  # seconds torchrun waits after forwarding a signal before it kills its workers
RELAY_POLL_SECONDS = 0.5  # how often the main process looks for another process's signal while it waits alone


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


class StepAbandoned(Exception):
    """Every process agreed, at the same safe point, to abandon the optimizer step in progress (a preemption)."""

    def __init__(self, where: str):
        super().__init__(f"optimizer step abandoned for a preemption signal {where}")
        self.where = where


class AbandonedRound:
    """In place of a completion: the round it belonged to was abandoned for a preemption (`watch_generation`)."""

    def __repr__(self) -> str:
        return "AbandonedRound()"


def is_abandoned_round(rows: Any) -> bool:
    """Whether a round's completions are `AbandonedRound` markers (every process gets the same ones)."""
    return bool(rows) and isinstance(rows[0], AbandonedRound)


class SafePoints:
    """Where a step in progress may be abandoned. This one never abandons (a sampler used without a trainer);
    `Preemption` does when a process was signalled."""

    def requested(self) -> bool:
        """Whether this process knows of a preemption signal (its own; on the main process, any process's)."""
        return False

    def safe_point(self, where: str) -> None:
        """Called by every process at the same point of a step: raises `StepAbandoned` on all when any was signalled."""

    def abandon(self, where: str) -> None:
        """Every process agreed (at a safe point, or in a collective of its own: a streamed wave) to abandon it."""
        raise StepAbandoned(where)


# --------------------------------------------------------------------------------------- the state at a step's end
def rng_states() -> dict[str, Any]:
    """This process's random generators, as Trainer's `_save_rng_state` writes them (python, numpy, torch, CUDA)."""
    states = {"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.random.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.random.get_rng_state_all()
    return states


def restore_rng_states(states: dict[str, Any]) -> None:
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.random.set_rng_state(states["cpu"])
    if "cuda" in states:
        torch.cuda.random.set_rng_state_all(states["cuda"])


def copy_containers(value: Any) -> Any:
    """`value` with every dict, list, tuple and deque copied (tensors and other leaves shared): a snapshot that the
    run's later in-place edits of its containers (a micro-batch's `num_items_in_batch`) cannot reach."""
    if isinstance(value, dict):
        return {key: copy_containers(item) for key, item in value.items()}
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a named tuple
        return type(value)(*(copy_containers(item) for item in value))
    if isinstance(value, (list, tuple, collections.deque)):
        return type(value)(copy_containers(item) for item in value)
    return value


@dataclass
class StepEndState:
    """What the last completed optimizer step left that a step in progress changes: RNG states, DAPO's run state
    ({file: part's state}), this process's own state ({file stem: state}) and the trainer's counters."""

    step: int
    rng: dict[str, Any]
    run_state: dict[str, Any]
    process_state: dict[str, Any]
    counters: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def capture(
        cls, step: int, run_parts: dict[str, Any], process_parts: dict[str, Any], counters: dict[str, Any]
    ) -> StepEndState:
        """Each part's `step_end_state()` where it has one (what a preemption restores, taken cheaply at every
        step's end), else its `state_dict()`, its containers copied."""

        def state(part: Any) -> Any:
            return copy_containers(getattr(part, "step_end_state", part.state_dict)())

        return cls(
            step,
            rng_states(),
            {file: state(part) for file, part in run_parts.items()},
            {stem: state(part) for stem, part in process_parts.items()},
            dict(counters),
        )

    def restore(self, run_parts: dict[str, Any], process_parts: dict[str, Any], device: Any) -> None:
        """Put the RNG states and every part back (each part's `load_state_dict(state, device)`)."""
        restore_rng_states(self.rng)
        for parts, states in ((run_parts, self.run_state), (process_parts, self.process_state)):
            for name, part in parts.items():
                part.load_state_dict(states[name], device)


# --------------------------------------------------------------------------------------- signals between processes
class SignalRelay:
    """Makes a preemption signal that reached any one process visible to the main process while the processes wait
    outside Python: Python runs a signal handler only once the main thread is back in the interpreter, so a process
    blocked in the broadcast of a streamed wave (while the main process waits for the engine) could not say it was
    signalled. Here the signal's wakeup byte (`signal.set_wakeup_fd`) wakes a thread that records the signal
    (`on_signal`) and sets a key in the launcher's store; on every other process the same thread watches that key
    (`peer_signalled`: the main process stops waiting for a wave, a process running user code is interrupted,
    `on_peer_signal`). Without a launcher's store (`connect` None: one process) it does nothing."""

    def __init__(self, process_index: int, connect: Callable[[], Any] | None, poll_seconds: float = RELAY_POLL_SECONDS):
        self.process_index = process_index
        self.connect = connect
        self.poll_seconds = poll_seconds
        self.peer_signalled = threading.Event()
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        self._sockets: tuple[socket.socket, socket.socket] | None = None
        self._previous_fd = -1

    def start(
        self,
        key: str,
        signals: list[signal.Signals],
        on_signal: Callable[[signal.Signals], None],
        on_peer_signal: Callable[[], None] = lambda: None,
    ) -> None:
        """From the main thread, once the signal handlers are installed; `on_peer_signal` is called (from the relay's
        thread) once another process's signal is seen."""
        if self.connect is None or not signals:
            return
        self.peer_signalled.clear()
        self._stopped.clear()
        reader, writer = self._sockets = socket.socketpair()
        writer.setblocking(False)
        self._previous_fd = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        numbers = {int(sig) for sig in signals}
        self._thread = threading.Thread(
            target=self._relay,
            args=(key, numbers, on_signal, on_peer_signal),
            name="dapo-preemption-relay",
            daemon=True,
        )
        self._thread.start()

    def stop(self) -> None:
        """From the main thread: the wakeup fd as it was, the thread ended."""
        if self._thread is None:
            return
        signal.set_wakeup_fd(self._previous_fd)
        self._stopped.set()
        self._thread.join(timeout=2 * self.poll_seconds + 1)
        self._thread = None
        for end in self._sockets:
            end.close()

    def _relay(
        self,
        key: str,
        numbers: set[int],
        on_signal: Callable[[signal.Signals], None],
        on_peer_signal: Callable[[], None],
    ) -> None:
        try:
            store, published = self.connect(), False
            reader = self._sockets[0]
            while not self._stopped.is_set():
                if select.select([reader], [], [], self.poll_seconds)[0]:
                    caught = [number for number in reader.recv(64) if number in numbers]
                    if caught and not published:
                        on_signal(signal.Signals(caught[0]))
                        store.set(key, str(self.process_index))
                        published = True
                if not published and not self.peer_signalled.is_set() and store.check([key]):
                    self.peer_signalled.set()
                    on_peer_signal()
        except Exception as error:  # noqa: BLE001 - the launcher's store went away: the launcher is ending the run
            logger.debug("stopped relaying preemption signals between processes: %s", error)


# ------------------------------------------------------------------------------------------------------ the callback
class Preemption(TrainerCallback, SafePoints):
    """Installs the signal handlers for the length of `train()`, snapshots the state at each optimizer step's end
    (`snapshot()`), and decides at every safe point (`agree(flag) -> any process's flag`) whether to abandon the
    step (`StepAbandoned`); at a step's end a signalled run saves that step and stops, as before."""

    def __init__(
        self,
        signals: list[signal.Signals],
        grace_seconds: float,
        agree: Callable[[bool], bool],
        output_dir: str,
        exit_process: Callable[[int], Any] = os._exit,
        on_interrupt: Callable[[], Any] = lambda: None,
        on_give_up: Callable[[], Any] = lambda: None,
        snapshot: Callable[[], StepEndState | None] = lambda: None,
        relay: SignalRelay | None = None,
        num_processes: int = 1,
    ):
        self.signals = signals
        self.grace_seconds = grace_seconds
        self.agree = agree
        self.output_dir = output_dir
        self.exit_process = exit_process
        self.on_interrupt = on_interrupt
        self.on_give_up = on_give_up  # before the grace exit: e.g. resume a server we hold paused
        self.snapshot = snapshot
        self.relay = relay or SignalRelay(0, None)
        self.num_processes = num_processes
        self.outcomes: RegionOutcomes | None = None  # per train(): each user-code region's outcome on every process
        self._in_user_code = False  # the main thread runs user code that a preemption signal interrupts
        self._regions = 0  # user-code regions entered in this train(): the same count on every process
        self.received: signal.Signals | None = None  # the first preemption signal this process got
        self.preempted = False  # every process agreed to stop: the run saved its checkpoint and stopped
        self.step_end: StepEndState | None = None  # the last completed step's state (`snapshot()`)
        self.saved_step = 0  # the newest step whose checkpoint exists (written, or resumed from) in this train()
        self.in_step = False
        self.signalled_at = self.abandoned_at = 0.0
        self._training = False
        self._runs = 0  # train() calls: each has its own store key
        self._lock = threading.RLock()  # the handler and the relay's thread both report a signal
        self._previous: dict[signal.Signals, Any] = {}
        self._deadline: threading.Timer | None = None
        self._step_started = self._step_ended = self._last_step_seconds = 0.0
        self._last_save_seconds: float | None = None  # of this process's last checkpoint, for sizing the grace

    # ---------------------------------------------------------------------------------------------- handlers
    def on_train_begin(self, args, state, control, **kwargs):
        self.received, self.preempted, self.step_end, self.in_step = None, False, None, False
        self.saved_step, self._training = state.global_step, True  # a resumed run's checkpoint is that step's
        if threading.current_thread() is not threading.main_thread():
            if self.signals:
                logger.warning("training runs outside the main thread: preemption signals keep their default action")
            return
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._on_signal)
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not a handler of the caller's own
            self._previous[signal.SIGINT] = signal.signal(signal.SIGINT, self._on_interrupt)
        if self.signals and RELAY_SIGNAL is not None:
            self._previous[RELAY_SIGNAL] = signal.signal(RELAY_SIGNAL, self._on_relayed_signal)
        self._runs += 1
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self._regions = 0
        prefix = f"dapo_trl/user_code/{attempt}/{self._runs}"
        self.outcomes = RegionOutcomes(self.relay.connect, self.num_processes, prefix)
        if self.signals and not self.outcomes.available:
            logger.warning(
                "%d processes without a launcher's store (torchrun's): a preemption waits for reward functions to "
                "return (launch with accelerate launch --multi_gpu, torchrun or run_dapo.sh)",
                self.num_processes,
            )
        key = f"dapo_trl/preemption/{attempt}/{self._runs}"
        self.relay.start(key, self.signals, self._receive, self._interrupt_user_code)
        warning = torchrun_warning(self.grace_seconds, dict(os.environ)) if self.signals else None
        if warning and state.is_local_process_zero:
            logger.warning(warning)

    def on_train_end(self, args, state, control, **kwargs):
        self.restore_signals()

    def restore_signals(self) -> None:
        """The handlers from before `train()` back, the grace timer off (also when `train()` raised)."""
        self._training = self.in_step = False
        self.relay.stop()
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()
        if self._deadline is not None:  # stopped in time: the checkpoint is written
            self._deadline.cancel()
            self._deadline = None

    def _on_signal(self, signum: int, frame: Any) -> None:
        self._receive(signal.Signals(signum))
        self._raise_in_user_code(f"{signal.Signals(signum).name} received")

    def _on_relayed_signal(self, signum: int, frame: Any) -> None:
        """`RELAY_SIGNAL`, from this process's relay thread: another process was signalled."""
        self._raise_in_user_code("another process was signalled")

    def _raise_in_user_code(self, why: str) -> None:
        """In the main thread, inside a user-code region (a handler runs between two bytecodes of it): interrupt it."""
        if self._in_user_code:
            self._in_user_code = False  # once
            raise UserCodeInterrupted(why)

    def _interrupt_user_code(self) -> None:
        """From the relay's thread, once another process's signal is seen: a main thread inside user code gets
        `RELAY_SIGNAL` (a real signal: it also ends a sleep or a blocking read there)."""
        if self._in_user_code and RELAY_SIGNAL is not None:
            signal.pthread_kill(threading.main_thread().ident, RELAY_SIGNAL)

    def _receive(self, sig: signal.Signals) -> None:
        """A preemption signal, from the handler or the relay's thread (which see the same signal): the first one
        starts the grace period."""
        with self._lock:
            if self.received is not None:
                logger.info("%s received: already stopping (since %s)", sig.name, self.received.name)
                return
            self.received, self.signalled_at = sig, time.monotonic()
            self._deadline = threading.Timer(self.grace_seconds, self._give_up)
            self._deadline.daemon = True
            self._deadline.start()
        last_save = "none yet" if self._last_save_seconds is None else f"{self._last_save_seconds:.1f} s"
        logger.warning(
            "%s received: abandoning the optimizer step in progress at its next safe point, saving the last "
            "completed one, then stopping (within preemption_grace_seconds=%g; the step has run %.0f s, the last one "
            "took %.0f s; last save: %s)",
            sig.name,
            self.grace_seconds,
            time.monotonic() - self._step_started if self.in_step else 0.0,
            self._last_step_seconds,
            last_save,
        )

    def _on_interrupt(self, signum: int, frame: Any) -> None:
        try:
            self.on_interrupt()
        finally:
            signal.default_int_handler(signum, frame)  # KeyboardInterrupt, as without this handler

    def _give_up(self) -> None:
        """The grace period passed before a safe point and the save were reached: exit, as the signal would have."""
        complete = complete_checkpoints(self.output_dir)
        newest = str(complete[-1]) if complete else "none (a requeued run starts fresh)"
        print(
            f"error: the step in progress did not reach a safe point and its checkpoint was not written within "
            f"preemption_grace_seconds={self.grace_seconds:g} after {self.received.name}; exiting without a new "
            f"checkpoint. The newest complete checkpoint is {newest}. Give the run a longer grace period (the "
            "scheduler's and --preemption_grace_seconds) than one save plus one micro-batch (safe points come "
            "before it, between dynamic-sampling rounds and during a generation round (server mode; colocated: "
            "after the round), and while waiting for a streamed wave).",
            file=sys.stderr,
            flush=True,
        )
        try:
            self.on_give_up()
        except Exception as exc:  # noqa: BLE001 - exiting anyway
            logger.error("before the grace exit: %s", exc)
        sys.stdout.flush()
        self.exit_process(128 + self.received.value)

    # ------------------------------------------------------------------------------------------- safe points
    def requested(self) -> bool:
        return bool(self.signals) and self.in_step and (self.received is not None or self.relay.peer_signalled.is_set())

    def safe_point(self, where: str) -> None:
        if self.signals and self.in_step and self.agree(self.received is not None):
            self.abandon(where)

    def abandon(self, where: str) -> None:
        self.abandoned_at = time.monotonic()
        super().abandon(where)

    @contextlib.contextmanager
    def user_code(self, where: str) -> Iterator[Callable[[], None]]:
        """A user-code region (`user_code` module): within the block a preemption signal, this process's or any
        other's, raises `UserCodeInterrupted` in the main thread. Yields `finished`, to be called once the user's
        code is done and before the block's collective (TRL's gather): every process then reports its outcome, and
        all raise `StepAbandoned` (`where`) when any was interrupted; an interrupted region reports and raises it as
        the block unwinds. Outside a training step, off the main thread, or without signals: a plain block."""
        if not (self._interruptible_here() and self.outcomes is not None and self.outcomes.available):
            yield lambda: None
            return
        self._regions += 1
        region, reported = self._regions, []

        def report(interrupted: bool) -> bool:
            self._in_user_code = False
            reported.append(interrupted)
            return self.outcomes.agree(region, interrupted)

        def finished() -> None:
            if not reported and report(False):
                self.abandon(where)

        try:
            with self._signals_interrupt():
                yield finished
        except UserCodeInterrupted:
            if not reported:
                report(True)
            self.abandon(where)
        finished()  # a block that did not call it (nothing to gather): the processes still agree

    @contextlib.contextmanager
    def interruptible(self) -> Iterator[None]:
        """User code a step may leave unfinished (a tool call: `user_code.interruptible_tool`): within the block a
        preemption signal, this process's or any other's, raises `UserCodeInterrupted` in the main thread (at once
        if one came before it began). No agreement of its own: the caller ends the call and the step goes on to its
        next safe point, where every process abandons it. Outside a training step, off the main thread, or without
        signals: a plain block."""
        if not self._interruptible_here() or self._in_user_code:  # inside a user-code region: its handling holds
            yield
            return
        with self._signals_interrupt():
            yield

    def _interruptible_here(self) -> bool:
        """Whether a signal can interrupt user code now: in a training step, on the main thread, signals caught."""
        return (
            bool(self.signals)
            and self._training
            and self.in_step
            and threading.current_thread() is threading.main_thread()
        )

    @contextlib.contextmanager
    def _signals_interrupt(self) -> Iterator[None]:
        """Within the block a preemption signal, this process's or any other's, raises `UserCodeInterrupted` in the
        main thread; at once if one came before it began."""
        self._in_user_code = True
        try:
            if self.requested():  # signalled before it began (this process or another)
                raise UserCodeInterrupted("signalled before the user code began")
            yield
        finally:
            self._in_user_code = False

    # ------------------------------------------------------------------------------------------------ steps
    def on_step_begin(self, args, state, control, **kwargs):
        self._step_started, self.in_step = time.monotonic(), True

    def on_step_end(self, args, state, control, **kwargs):
        self._step_ended, self.in_step = time.monotonic(), False
        self._last_step_seconds = self._step_ended - self._step_started
        if not self.signals:
            return
        self.step_end = self.snapshot()
        if self.agree(self.received is not None):
            self.preempted = True
            control.should_save = True
            control.should_training_stop = True
            logger.warning("preempted at the end of a step: saving checkpoint-%d, then stopping", state.global_step)

    def on_evaluate(self, args, state, control, **kwargs):
        """An evaluation between steps draws random numbers before the step's checkpoint would be written."""
        if self.signals and self._training and not self.in_step:
            self.step_end, self._step_ended = self.snapshot(), time.monotonic()

    def on_save(self, args, state, control, **kwargs):
        self.saved_step = state.global_step
        self._last_save_seconds = time.monotonic() - self._step_ended


def agreement(accelerator: Any) -> Callable[[bool], bool]:
    """`agree(flag)`: whether any process's flag is set (one all-reduce; no collective with one process)."""

    def agree(flag: bool) -> bool:
        if accelerator.num_processes == 1:
            return flag
        count = accelerator.reduce(torch.tensor([int(flag)], device=accelerator.device), reduction="sum")
        return bool(count.item())

    return agree
