"""Streaming dynamic sampling: the engine is kept busy group by group, groups are accepted in prompt-stream order.

Rounds (`DynamicSampler.sample`) send a whole round as one request and wait for its longest response before the next
round starts. Here every group is its own seeded request (`rollout_engine`), admitted while fewer than
`rollout_max_in_flight_groups` run; the next round's groups are admitted before the current one has drained. Groups
are scored as soon as an in-order prefix of the round is complete (a reorder buffer), through the same TRL scoring
as a round, and `DynamicSampler.add` takes the same keep decisions in the same order. So which groups make a batch
depends only on the prompt stream, the per-group seeds and the weights, never on which response finished first:

- a group's key is its place in the prompt stream (`("stream", n)`, the n-th prompt drawn) or in the step's
  dataloader batch (`("batch", generation, g)`); its seed is a hash of the run's seed and that key;
- batch j is sampled by the weights of generation max(0, j - lag) (`rollout_max_staleness`): 0 is today's
  synchronous step; with lag >= 1 the next batch is generated while the trainer trains, its prompts all drawn from
  the seeded stream (the dataloader's next batch is not known yet);
- groups generated for a batch but not consumed by it (admitted ahead, before the batch turned out full) are
  cancelled and regenerated with the same seed under the next batch's weights: every trained row is exactly `lag`
  steps old (carried surplus one more, as in rounds), and a resumed run regenerates them identically.

With a vLLM server only the main process talks to the engine (`RolloutDriver`, a background thread); it broadcasts
each scored part's completions. With colocated vLLM every process drives its own engine with the groups it owns
(every P-th of the stream) and the finished groups are gathered. Either way every process scores the same rows, so
all take the same decisions, as with rounds.
"""

from __future__ import annotations

import hashlib
import math
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Container
from dataclasses import dataclass, field
from typing import Any

import torch

from ..algorithm import group_keep_mask
from .batch_metrics import decided_groups, trained_batch_metrics
from .rollout_engine import GroupEngine, GroupRequest, GroupResult
from .sampling import DynamicSampler, Filling, ScoredRound

ROLLOUT_STATE_FILE = "dapo_rollout_state.pt"
SPREAD_POLL_SECONDS = 0.05  # engines on every process: how often the processes compare their finished groups
AHEAD_FACTOR = 2.0  # with staleness >= 1: the next batch's expected rounds x this are admitted while it trains
MAX_WAVES_PER_ROUND = 4  # a round is scored in at most this many passes (each a full forward: under ZeRO-3 a gather)
ROW_VERSION = "dapo_sampled_version"  # per-row tensor while a batch is filled: the weights version that sampled it


def group_seed(run_seed: int, key: tuple) -> int:
    """The sampling seed of the group at `key`: the same in every run with this seed, and on resume."""
    digest = hashlib.sha256(repr((run_seed, key)).encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


def done_prefix(keys: list[tuple], done: Container[tuple]) -> int:
    """How many leading keys of `keys` are in `done` (the in-order prefix a reorder buffer may pass on)."""
    count = 0
    while count < len(keys) and keys[count] in done:
        count += 1
    return count


class StreamCursor:
    """The sampler's prompt stream with a look-ahead: the main process peeks at prompts it admits early; every
    process takes them, in the same order, when a round consumes them. Drawn-but-untaken prompts are saved."""

    def __init__(self, stream: Any):
        self.stream = stream
        self.lookahead: deque[tuple[int, Any]] = deque()
        self.drawn = 0

    def peek(self, count: int) -> list[tuple[int, Any]]:
        """The next `count` (index, item) pairs without consuming them."""
        while len(self.lookahead) < count:
            (item,) = self.stream.draw(1)
            self.lookahead.append((self.drawn, item))
            self.drawn += 1
        return [self.lookahead[i] for i in range(count)]

    def take(self, count: int) -> list[tuple[int, Any]]:
        taken = self.peek(count)
        for _ in range(count):
            self.lookahead.popleft()
        return taken

    def state_dict(self) -> dict[str, Any]:
        return {"lookahead": list(self.lookahead), "drawn": self.drawn}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.lookahead, self.drawn = deque(state["lookahead"]), state["drawn"]


@dataclass
class DriverStats:
    """What the engine did since the last `take_metrics`."""

    since: float = field(default_factory=time.monotonic)
    busy: float = 0.0  # seconds with at least one request in flight
    completed_groups: int = 0
    generated_tokens: int = 0
    cancelled_groups: int = 0
    discarded_tokens: int = 0  # completed, then not used (admitted ahead for a batch that was already full)


class RolloutDriver:
    """Admits planned group requests to the engine in order, at most `max_in_flight` at a time, each under its
    weights version (loaded only when nothing is in flight, once published), and keeps finished groups until taken.

    Runs a thread on the main process; `wait` raises the engine's error (a dead server, a timeout) on the caller.
    """

    def __init__(self, engine: GroupEngine, max_in_flight: int, max_held_tokens: int | None = None):
        self.engine = engine
        self.max_in_flight = max_in_flight
        self.max_held_tokens = max_held_tokens  # admission pauses while finished, untaken groups hold this many
        self._planned: deque[GroupRequest] = deque()
        self._in_flight: dict[tuple, GroupRequest] = {}
        self._done: dict[tuple, GroupResult] = {}
        self._held_tokens = 0  # in `_done`
        self._wanted: set[tuple] = set()  # what a caller waits for now: admitted whatever is held
        self._known: set[tuple] = set()  # planned, in flight or done
        self._loaded: int | None = None
        self._loading = False  # a load_weights call runs on the driver's thread
        self._epoch = 0  # bumped whenever the weights are set outside the driver: a load begun before is void
        self._starting: GroupRequest | None = None  # admitted, engine.start not yet returned
        self._cancel_after_start = False  # withdrawn while starting: cancel once start returns
        self._published = -1
        self._error: BaseException | None = None
        self._closed = False
        self._busy_since: float | None = None
        self.stats = DriverStats()
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._admit_loop, name="dapo-rollout-driver", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------------------------------------- caller side
    def plan(self, requests: list[GroupRequest]) -> None:
        with self._cond:
            for request in requests:
                if request.key not in self._known:
                    self._planned.append(request)
                    self._known.add(request.key)
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
            while self._loading and self._error is None:
                self._cond.wait(1.0)
            self._epoch += 1
            self._loaded = version
            self._cond.notify_all()

    def planned_keys(self) -> set[tuple]:
        with self._cond:
            return set(self._known)

    def ready_prefix(self, keys: list[tuple], minimum: int, timeout: float) -> int:
        """Block until the first `minimum` of `keys` are done (or fail after `timeout`); return how many leading
        keys are done."""
        deadline = time.monotonic() + timeout
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
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(
                        f"no generated group arrived for {timeout:g} s ({len(self._in_flight)} in flight): the "
                        "vLLM server is stuck or too slow (raise vllm_request_timeout if it is just slow)"
                    )
                self._cond.wait(min(remaining, 1.0))

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
            self._held_tokens -= sum(result.tokens for result in results)
            self._known.difference_update(keys)
            self._cond.notify_all()
            return results

    def withdraw(self, keep: Callable[[GroupRequest | GroupResult], bool] = lambda request: False) -> None:
        """Drop every planned, running or finished group that `keep` rejects; running ones are cancelled (their
        answers, if any still come, are ignored)."""
        with self._cond:
            dropped = [request for request in self._planned if not keep(request)]
            self._planned = deque(request for request in self._planned if keep(request))
            self._known.difference_update(request.key for request in dropped)
            for key, result in list(self._done.items()):
                if not keep(result):
                    del self._done[key]
                    self._known.discard(key)
                    self._held_tokens -= result.tokens
                    self.stats.discarded_tokens += result.tokens
            cancelled = [request for request in self._in_flight.values() if not keep(request)]
            for request in cancelled:
                del self._in_flight[request.key]
                self._known.discard(request.key)
                self.stats.cancelled_groups += 1
            if self._starting is not None and self._starting in cancelled:
                cancelled.remove(self._starting)  # not started yet: the driver's thread cancels it once it is
                self._cancel_after_start = True
            self._update_busy()
            self._cond.notify_all()
        for request in cancelled:
            self.engine.cancel(request)

    def take_metrics(self) -> DriverStats:
        with self._cond:
            now = time.monotonic()
            if self._busy_since is not None:
                self.stats.busy += now - self._busy_since
                self._busy_since = now
            stats, self.stats = self.stats, DriverStats(since=now)
            return stats

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self.withdraw()
        self.engine.close()

    # ---------------------------------------------------------------------------------------------- the thread
    def _admit_loop(self) -> None:
        while True:
            with self._cond:
                request = None
                while not self._closed and request is None:
                    request, load = self._next_admission()
                    if request is None:
                        self._cond.wait(0.5)
                if self._closed:
                    return
                if load:
                    self._loaded, self._loading, epoch = None, True, self._epoch
                else:
                    self._planned.popleft()
                    self._in_flight[request.key] = request
                    self._starting, self._cancel_after_start = request, False
                    self._update_busy()
            if load:
                self._load(request.version, epoch)
            else:
                self._start(request)
            if self._error is not None:
                return

    def _load(self, version: int, epoch: int) -> None:
        try:
            self.engine.load_weights(version)
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller
            self._fail(exc)
            return
        with self._cond:
            self._loading = False
            if self._epoch == epoch:  # else the weights were set by the trainer meanwhile: theirs stand
                self._loaded = version
            self._cond.notify_all()

    def _start(self, request: GroupRequest) -> None:
        try:
            self.engine.start(request, self._on_done)
        except BaseException as exc:  # noqa: BLE001 - the caller raises it at once, not after a wave timeout
            self._fail(RuntimeError(f"the engine could not start group {request.key}: {type(exc).__name__}: {exc}"))
            return
        with self._cond:
            cancel, self._starting, self._cancel_after_start = self._cancel_after_start, None, False
        if cancel:
            self.engine.cancel(request)

    def _fail(self, exc: BaseException) -> None:
        with self._cond:
            self._error, self._loading, self._starting = exc, False, None
            self._cond.notify_all()

    def _next_admission(self) -> tuple[GroupRequest | None, bool]:
        """(request, whether its weights must be loaded first), or (None, _) when nothing can start now."""
        if self._error is not None or not self._planned:
            return None, False
        request = self._planned[0]
        if self._loaded == request.version:
            held = self.max_held_tokens is not None and self._held_tokens >= self.max_held_tokens
            if held and request.key not in self._wanted:
                return None, False  # finished groups wait to be taken: look ahead no further (memory)
            return (request, False) if len(self._in_flight) < self.max_in_flight else (None, False)
        if self._in_flight or request.version > self._published:
            return None, False  # a new version waits for the old one's requests to end, and to be published
        return request, True

    def _on_done(self, request: GroupRequest, result: GroupResult | BaseException) -> None:
        with self._cond:
            if self._in_flight.get(request.key) is not request:
                return  # cancelled meanwhile
            del self._in_flight[request.key]
            self._update_busy()
            if isinstance(result, BaseException):
                self._error = result
            else:
                self._done[request.key] = result
                self._held_tokens += result.tokens
                self.stats.completed_groups += 1
                self.stats.generated_tokens += result.tokens
            self._cond.notify_all()

    def _update_busy(self) -> None:
        now = time.monotonic()
        if self._in_flight and self._busy_since is None:
            self._busy_since = now
        elif not self._in_flight and self._busy_since is not None:
            self.stats.busy += now - self._busy_since
            self._busy_since = None


@dataclass
class Wave:
    """A scored part of a round as the main process broadcasts it: its groups' results, or the error that stopped
    generation (so that every process raises instead of waiting in a collective)."""

    results: list[GroupResult] | None
    error: str | None = None


WaveScorer = Callable[[list[dict[str, Any]], dict[str, list]], ScoredRound]


class StreamingRollout:
    """`DynamicSampler`'s rounds, streamed (see the module docstring). Every process builds one. With one engine
    (a vLLM server) only the main process has a `driver` and broadcasts each wave; with `engine_per_process`
    (colocated vLLM) every process drives its own engine with the groups it owns (`owns`), and the finished groups
    are gathered. `tokenize(prompts)` gives prompt token ids as TRL tokenizes them; `broadcast(obj)` returns the main
    process's object on every process."""

    def __init__(
        self,
        sampler: DynamicSampler,
        driver: RolloutDriver | None,
        tokenize: Callable[[list[Any]], list[list[int]]],
        broadcast: Callable[[Any], Any],
        lag: int,
        lookahead_rounds: int,
        wave_timeout: float,
        engine_per_process: bool = False,
    ):
        self.sampler = sampler
        self.engine_per_process = engine_per_process
        self.driver = driver
        self.tokenize = tokenize
        self.broadcast = broadcast
        self.lag = lag
        self.lookahead_rounds = lookahead_rounds
        self.wave_timeout = wave_timeout
        self.cursor = StreamCursor(sampler.stream)
        self.generation = 0  # batches sampled so far
        self.process = sampler.process
        self.group_size = sampler.group_size
        self.unit = self.process.count // math.gcd(self.group_size, self.process.count)  # groups per equal split
        self.keep_rate = 0.5  # running estimate, for how far ahead to admit (never for what is trained)
        self._wait = 0.0

    @property
    def version(self) -> int:
        """The weights version that samples the current batch."""
        return max(0, self.generation - self.lag)

    # ------------------------------------------------------------------------------------------------- a batch
    def sample(self, inputs: list[dict[str, Any]], score_wave: WaveScorer) -> tuple[dict[str, torch.Tensor], dict]:
        """The step's whole batch and its metrics, as `DynamicSampler.sample` would build it from these prompts."""
        sampler, args = self.sampler, self.sampler.args
        round_groups = args.filter_groups_oversample * len(inputs) * self.process.count // self.group_size
        filling = sampler.begin(len(inputs))
        rounds = [self._first_round(inputs, round_groups)]
        self._plan_ahead(rounds, round_groups, filling)
        self._wait, self._passes = 0.0, 0
        self._decided = Counter()  # groups decided on before the batch filled (`batch_metrics.decided_groups`)
        self._decided_rows: list[dict[str, Any]] = []  # their `row_stats`
        while True:
            filling.stats["rounds"] += 1
            filling.round_dropped = []
            self._stream_round(rounds[-1], score_wave, filling)
            if filling.full or not sampler.rounds_left(filling):
                break
            rounds.append(self._keyed(self._take(round_groups)))
            self._plan_ahead(rounds, round_groups, filling)
        observed = filling.stats["groups_kept"] / max(filling.stats["groups_generated"], 1)
        self.keep_rate = 0.8 * self.keep_rate + 0.2 * max(observed, 0.05)
        batch, metrics = sampler.finish(filling)
        metrics["dynamic_sampling/groups_cancelled"] = float(filling.stats["groups_cancelled"])
        metrics.update(self._staleness(batch.pop(ROW_VERSION, None), batch.get("completion_mask")))
        metrics["rollout/scoring_passes"] = float(self._passes)
        metrics.update(self._decided_metrics())
        metrics["rollout/trainer_wait_seconds"] = self._wait
        consumed = {key for groups in rounds for key, _ in groups}
        self.generation += 1
        if self.driver is not None:
            version = self.version
            self.driver.withdraw(keep=lambda item: item.version == version and item.key[0] == "stream"
                                 and item.key not in consumed)  # fmt: skip
            if self.lag > 0:  # generate the next batch while this one trains
                self._plan_stream(self.expected_rounds(round_groups) * round_groups)
        return batch, metrics

    def _record_decided(self, scored: ScoredRound, filling: Filling) -> None:
        """Count the wave's groups that any timing scores for this batch (all of them with carried surplus, whose
        rounds are always scored whole; else those up to the one that fills the batch), and keep their rows'
        figures: the step's reward, length and keep metrics are over these."""
        size, args = self.group_size, self.sampler.args
        kept = group_keep_mask(scored.accuracy.cpu(), size, args.filter_groups_atol)
        decided = len(kept) if args.filter_groups_carry_surplus else decided_groups(
            kept, size, filling.kept_rows, filling.target_rows)  # fmt: skip
        self._decided["generated"] += decided
        self._decided["kept"] += int(kept[:decided].sum())
        if scored.row_stats is not None and decided:
            stats = scored.row_stats
            rows = {key: stats[key][: decided * size] for key in ("rewards_per_func", "lengths", "truncated")}
            self._decided_rows.append({**rows, "names": stats["names"], "weights": stats["weights"]})

    def _decided_metrics(self) -> dict[str, float]:
        """The step's reward and completion metrics and keep counts over the decided groups (`_record_decided`);
        without carried surplus every other group of its rounds counts as cancelled."""
        metrics = {}
        if self._decided_rows:
            last = self._decided_rows[-1]
            metrics = trained_batch_metrics(self._decided_rows, last["weights"], last["names"], self.group_size)
        if not self.sampler.args.filter_groups_carry_surplus:
            generated, kept = self._decided["generated"], self._decided["kept"]
            metrics["dynamic_sampling/groups_cancelled"] = float(self._decided["planned"] - generated)
            metrics["dynamic_sampling/groups_generated"] = float(generated)
            metrics["dynamic_sampling/groups_kept"] = float(kept)
            metrics["dynamic_sampling/keep_rate"] = kept / max(generated, 1)
            metrics["dynamic_sampling/surplus_discarded_groups"] = 0.0
        return metrics

    def _staleness(self, versions: torch.Tensor | None, completion_mask: torch.Tensor | None) -> dict[str, float]:
        """Mean and max of (generation - the version that sampled the row) over the batch's trained rows (filler
        rows, masked out of the loss, left out). A carried group from a checkpoint older than per-row versions
        counts as one step older than this batch's own version."""
        if versions is None:  # carried from a checkpoint written before rows carried their version
            versions = torch.full((len(completion_mask),), self.version - 1, dtype=torch.long)
        ages = (self.generation - versions.cpu().long()).float()
        if completion_mask is not None:
            ages = ages[completion_mask.sum(dim=1).cpu() > 0]
        if ages.numel() == 0:
            return {"rollout/staleness_mean": 0.0, "rollout/staleness_max": 0.0}
        return {"rollout/staleness_mean": ages.mean().item(), "rollout/staleness_max": ages.max().item()}

    def expected_rounds(self, round_groups: int) -> int:
        """How many rounds of the next batch to admit while the trainer trains: twice what the running keep rate
        says it needs (an engine that runs out of work idles until the trainer scores; work past the batch's cut
        costs only otherwise idle engine time), capped by max_filter_gen_batches."""
        target_groups = round_groups / self.sampler.args.filter_groups_oversample
        rounds = max(1, math.ceil(AHEAD_FACTOR * target_groups / self.keep_rate / round_groups))
        cap = self.sampler.args.max_filter_gen_batches
        return min(rounds, cap) if cap else rounds

    def _first_round(self, inputs: list[dict[str, Any]], round_groups: int) -> list[tuple[tuple, dict[str, Any]]]:
        if self.lag > 0:  # every prompt from the seeded stream: the next dataloader batch is unknown a step early
            return self._keyed(self._take(round_groups))
        loader_rows = self.process.gather_objects(inputs)
        groups = [
            (("batch", self.generation, g), loader_rows[g * self.group_size])
            for g in range(len(loader_rows) // self.group_size)
        ]
        extra = round_groups - len(groups)  # over-sampling: fresh prompts complete the first round
        return groups + (self._keyed(self._take(extra)) if extra else [])

    def _take(self, count: int) -> list[tuple[int, Any]]:
        """Consume the next `count` prompts of the stream (every process, in lockstep)."""
        taken = self.cursor.take(count)
        if not hasattr(self.sampler.dataset, "__len__"):  # an IterableDataset: every process must read the same rows
            self.sampler.check_processes_agree([item for _, item in taken])
        return taken

    def _keyed(self, drawn: list[tuple[int, Any]]) -> list[tuple[tuple, dict[str, Any]]]:
        dataset, streamed = self.sampler.dataset, not hasattr(self.sampler.dataset, "__len__")
        return [(("stream", index), dict(item) if streamed else dict(dataset[item])) for index, item in drawn]

    def _plan_ahead(self, rounds: list, round_groups: int, filling: Filling) -> None:
        """Main process: admit the current round, and the stream beyond it while the batch may still need it."""
        if self.driver is None:
            return
        self._plan(rounds[-1])
        pending_groups = len(rounds[-1])
        needed = (filling.target_rows - filling.kept_rows) / self.group_size
        if pending_groups * self.keep_rate < needed or self.lag > 0:
            self._plan_stream(self.lookahead_rounds * round_groups)

    def _plan_stream(self, groups: int) -> None:
        self._plan(self._keyed(self.cursor.peek(groups)))

    def _plan(self, groups: list[tuple[tuple, dict[str, Any]]]) -> None:
        known = self.driver.planned_keys()
        fresh = [(key, row) for key, row in groups if key not in known and self.owns(key)]
        if not fresh:
            return
        prompt_ids = self.tokenize([row["prompt"] for _, row in fresh])
        seed = self.sampler.args.seed
        pairs = zip(fresh, prompt_ids, strict=True)
        self.driver.plan([GroupRequest(key, ids, group_seed(seed, key), self.version) for (key, _), ids in pairs])

    def _stream_round(self, groups: list, score_wave: WaveScorer, filling: Filling) -> None:
        """Score the round in waves of in-order finished groups; stop early once full unless surplus is carried."""
        keys = [key for key, _ in groups]
        start, least = 0, self.least_wave(len(groups))
        self._decided["planned"] += len(groups)
        while start < len(groups):
            wave = self._next_wave(keys[start:], least)
            results = wave.results or []
            count = len(results)
            rows, prepared = self._wave_rows(groups[start : start + count], results)
            scored = score_wave(rows, prepared)
            self._passes += 1
            self._record_decided(scored, filling)
            versions = [result.version for result in results for _ in range(self.group_size)]
            scored.rows[ROW_VERSION] = torch.tensor(versions, device=scored.rows["advantages"].device)
            self.sampler.add(filling, scored)
            start += count
            if filling.full and not self.sampler.args.filter_groups_carry_surplus:
                filling.stats["groups_cancelled"] += len(groups) - start
                break

    def least_wave(self, round_length: int) -> int:
        """The fewest groups a wave holds (but a round's last): a round is scored in at most MAX_WAVES_PER_ROUND
        passes, each a whole number of `unit`s. Each pass is a full forward of the policy (and the reference): with
        a wave per finished group, ZeRO-3 would gather every parameter once per group."""
        least = max(1, math.ceil(round_length / MAX_WAVES_PER_ROUND))
        return math.ceil(least / self.unit) * self.unit

    def owns(self, key: tuple) -> bool:
        """Whether this process's engine generates the group at `key` (with one engine: the main process, all)."""
        if not self.engine_per_process:
            return True
        return key[-1] % self.process.count == self.process.index  # the n-th of the stream / g-th of the batch

    def _next_wave(self, keys: list[tuple], least: int) -> Wave:
        """Main: wait for the next in-order finished groups (at least `least`, a multiple of `unit`, or the round's
        rest). Every process: receive them."""
        if self.engine_per_process:
            return self._next_spread_wave(keys, least)
        wave = None
        if self.driver is not None:
            try:
                started = time.monotonic()
                minimum = min(least, len(keys))
                ready = self.driver.ready_prefix(keys, minimum, self.wave_timeout)
                wave = Wave(self.driver.take(keys[: self._wave_size(ready, len(keys))]))
                self._wait += time.monotonic() - started
            except Exception as exc:  # noqa: BLE001 - every process raises it below
                wave = Wave(None, f"{type(exc).__name__}: {exc}")
        wave = self.broadcast(wave)
        if wave.error is not None:
            raise RuntimeError(f"streaming rollout stopped: {wave.error}")
        return wave

    def _wave_size(self, ready: int, remaining: int) -> int:
        """Groups in the next wave when `ready` leading ones of the `remaining` are done: a multiple of `unit` (so
        the rows split equally across processes), or the round's whole rest."""
        return ready if ready == remaining else ready - ready % self.unit

    def _next_spread_wave(self, keys: list[tuple], least: int) -> Wave:
        """Every process reports which of its groups are done until the in-order prefix of `keys` holds a wave,
        then the processes' results in it are gathered. The main process's clock decides a timeout, so all stop."""
        started = time.monotonic()
        minimum = min(least, len(keys))
        mine = [key for key in keys if self.owns(key)]
        while True:
            try:
                done, error = self.driver.done_among(mine, SPREAD_POLL_SECONDS), None
            except Exception as exc:  # noqa: BLE001 - every process raises it below
                done, error = set(), f"{type(exc).__name__}: {exc}"
            timed_out = time.monotonic() - started > self.wave_timeout
            reports = self.process.gather_objects([(done, error, timed_out)])
            errors = [error for _, error, _ in reports if error is not None]
            if errors:
                raise RuntimeError(f"streaming rollout stopped: {errors[0]}")
            ready = done_prefix(keys, set().union(*(done for done, _, _ in reports)))
            if ready >= minimum:
                break
            if reports[0][2]:
                raise RuntimeError(
                    f"streaming rollout stopped: no generated group arrived for {self.wave_timeout:g} s (the "
                    "colocated vLLM engines are stuck or too slow; raise vllm_request_timeout if just slow)"
                )
            if len(done) == len(mine):  # this engine is ahead: wait for the others without spinning
                time.sleep(SPREAD_POLL_SECONDS)
        count = self._wave_size(ready, len(keys))
        own = self.driver.take([key for key in keys[:count] if self.owns(key)])
        results = {result.key: result for part in self.process.gather_objects([own]) for result in part}
        self._wait += time.monotonic() - started
        return Wave([results[key] for key in keys[:count]])

    def _wave_rows(self, groups: list, results: list[GroupResult]) -> tuple[list[dict[str, Any]], dict[str, list]]:
        """This process's slice of the wave's rows (each group's prompt row, group_size times) and completions."""
        rows, completions, logprobs = [], [], []
        for (key, row), result in zip(groups, results, strict=True):
            if result.key != key or len(result.completion_ids) != self.group_size:
                raise RuntimeError(f"the engine answered {result.key} with {len(result.completion_ids)} completions "
                                   f"for group {key} of {self.group_size}")  # fmt: skip
            rows.extend(dict(row) for _ in range(self.group_size))
            completions.extend(result.completion_ids)
            logprobs.extend(result.logprobs)
        share = len(rows) // self.process.count
        local = slice(self.process.index * share, (self.process.index + 1) * share)
        prepared = {"completion_ids": completions[local], "logprobs": logprobs[local]}
        return rows[local], prepared

    # ------------------------------------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        return {"cursor": self.cursor.state_dict(), "generation": self.generation, "lag": self.lag}

    def load_state_dict(self, state: dict[str, Any], device: Any = None) -> None:
        if state.get("lag") != self.lag:
            raise ValueError(
                f"the checkpoint was written with rollout_max_staleness={state.get('lag')}, this run has {self.lag}: "
                "resume with the same value (the batches depend on it)."
            )
        self.cursor.load_state_dict(state["cursor"])
        self.generation = state["generation"]


def driver_metrics(stats: DriverStats, trainer_wait: float) -> dict[str, float]:
    """The `rollout/*` metrics of one generation batch from the driver's counters."""
    wall = max(time.monotonic() - stats.since, 1e-9)
    return {
        "rollout/engine_busy_fraction": min(stats.busy / wall, 1.0),
        "rollout/trainer_wait_fraction": min(trainer_wait / wall, 1.0),
        "rollout/groups_per_second": stats.completed_groups / wall,
        "rollout/generated_tokens": float(stats.generated_tokens),
        "rollout/cancelled_groups": float(stats.cancelled_groups),
        "rollout/discarded_tokens": float(stats.discarded_tokens),
    }
