"""A process pool whose workers are killed and replaced on timeout: each call runs under a hard wall-clock deadline.

Used to score responses (`dapo_trl.rewards.math_verify`), where one input can keep sympy busy for minutes.

Why not simpler tools:
- math-verify's own timeout is `signal.alarm`: it works only in the main thread of the main interpreter (TRL may score
  off it), and a signal cannot interrupt a long C-level computation (a big-integer power inside sympy).
- `concurrent.futures.ProcessPoolExecutor` cannot cancel a running call, and killing one of its workers breaks the
  whole executor (`BrokenProcessPool`), losing every other worker's call.

So `KillableProcessPool` keeps its own workers, one private pipe each, one call in flight per worker: the deadline of a
call is exact (it starts when the call is sent), a worker past its deadline is SIGKILLed and replaced while the others
go on, and no lock or queue is shared between processes that a kill could leave corrupted.
"""

from __future__ import annotations

import atexit
import importlib
import logging
import multiprocessing
import multiprocessing.forkserver
import os
import signal
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 5.0
# Starting a worker is charged to no call. The first start of the fork server imports the preloaded modules (with
# `dapo_trl` that is torch and transformers, tens of seconds on a loaded machine), hence a generous separate limit.
WORKER_START_TIMEOUT_S = 300.0
# How long `close` waits for a running `map` (in another thread) before it stops the workers anyway.
WORKER_CLOSE_WAIT_S = 10.0
# Workers that die before they are ready, in a row: the environment is broken (see `WorkerStartError`), stop retrying.
MAX_CONSECUTIVE_START_FAILURES = 3
# Environment overrides, so that a command line that only names a reward function can still tune it.
WORKERS_ENV = "DAPO_SCORING_WORKERS"
TIMEOUT_ENV = "DAPO_SCORING_TIMEOUT"

_READY = "ready"


class WorkerStartError(RuntimeError):
    """Scoring workers die before they are ready: an environment problem, not a bad response."""


@dataclass(frozen=True)
class CallResult:
    """The outcome of one call: its value, or that it timed out, or the name of the exception it raised."""

    value: Any = None
    timed_out: bool = False
    error: str | None = None
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.timed_out and self.error is None


def default_num_workers() -> int:
    """$DAPO_SCORING_WORKERS, else the usable CPUs shared among the processes of this node.

    Under `accelerate launch` every rank scores its share of the batch at the same time with its own pool, so
    `cpu_count` workers per rank would oversubscribe the cores (and starved calls would hit their deadline).
    """
    configured = os.environ.get(WORKERS_ENV)
    if configured:
        return max(1, int(configured))
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    ranks_on_node = int(os.environ.get("LOCAL_WORLD_SIZE") or 1)
    return max(1, cpus // max(1, ranks_on_node))


def default_timeout() -> float:
    """$DAPO_SCORING_TIMEOUT in seconds, else DEFAULT_TIMEOUT_S."""
    configured = os.environ.get(TIMEOUT_ENV)
    return float(configured) if configured else DEFAULT_TIMEOUT_S


def _worker_main(conn: Connection, preload: tuple[str, ...], initializer: Callable[[], object] | None = None) -> None:
    """Worker loop: import `preload`, run `initializer`, say ready, then answer each `(fn, args)` call with
    `(True, value)` or `(False, why)`."""
    # Ctrl-C reaches the whole process group; the parent decides when workers stop (it closes the pipe or kills).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for module in preload:
        importlib.import_module(module)  # so that no call's deadline pays for an import
    if initializer is not None:
        initializer()  # e.g. a first call that fills lazy caches, so that the first real call is not slower
    conn.send(_READY)
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return  # the parent is gone
        except Exception as error:  # the call could not be unpickled here; the stream itself is intact
            conn.send((False, f"unpicklable call: {type(error).__name__}"))
            continue
        if message is None:
            return
        fn, args = message
        try:
            reply = (True, fn(*args))
        except BaseException as error:  # noqa: BLE001 - MemoryError, RecursionError...: report, keep the worker
            # Only the type: str() of an exception holding a huge sympy expression can itself take forever.
            reply = (False, type(error).__name__)
        try:
            conn.send(reply)
        except Exception as error:  # an unpicklable return value
            conn.send((False, f"unpicklable result: {type(error).__name__}"))


class _Worker:
    """One worker process, its end of the pipe, and the call it is running."""

    def __init__(
        self,
        ctx: multiprocessing.context.BaseContext,
        preload: tuple[str, ...],
        initializer: Callable[[], object] | None,
    ) -> None:
        parent_end, child_end = ctx.Pipe(duplex=True)
        self.process = ctx.Process(
            target=_worker_main, args=(child_end, preload, initializer), name="dapo-scoring-worker", daemon=True
        )
        self.process.start()
        child_end.close()  # so that the worker's death reads as EOF here
        self.conn = parent_end
        self.ready = False
        self.task: int | None = None
        self.since = time.monotonic()  # start time of the process until it is ready, then of the running call

    def ask_to_stop(self) -> None:
        """Tell an idle worker to exit (it is reaped by `stop`)."""
        try:
            self.conn.send(None)
        except OSError:
            pass  # already gone

    def stop(self, kill: bool) -> None:
        """Reap the worker: SIGKILL it now (`kill`), or after a grace second for an `ask_to_stop`."""
        if not kill:
            self.process.join(timeout=1.0)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=5.0)
        self.conn.close()


_LIVE_POOLS: weakref.WeakSet[KillableProcessPool] = weakref.WeakSet()


class KillableProcessPool:
    """A lazily started pool of worker processes running `fn(*args)` calls, each under a hard per-call deadline.

    Workers start on first use and are reused across calls; `close()` (also run at interpreter exit) stops them.
    `map` may be called from any thread; concurrent calls take turns. A pool belongs to the process that created it.

    Start method: 'forkserver' by default ('spawn' where there is none), not 'fork': the trainer process holds
    torch's thread pools, TRL's event-loop thread and maybe a CUDA context, and forking a multi-threaded process can
    deadlock the child on a lock another thread held. The fork server is a fresh single-threaded process; forking
    workers from it is safe, and because it has `preload` imported, a replacement worker is ready in milliseconds
    (with 'spawn' every replacement would re-import math-verify, sympy and this package, whose `__init__` imports
    torch: seconds of CPU per timeout). As with any non-fork start method,
    a script that uses the pool must guard its entry point with `if __name__ == "__main__":`.
    """

    def __init__(
        self,
        num_workers: int | None = None,
        *,
        preload: Sequence[str] = (),
        initializer: Callable[[], object] | None = None,
        start_method: str | None = None,
    ) -> None:
        self.num_workers = num_workers if num_workers is not None else default_num_workers()
        if self.num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {self.num_workers}")
        if start_method is None:  # no fork server on Windows
            start_method = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
        self._ctx = multiprocessing.get_context(start_method)
        self._preload = tuple(preload)
        self._initializer = initializer
        self._workers: list[_Worker] = []
        self._lock = threading.Lock()
        self._owner_pid = os.getpid()
        self._closed = False
        self._start_failures = 0
        self.replaced_workers = 0  # workers killed for a deadline or lost to a crash, over the pool's life
        _LIVE_POOLS.add(self)

    # ------------------------------------------------------------------------------------------------------ public
    def map(self, fn: Callable[..., Any], calls: Sequence[tuple], timeout: float) -> list[CallResult]:
        """`fn(*args)` for every args tuple in `calls`, in parallel; a call running past `timeout` s is abandoned.

        `fn` must be importable by name (a module-level function) and its arguments and result picklable.
        """
        if not timeout or timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}: the deadline is what makes scoring safe")
        with self._lock:
            if self._closed:
                raise RuntimeError("this KillableProcessPool is closed")
            if os.getpid() != self._owner_pid:
                raise RuntimeError(
                    "a KillableProcessPool cannot be used from a forked child; create one in this process"
                )
            if not calls:
                return []
            self._grow(min(self.num_workers, len(calls)))
            return self._run(fn, calls, timeout)

    def start(self) -> None:
        """Start all workers now and wait until they are ready (optional: `map` starts them on demand)."""
        self.map(_noop, [()] * self.num_workers, timeout=WORKER_START_TIMEOUT_S)

    def close(self) -> None:
        """Stop the workers. Idempotent; further `map` calls raise."""
        if os.getpid() != self._owner_pid:
            self._closed = True  # a forked copy: the workers (and maybe a held lock) are the parent's
            return
        # Bounded wait: at interpreter exit a daemon thread may be stuck inside `map` for good.
        locked = self._lock.acquire(timeout=WORKER_CLOSE_WAIT_S)
        try:
            if self._closed:
                return
            self._closed = True
            workers, self._workers = self._workers, []
            for worker in workers:
                worker.ask_to_stop()
            for worker in workers:
                worker.stop(kill=False)
        finally:
            if locked:
                self._lock.release()

    def __enter__(self) -> KillableProcessPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ----------------------------------------------------------------------------------------------------- private
    def _grow(self, count: int) -> None:
        if not self._workers and self._ctx.get_start_method() == "forkserver":
            self._set_forkserver_preload()
        while len(self._workers) < count:
            self._workers.append(_Worker(self._ctx, self._preload, self._initializer))

    def _set_forkserver_preload(self) -> None:
        """Add this module and `preload` to the fork server's preload list (effective before the server's first start).

        This module matters most: every worker unpickles `_worker_main` from it, and importing `dapo_trl` imports
        torch. Imported once in the server, that costs a worker nothing; imported in each worker, seconds each.
        """
        server = getattr(multiprocessing.forkserver, "_forkserver", None)  # private: read, so as not to drop others'
        current = list(getattr(server, "_preload_modules", ["__main__"]))
        wanted = [__name__, *self._preload]
        self._ctx.set_forkserver_preload(current + [m for m in wanted if m not in current])

    def _replace(self, index: int, kill: bool) -> None:
        self._workers[index].stop(kill=kill)
        self._workers[index] = _Worker(self._ctx, self._preload, self._initializer)
        self.replaced_workers += 1

    def _run(self, fn: Callable[..., Any], calls: Sequence[tuple], timeout: float) -> list[CallResult]:
        results: list[CallResult | None] = [None] * len(calls)
        pending = deque(range(len(calls)))
        while pending or any(worker.task is not None for worker in self._workers):
            for index, worker in enumerate(self._workers):
                if not (worker.ready and worker.task is None and pending):
                    continue
                if not self._send(worker, pending, fn, calls, results):
                    self._lost(index, results)  # it died while idle
            now = time.monotonic()
            deadlines = [w.since + (timeout if w.ready else WORKER_START_TIMEOUT_S) for w in self._busy_or_starting()]
            if deadlines:
                for conn in wait([w.conn for w in self._workers], timeout=max(0.0, min(deadlines) - now)):
                    self._receive(conn, results)
            self._expire(timeout, results)
        return results  # type: ignore[return-value]  # every slot was filled

    def _busy_or_starting(self) -> list[_Worker]:
        return [w for w in self._workers if not w.ready or w.task is not None]

    def _send(
        self,
        worker: _Worker,
        pending: deque[int],
        fn: Callable[..., Any],
        calls: Sequence[tuple],
        results: list[CallResult | None],
    ) -> bool:
        """Send the next pending call to an idle worker; False when the worker turns out to be dead."""
        index = pending.popleft()
        try:
            worker.conn.send((fn, tuple(calls[index])))
        except OSError:  # broken pipe: the call goes back to the queue
            pending.appendleft(index)
            return False
        except Exception as error:  # pickling failed before anything was written: this call's fault only
            results[index] = CallResult(error=f"unpicklable call: {type(error).__name__}")
            return True
        worker.task = index
        worker.since = time.monotonic()
        return True

    def _receive(self, conn: Connection, results: list[CallResult | None]) -> None:
        index = next(i for i, w in enumerate(self._workers) if w.conn is conn)
        worker = self._workers[index]
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the worker died: a crash (segfault, OOM killer) or killed from outside
            self._lost(index, results)
            return
        if message == _READY:
            worker.ready = True
            worker.since = time.monotonic()
            self._start_failures = 0
            return
        ok, value = message
        if worker.task is not None:
            seconds = time.monotonic() - worker.since
            result = CallResult(value=value, seconds=seconds) if ok else CallResult(error=value, seconds=seconds)
            results[worker.task] = result
            worker.task = None

    def _lost(self, index: int, results: list[CallResult | None]) -> None:
        worker = self._workers[index]
        if not worker.ready:
            self._start_failures += 1
            if self._start_failures >= MAX_CONSECUTIVE_START_FAILURES:
                self._fail_to_start()
        elif worker.task is not None:
            # Not retried: a call that crashes its worker would most likely crash the next one too.
            results[worker.task] = CallResult(error="worker died", seconds=time.monotonic() - worker.since)
        self._replace(index, kill=True)

    def _expire(self, timeout: float, results: list[CallResult | None]) -> None:
        now = time.monotonic()
        for index, worker in enumerate(self._workers):
            if worker.task is not None and now - worker.since >= timeout:
                results[worker.task] = CallResult(timed_out=True, seconds=now - worker.since)
                self._replace(index, kill=True)
            elif not worker.ready and now - worker.since >= WORKER_START_TIMEOUT_S:
                self._start_failures += 1
                if self._start_failures >= MAX_CONSECUTIVE_START_FAILURES:
                    self._fail_to_start()
                self._replace(index, kill=True)

    def _fail_to_start(self) -> None:
        for worker in self._workers:
            worker.stop(kill=True)
        self._workers.clear()
        self._start_failures = 0
        raise WorkerStartError(
            f"{MAX_CONSECUTIVE_START_FAILURES} scoring workers in a row died or hung before they were ready. With the "
            f"'{self._ctx.get_start_method()}' start method each worker imports the main script: make sure it guards "
            'its entry point with `if __name__ == "__main__":`, and that the preloaded modules '
            f"{list(self._preload)} import cleanly."
        )


def _noop() -> None:
    """A call that only proves a worker is up (used by `KillableProcessPool.start`)."""


_DEFAULT_POOLS: dict[tuple[Any, ...], KillableProcessPool] = {}
_DEFAULT_POOLS_LOCK = threading.Lock()


def shared_pool(
    num_workers: int | None = None, preload: Sequence[str] = (), initializer: Callable[[], object] | None = None
) -> KillableProcessPool:
    """This process's pool for these settings, created on first use (each rank of a launch gets its own)."""
    key = (os.getpid(), num_workers, tuple(preload), initializer)
    with _DEFAULT_POOLS_LOCK:
        pool = _DEFAULT_POOLS.get(key)
        if pool is None or pool._closed:
            pool = _DEFAULT_POOLS[key] = KillableProcessPool(num_workers, preload=preload, initializer=initializer)
        return pool


@atexit.register
def _close_all_pools() -> None:
    # Registered after multiprocessing's own exit hook, so it runs first (atexit is LIFO): workers get a clean stop.
    for pool in list(_LIVE_POOLS):
        try:
            pool.close()
        except Exception:  # noqa: BLE001 - best effort at interpreter exit
            logger.debug("could not close a scoring pool at exit", exc_info=True)
