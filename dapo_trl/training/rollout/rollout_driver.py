"""The streaming rollout's driver: admits seeded group requests to a generation engine in stream order, each under
its weights version, and holds finished groups until the reorder buffer takes them (`rollout_stream`).

One thread per driver (the engine may have one of its own: `rollout_engine`), never one per group. The driver owns
the engine's weights while it streams: a version is loaded only when no request of ours runs, and a sync made outside
it (`loaded_externally`: a synchronous step, an evaluation) waits for a reload in progress, so the two never race.

An engine that goes away (`EngineUnavailable`: a vLLM server killed or restarting) is waited for, up to
`recovery_timeout` seconds: its requests go back to the plan in stream order, the weights version the first of them
needs is loaded again once it answers (a restarted server holds the base weights), and each is sent again with its
own key and seed, so a batch-invariant engine samples the same tokens; recovery is bounded (`engine_losses`).

With in-flight weight updates (the engine's `updates_in_flight`) the newest published version loads at once, under
the running requests (the engine pauses them), and a request planned for an older version starts under it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import replace

from .driver_state import MOVES, EngineState
from .driver_stats import DriverStats
from .engine_losses import MAX_ENGINE_LOSSES, EngineLosses
from .rollout_engine import EngineUnavailable, GroupEngine, GroupRequest, GroupResult, PartialGroup
from .stream_plan import done_prefix

logger = logging.getLogger(__name__)


class RolloutDriver:
    """Admits planned group requests to the engine in order, at most `max_in_flight` at a time, each under its
    weights version (loaded only when nothing is in flight, once published), and keeps finished groups until taken.

    Runs a thread on the main process; `wait` raises the engine's error (a dead server, a timeout) on the caller.
    """

    def __init__(
        self,
        engine: GroupEngine,
        max_in_flight: int,
        max_held_bytes: int | None = None,
        recovery_timeout: float = 0,
        reload_external: Callable[[], None] | None = None,
        max_engine_losses: int = MAX_ENGINE_LOSSES,
    ):
        self.engine = engine
        self.recovery_timeout = recovery_timeout if hasattr(engine, "wait_available") else 0.0
        self.reload_external = reload_external  # loads the weights a `loaded_externally` sync set, again
        self.max_in_flight = max_in_flight
        # Admission pauses while finished, untaken groups hold this many bytes (token ids, log-probs, routings).
        self.max_held_bytes = max_held_bytes
        self._planned: deque[GroupRequest] = deque()
        self._in_flight: dict[tuple, GroupRequest] = {}
        self._done: dict[tuple, GroupResult] = {}
        self._held_bytes = 0  # in `_done`
        self.last_done = 0.0  # time.monotonic() when a group last finished
        self._wanted: set[tuple] = set()  # what a caller waits for now: admitted whatever is held
        self._known: set[tuple] = set()  # planned, in flight or done
        self._loaded: int | None = None
        self._starting: GroupRequest | None = None  # admitted, engine.start not yet returned
        self._cancel_after_start = False  # withdrawn while starting: cancel once start returns
        self._published = -1
        self._error: BaseException | None = None
        self._order: dict[tuple, int] = {}  # of every known key: requests sent again go back to their place
        self._planned_count = 0
        self._external: int | None = None  # the version a sync outside the driver loaded, while it is the engine's
        self._losses = EngineLosses(max_engine_losses, self.recovery_timeout)
        self._state = EngineState.READY
        self._restored: dict[tuple, PartialGroup] = {}  # groups a checkpoint kept: finished, or continued when admitted
        self.stats = DriverStats()
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._admit_loop, name="dapo-rollout-driver", daemon=True)
        self._thread.start()

    @property
    def recoveries(self) -> int:
        """How many times the engine came back after it went away."""
        return self._losses.recoveries

    # ---------------------------------------------------------------------------------------------- caller side
    def plan(self, requests: list[GroupRequest]) -> None:
        with self._cond:
            for request in requests:
                if request.key not in self._known:
                    self._planned.append(request)
                    self._known.add(request.key)
                    self._order[request.key], self._planned_count = self._planned_count, self._planned_count + 1
            self._cond.notify_all()

    def publish(self, version: int) -> None:
        """Weights `version` (and every earlier one) can be loaded."""
        with self._cond:
            self._published = max(self._published, version)
            self._cond.notify_all()

    def loaded_externally(self, version: int | None) -> None:
        """The engine's weights were set outside the driver (a synchronous sync, an evaluation): now `version`.

        Waits for a reload the driver is running to end first, so that the server's weights have one owner at a
        time: the caller's sync comes after it, and the driver never marks its version loaded over the caller's."""
        with self._cond:
            self._cond.wait_for(self._no_own_load)  # every move notifies (`_enter`)
            self._loaded = self._external = version
            self._cond.notify_all()

    def hold_for_sync(self) -> None:
        """In-flight weight updates whose weights the trainer sends itself (NCCL): once no load of the driver's runs,
        pause the engine with our requests kept; nothing is admitted or loaded until `synced`."""
        with self._cond:
            self._cond.wait_for(self._no_own_load)  # every move notifies (`_enter`)
            if not self._enter(EngineState.LOADING):
                raise RuntimeError(f"generation failed: {self._error}") from self._error
            self._loaded = None
        self.engine.pause()

    def sync_failed(self, exc: BaseException) -> None:
        """The trainer's sync (`hold_for_sync`) failed: the engine is resumed (no paused server is left behind) and
        the driver fails with an error naming the transfer, which every later wait, and a later `train()`'s sync,
        raises at once instead of waiting for a load that will never come."""
        try:
            self.engine.resume(None)
        except Exception as resume_error:  # noqa: BLE001 - the transfer's error is the one to raise
            logger.error("after the failed weight transfer, resuming the engine failed too: %s", resume_error)
        self._fail(RuntimeError(f"the weight transfer to the engine failed ({type(exc).__name__}: {exc})"))

    def synced(self, version: int) -> None:
        """The trainer's sync (`hold_for_sync`) has loaded `version`: mark it in the running answers, resume them."""
        self.engine.resume(version)
        with self._cond:
            if self._enter(EngineState.READY):
                self._loaded, self._published = version, max(self._published, version)

    def planned_keys(self) -> set[tuple]:
        with self._cond:
            return set(self._known)

    def ready_prefix(
        self, keys: list[tuple], minimum: int, timeout: float, stop: Callable[[], bool] = lambda: False
    ) -> int | None:
        """Block until the first `minimum` of `keys` are done (or fail after `timeout`); return how many leading
        keys are done, or None as soon as `stop()` is true (looked at every second at least: a preemption)."""
        started = time.monotonic()
        with self._cond:
            missing = [key for key in keys[:minimum] if key not in self._known]
            if missing:
                raise RuntimeError(f"streaming rollout waits for groups that were never planned: {missing[:3]}")
            self._wanted = set(keys[:minimum])
            self._cond.notify_all()
            while True:
                if self._error is not None:
                    raise RuntimeError(f"generation failed: {self._error}") from self._error
                count = done_prefix(keys, self._done)
                if count >= minimum:
                    self._wanted = set()
                    return count
                if stop():
                    return None
                # A timeout means nothing finished for that long (a wave may rightly take several request times);
                # a recovery is bounded by its own timeout.
                progress = getattr(self.engine, "last_progress", None)  # a server engine's own progress clock
                last = max(started, self.last_done, progress() if progress is not None else 0.0)
                remaining = last + timeout - time.monotonic()
                if remaining <= 0 and self._state not in (EngineState.RECOVERING, EngineState.RESTORING):
                    raise TimeoutError(
                        f"no generated group arrived for {timeout:g} s ({len(self._in_flight)} in flight): the "
                        "vLLM server is stuck or too slow (raise vllm_request_timeout if it is just slow)"
                    )
                self._cond.wait(min(max(remaining, 0.01), 1.0))

    def done_among(self, keys: list[tuple], timeout: float) -> set[tuple]:
        """The keys of `keys` that are done, after waiting up to `timeout` for the first one that is not (if any)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                if self._error is not None:
                    raise RuntimeError(f"generation failed: {self._error}") from self._error
                waiting = next((key for key in keys if key not in self._done), None)
                remaining = deadline - time.monotonic()
                if waiting is None or remaining <= 0:
                    return {key for key in keys if key in self._done}
                self._cond.wait(remaining)

    def take(self, keys: list[tuple]) -> list[GroupResult]:
        with self._cond:
            results = [self._done.pop(key) for key in keys]
            self._held_bytes -= sum(result.nbytes for result in results)
            self._forget(keys)
            self._cond.notify_all()
            return results

    def withdraw(self, keep: Callable[[GroupRequest | GroupResult], bool] = lambda request: False) -> None:
        """Drop every planned, running or finished group that `keep` rejects; running ones are cancelled (their
        answers, if any still come, are ignored)."""
        with self._cond:
            dropped = [request for request in self._planned if not keep(request)]
            self._planned = deque(request for request in self._planned if keep(request))
            self._forget(request.key for request in dropped)
            for key, result in list(self._done.items()):
                if not keep(result):
                    del self._done[key]
                    self._forget([key])
                    self._held_bytes -= result.nbytes
                    self.stats.discarded_tokens += result.tokens
            cancelled = [request for request in self._in_flight.values() if not keep(request)]
            for request in cancelled:
                del self._in_flight[request.key]
                self._forget([request.key])
                self.stats.cancelled_groups += 1
            if self._starting is not None and self._starting in cancelled:
                cancelled.remove(self._starting)  # not started yet: the driver's thread cancels it once it is
                self._cancel_after_start = True
            self.stats.running(bool(self._in_flight))
            self._cond.notify_all()
            while self._starting is not None:  # so that, once this returns, every withdrawn request is cancelled
                self._cond.wait(0.1)
        for request in cancelled:
            self.engine.cancel(request)

    def _forget(self, keys: Iterable[tuple]) -> None:
        """`keys` are no longer planned, running or held (taken or withdrawn); the lock is held."""
        for key in keys:
            self._known.discard(key)
            self._order.pop(key, None)
            self._losses.forget(key)

    def partial_groups(self) -> dict[tuple, PartialGroup]:
        """What a checkpoint keeps of the groups planned for later (in-flight weight updates): the finished ones not
        yet taken, the running ones as far as they were sampled where answers are streamed, and those a checkpoint
        gave back (`restore`) that are not admitted yet."""
        partials = getattr(self.engine, "partial_groups", dict)()  # first: a group finishing meanwhile is then done
        with self._cond:
            kept = {key: PartialGroup.of_result(result) for key, result in self._done.items()}
            running = set(self._in_flight)
            restored = dict(self._restored)
        running_partials = {key: partial for key, partial in partials.items() if key in running and key not in kept}
        return restored | running_partials | kept

    def finished_results(self) -> dict[tuple, GroupResult]:
        """The finished groups not yet taken, by reference (a step's end: O(groups), nothing copied)."""
        with self._cond:
            return dict(self._done)

    def restore(self, groups: dict[tuple, PartialGroup], merge: bool = False) -> None:
        """Groups a checkpoint kept (`partial_groups`): when planned again, a finished one is done at once and a
        running one continues from its kept tokens, unless the version bound of its batch no longer takes it.
        `merge`: added to (and replacing, key by key) those already given back."""
        with self._cond:
            self._restored = {**self._restored, **groups} if merge else dict(groups)

    def take_metrics(self) -> DriverStats:
        with self._cond:
            stats = self.stats
            self.stats = stats.next_period()
            return stats

    def close(self) -> None:
        with self._cond:
            self._enter(EngineState.CLOSED)
        self.withdraw()
        self.engine.close()

    # ---------------------------------------------------------------------------------------------- the thread
    def _admit_loop(self) -> None:
        while True:
            with self._cond:
                recover = self._state is EngineState.RECOVERING
            if recover:
                self._wait_for_engine()
            with self._cond:
                request = load = None
                while request is None and load is None:
                    if self._state in (EngineState.CLOSED, EngineState.FAILED):
                        return
                    if self._state is EngineState.RECOVERING:
                        break
                    if self._state is EngineState.READY:  # (LOADING here: held for the trainer's sync)
                        request, load = self._next_admission()
                    if request is None and load is None:
                        self._cond.wait(0.5)
                if self._state is EngineState.RECOVERING:
                    continue
                if load is not None:
                    self.stats.loads_in_flight += bool(self._in_flight)
                    self._enter(EngineState.LOADING)
                    self._loaded, self._external = None, None
                else:
                    self._planned.popleft()
                    saved = self._restored.pop(request.key, None)
                    if saved is not None and saved.oldest_version >= request.version:
                        self.stats.restored_groups += 1
                        if all(saved.finished):  # a finished group a checkpoint kept: done, nothing to sample
                            self._finished(request.key, saved.result(request.key))
                            continue
                        request = replace(request, partial=saved)
                    if request.version != self._loaded:  # an older plan, started under the loaded version
                        request = replace(request, version=self._loaded)
                    self._in_flight[request.key] = request
                    self._losses.sent(request.key)
                    self._starting, self._cancel_after_start = request, False
                    self.stats.running(bool(self._in_flight))
            if load is not None:
                self._load(load)
            else:
                self._start(request)
            if self._error is not None:
                return

    def _load(self, version: int) -> None:
        try:
            self.engine.load_weights(version)
        except EngineUnavailable as exc:
            self._went_away(exc, loading=version)
            return
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller
            self._fail(exc)
            return
        with self._cond:
            # `loaded_externally` waits while a load runs, so nothing set the weights meanwhile.
            if self._enter(EngineState.READY):
                self._loaded = version

    def _start(self, request: GroupRequest) -> None:
        try:
            self.engine.start(request, self._on_done)
        except BaseException as exc:  # noqa: BLE001 - the caller raises it at once, not after a wave timeout
            self._fail(RuntimeError(f"the engine could not start group {request.key}: {type(exc).__name__}: {exc}"))
            return
        with self._cond:
            cancel = self._cancel_after_start
        if cancel:  # withdrawn while starting; `withdraw` waits for this before it returns
            self.engine.cancel(request)
        with self._cond:
            self._starting, self._cancel_after_start = None, False
            self._cond.notify_all()

    def _went_away(
        self, exc: EngineUnavailable, request: GroupRequest | None = None, loading: int | None = None
    ) -> None:
        """The engine went away: wait for it (`_wait_for_engine`) and send `request` again; or fail, with `exc`
        when there is no recovery, or naming what was lost once a bound of `max_engine_losses` is reached."""
        if self.recovery_timeout <= 0:
            self._fail(exc)
            return
        with self._cond:
            # A loss is new unless a recovery runs, or `request` was sent before the last one: then it was lost with
            # the engine that recovery waited for (it reports late), and was counted with every request in flight.
            recovering = self._state in (EngineState.RECOVERING, EngineState.RESTORING)
            if not recovering and (request is None or not self._losses.sent_before_the_last_recovery(request.key)):
                lost = [r.key for r in ([] if request is None else [request]) + list(self._in_flight.values())]
                error = self._losses.count(exc, lost, loading, self._order.__getitem__, self._engine_name())
                if error is not None:
                    self._fail(error)
                    return
                # A restarted server holds the base weights: the driver's version loads again; a sync's, in
                # `_wait_for_engine`.
                self._enter(EngineState.RECOVERING)
                self._loaded = None
            if request is not None:
                self._planned = deque(sorted([*self._planned, request], key=lambda r: self._order[r.key]))
            self._cond.notify_all()

    def _engine_name(self) -> str:
        url = getattr(self.engine, "base_url", None)
        return f"the vLLM server at {url}" if url else f"the engine ({type(self.engine).__name__})"

    def _wait_for_engine(self) -> None:
        """Wait for the engine to answer, within what is left of `recovery_timeout` since a group last finished."""
        started = time.monotonic()
        try:
            try:
                if self._losses.remaining <= 0:
                    raise EngineUnavailable(f"{self._engine_name()} is still away")
                self.engine.wait_available(self._losses.remaining)
            except EngineUnavailable as exc:
                raise self._losses.spent_error(exc) from exc
            with self._cond:
                external = self._external
                if external is not None:  # a sync from outside waits for this reload (`loaded_externally`)
                    self._enter(EngineState.RESTORING)
            if external is not None:
                if self.reload_external is None:
                    raise EngineUnavailable("the engine came back, but nothing can load the weights a sync set")
                self.reload_external()
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller
            self._fail(exc)
            return
        with self._cond:
            self._losses.recovered(time.monotonic() - started)
            if not self._enter(EngineState.READY):
                return
            self._loaded = external
            self.last_done = time.monotonic()  # the wave's progress clock restarts with the engine
            self._cond.notify_all()
        logger.warning("the engine answers again: sending its %d unfinished groups again", len(self._planned))

    def _no_own_load(self) -> bool:  # the engine's weights have one owner at a time: the driver, or a sync outside it
        return self._state not in (EngineState.LOADING, EngineState.RESTORING)

    def _enter(self, state: EngineState) -> bool:
        """Move to `state` (the lock is held); False, and no move, once closed or failed (a late report of the
        driver's thread). A move `MOVES` does not list is a bug, raised."""
        if self._state in (EngineState.CLOSED, EngineState.FAILED) and state is not EngineState.CLOSED:
            return False
        if state not in (EngineState.FAILED, EngineState.CLOSED) and state not in MOVES[self._state]:
            raise RuntimeError(f"rollout driver: no move from {self._state.value} to {state.value}")
        self._state = state
        self._cond.notify_all()
        return True

    def _fail(self, exc: BaseException) -> None:
        with self._cond:
            self._error, self._starting = exc, None
            self._enter(EngineState.FAILED)

    def _next_admission(self) -> tuple[GroupRequest | None, int | None]:
        """(request, None) to start it now, (None, version) to load that version first, or (None, None) when nothing
        can start now."""
        if self._error is not None:
            return None, None
        # In-flight weight updates: the newest published version loads at once, whatever runs (the engine pauses
        # it), and a request planned for an older version starts under the loaded one: its rows are then fresher
        # than the bound asks, never staler.
        in_flight = getattr(self.engine, "updates_in_flight", False)
        newer = self._published > (-1 if self._loaded is None else self._loaded)
        if in_flight and newer and (self._planned or self._in_flight):  # nothing of ours: the trainer may own it
            return None, self._published
        if not self._planned:
            return None, None
        request = self._planned[0]
        fresher = in_flight and self._loaded is not None and self._loaded > request.version
        if self._loaded == request.version or fresher:
            held = self.max_held_bytes is not None and self._held_bytes >= self.max_held_bytes
            if held and request.key not in self._wanted:
                return None, None  # finished groups wait to be taken: look ahead no further (memory)
            return (request, None) if len(self._in_flight) < self.max_in_flight else (None, None)
        if self._in_flight or request.version > self._published:
            return None, None  # a new version waits for the old one's requests to end, and to be published
        return None, request.version

    def _on_done(self, request: GroupRequest, result: GroupResult | BaseException) -> None:
        with self._cond:
            if self._in_flight.get(request.key) is not request:
                return  # cancelled meanwhile
            del self._in_flight[request.key]
            self.stats.running(bool(self._in_flight))
            if isinstance(result, EngineUnavailable) and self.recovery_timeout > 0:
                self._went_away(result, request)  # the lock is reentrant
                return
            self.last_done = time.monotonic()
            if isinstance(result, BaseException):
                self._error = result
                self._enter(EngineState.FAILED)
                return
            self._losses.finished(request.key)
            self.stats.completed_groups += 1
            self.stats.generated_tokens += result.tokens
            self.stats.switched_groups += result.switches is not None
            self._finished(request.key, result)

    def _finished(self, key: tuple, result: GroupResult) -> None:
        """Group `key` is done: held until taken (the lock is held)."""
        self._done[key] = result
        self._held_bytes += result.nbytes
        self._cond.notify_all()
