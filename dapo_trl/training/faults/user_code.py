"""User code that a preemption must not wait for: reward functions, LLM judges, sandboxes, remote reward services.

Generation and training are abandoned at safe points within a second or two of a preemption signal; a reward that
takes minutes (a judge, a sandbox, a remote service) would otherwise hold the step past the grace period, and the
run would be killed without its checkpoint. So while the trainer scores rewards (`DAPOTrainer._calculate_rewards`:
TRL calls the user's functions, then gathers their results across processes) the main thread is in a *user-code
region* (`Preemption.user_code`): a preemption signal that reaches this process, or any other (through the
launcher's store: `SignalRelay`, which then sends this process's main thread `RELAY_SIGNAL`), raises
`UserCodeInterrupted` in the main thread, as Ctrl-C raises KeyboardInterrupt: a sleep, a socket read or TRL's wait
for its async reward functions is interrupted too; C code that never returns to the interpreter is not.

Before TRL's gather (a collective, which a process still inside its reward could not join), every process reports
its outcome of the region, finished or interrupted, through the launcher's store (`RegionOutcomes`): all abandon the
step when any was interrupted, so all raise `StepAbandoned` at the same point. The abandoned step's groups are
generated and scored again on resume, from the same prompts and seeds.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import signal
import time
from collections.abc import Callable
from typing import Any

# Sent by a process's relay thread to its own main thread when another process was signalled while this one runs
# user code (a real-time signal: no library or launcher uses it, and the relay does not take it for a preemption).
RELAY_SIGNAL: int | None = (
    int(signal.SIGRTMIN) + 3 if hasattr(signal, "SIGRTMIN") and hasattr(signal, "pthread_kill") else None
)
_INTERRUPTED = 1 << 20  # what an interrupted process adds to a region's counter (a finished one adds 1)
_FIRST_POLL, _LONGEST_POLL = 0.001, 0.05  # seconds between reads of the counter while other processes finish


class UserCodeInterrupted(BaseException):
    """Raised in the main thread inside a user-code region by a preemption signal (a BaseException, as
    KeyboardInterrupt: a reward function's `except Exception` does not swallow it)."""


class RegionOutcomes:
    """Every process's outcome of each user-code region (finished, or interrupted), agreed through the launcher's
    store, with no collective: `agree(serial, interrupted)` returns on every process once all have reported region
    `serial`, whether any was interrupted. Each region is one counter key, deleted by the last process to read it."""

    def __init__(self, connect: Callable[[], Any] | None, num_processes: int, prefix: str):
        self.connect = connect  # a client of the launcher's store (None: one process, or no launcher)
        self.num_processes = num_processes
        self.prefix = prefix  # this train()'s keys
        self._store: Any = None

    @property
    def available(self) -> bool:
        """One process needs nobody; several need the launcher's store."""
        return self.num_processes == 1 or self.connect is not None

    def agree(self, serial: int, interrupted: bool) -> bool:
        if self.num_processes == 1:
            return interrupted
        if self._store is None:
            self._store = self.connect()
        key = f"{self.prefix}/{serial}"
        total, poll = self._store.add(key, _INTERRUPTED if interrupted else 1), _FIRST_POLL
        while total % _INTERRUPTED + total // _INTERRUPTED < self.num_processes:
            time.sleep(poll)
            poll = min(2 * poll, _LONGEST_POLL)
            total = self._store.add(key, 0)
        if self._store.add(f"{key}/read", 1) == self.num_processes:  # the last reader: nobody needs the keys now
            self._store.delete_key(key)
            self._store.delete_key(f"{key}/read")
        return total >= _INTERRUPTED


# What a tool call the run stopped returns: the step it belongs to is abandoned, so no row with it is ever trained.
STOPPED_TOOL_RESULT = {"error": "not run: the training run is stopping (preemption)"}
TOOL_POLL_SECONDS = 0.1  # how often an async tool call looks for a preemption


def interruptible_tool(
    tool: Callable[..., Any], region: Callable[[], Any], requested: Callable[[], bool]
) -> Callable[..., Any]:
    """`tool` (a standalone tool or an environment's method that TRL's tool loop calls) that a preemption does not wait
    for (`tool` itself if it is one already): a call made once the run is stopping returns `STOPPED_TOOL_RESULT` at
    once, and a running one is interrupted and returns it (a sync tool runs in the main thread inside `region()`,
    where the signal raises `UserCodeInterrupted`; an async one, on TRL's event loop, is cancelled once
    `requested()`). The tool loop then goes on to its next turn, and the step is abandoned at its next safe point (a
    generation round, or the agreement before the rewards' gather): a tool call (a sandbox, a search engine, a
    remote service) never holds a preemption past its grace. Name, docstring and signature are the tool's (TRL
    builds the tool's schema from them)."""
    if getattr(tool, "_interruptible", False):  # TRL's tables of a batch may share one tool
        return tool
    if inspect.iscoroutinefunction(tool):

        @functools.wraps(tool)
        async def call_async(*args: Any, **kwargs: Any) -> Any:
            if requested():
                return STOPPED_TOOL_RESULT
            task = asyncio.ensure_future(tool(*args, **kwargs))
            while True:
                done, _ = await asyncio.wait({task}, timeout=TOOL_POLL_SECONDS)
                if done:
                    return task.result()
                if requested():
                    task.cancel()
                    return STOPPED_TOOL_RESULT

        call_async._interruptible = True  # type: ignore[attr-defined]
        return call_async

    @functools.wraps(tool)
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            with region():
                return tool(*args, **kwargs)
        except UserCodeInterrupted:
            return STOPPED_TOOL_RESULT

    call._interruptible = True  # type: ignore[attr-defined]
    return call
