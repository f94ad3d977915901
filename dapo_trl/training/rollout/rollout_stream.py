"""Streaming dynamic sampling: the engine is kept busy group by group, groups are accepted in prompt-stream order.

Rounds (`DynamicSampler.sample`) send a whole round as one request and wait for its longest response before the next
round starts. Here every group is its own seeded request (`rollout_engine`), admitted while fewer than
`rollout_max_in_flight_groups` run; the next round's groups are admitted before the current one has drained. Groups
are scored as soon as an in-order prefix of the round is complete (a reorder buffer), through the same TRL scoring
as a round, and `DynamicSampler.add` takes the same keep decisions in the same order. So which groups make a batch
depends only on the prompt stream, the per-group seeds, the weights and the engine's answers, never on which response
finished first (whether the answers repeat is the engine's property: a batch-invariant engine gives the same tokens
for the same group whatever else it runs; docs/rollout.md says where that was measured):

- a group's key is its place in the prompt stream (`("stream", n)`, the n-th prompt drawn) or in the step's
  dataloader batch (`("batch", generation, g)`); its seed is a hash of the run's seed and that key;
- batch j is sampled by weights version max(0, j - staleness) (`rollout_max_staleness`), a version being the
  weights after a whole generation batch's updates (however many optimizer steps it trains): 0 is today's
  synchronous step; with staleness >= 1 the next batch is generated while the trainer trains, its prompts all drawn from
  the seeded stream (the dataloader's next batch is not known yet);
- groups generated for a batch but not consumed by it (admitted ahead, before the batch turned out full) are
  cancelled and regenerated with the same seed under the next batch's weights: every trained row is exactly `staleness`
  versions old (carried surplus one more, as in rounds), and a resumed run regenerates them identically.

With a vLLM server only the main process talks to the engine (`RolloutDriver`, a background thread); it broadcasts
each scored part's completions. With colocated vLLM every process drives its own engine with the groups it owns
(every P-th of the stream) and the finished groups are gathered. Either way every process scores the same rows, so
all take the same decisions, as with rounds.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..sampling.batch_metrics import DecidedGroups
from ..sampling.dynamic_sampling import DynamicSampler, Filling, ScoredRound
from .rollout_driver import RolloutDriver
from .rollout_engine import GroupRequest, GroupResult, PartialGroup
from .stream_plan import StreamCursor, done_prefix, group_seed, plan_horizon, share_spans

ROLLOUT_STATE_FILE = "dapo_rollout_state.pt"
SPREAD_POLL_SECONDS = 0.05  # engines on every process: how often the processes compare their finished groups
MAX_WAVES_PER_ROUND = 4  # a round is scored in at most this many passes (each a full forward: under ZeRO-3 a gather)
MAX_TAIL_WAVES = 4  # plus at most this many short passes a step, for the batch's last groups
ROW_VERSION = "dapo_sampled_version"  # per-row tensor while a batch is filled: the weights version that sampled it


@dataclass
class Wave:
    """A scored part of a round as the main process broadcasts it: its groups' results, or the error that stopped
    generation (so that every process raises instead of waiting in a collective), or a preemption signal that some
    process got while the main process waited (so that every process abandons the step)."""

    results: list[GroupResult] | None
    error: str | None = None
    preempted: bool = False


WaveScorer = Callable[[list[dict[str, Any]], dict[str, list]], ScoredRound]


class StreamingRollout:
    """`DynamicSampler`'s rounds, streamed (see the module docstring); every process builds one. Where the groups
    are generated and how each wave reaches every process is the subclasses': `ServerStreamingRollout` (one engine,
    driven by the main process) and `ColocatedStreamingRollout` (an engine on every process). `tokenize(prompts)`
    gives prompt token ids as TRL tokenizes them."""

    def __init__(
        self,
        sampler: DynamicSampler,
        driver: RolloutDriver | None,
        tokenize: Callable[[list[Any]], list[list[int]]],
        staleness: int,
        lookahead_rounds: int,
        wave_timeout: float,
    ):
        self.sampler = sampler
        self.driver = driver
        self.tokenize = tokenize
        self.staleness = staleness
        self.lookahead_rounds = lookahead_rounds
        self.wave_timeout = wave_timeout
        self.cursor = StreamCursor(sampler.stream, None if sampler.triage is None else self._triage_skips)
        self.generation = 0  # batches sampled so far
        # k >= 1: the next dataloader batch is not known a batch early, so every prompt comes from the seeded stream.
        self.first_round_from_loader = staleness == 0
        self.process = sampler.process
        self.group_size = sampler.group_size
        self.unit = self.process.count // math.gcd(self.group_size, self.process.count)  # groups per equal split
        self.keep_rate = 0.5  # running estimate, for how far ahead to admit (never for what is trained)
        self._most: int | None = None  # the current round's largest wave (`least_wave`), set as it streams
        self._wait = 0.0

    @property
    def version(self) -> int:
        """The weights version that samples the current batch."""
        return max(0, self.generation - self.staleness)

    @property
    def _previous_version(self) -> int:
        return max(0, self.generation - 1 - self.staleness)

    # ------------------------------------------------------------------------------------------------- a batch
    def sample(self, inputs: list[dict[str, Any]], score_wave: WaveScorer) -> tuple[dict[str, torch.Tensor], dict]:
        """The step's whole batch and its metrics, as `DynamicSampler.sample` would build it from these prompts."""
        sampler, args = self.sampler, self.sampler.args
        round_groups = args.filter_groups_oversample * len(inputs) * self.process.count // self.group_size
        filling = sampler.begin(len(inputs))
        for part in filling.parts:  # carried from a checkpoint written before rows carried their version
            part.setdefault(ROW_VERSION, torch.full_like(part["advantages"], self._previous_version, dtype=torch.long))
        rounds = [self._first_round(inputs, round_groups)]
        self._round_groups = round_groups
        self._wait, self._passes, self._tail_passes = 0.0, 0, 0
        self._decided = DecidedGroups(self.group_size, args.filter_groups_carry_surplus)
        while True:
            filling.stats["rounds"] += 1
            filling.round_dropped = []
            self._stream_round(rounds[-1], score_wave, filling)
            if filling.full or not sampler.rounds_left(filling):
                break
            rounds.append(self._keyed(self._take(round_groups)))
        observed = self._decided.keep_rate  # over the groups any timing scores
        self.keep_rate = 0.8 * self.keep_rate + 0.2 * max(observed, 0.05)
        batch, metrics = sampler.finish(filling)
        metrics.update(self._staleness(batch.pop(ROW_VERSION), batch.get("completion_mask")))
        metrics["rollout/scoring_passes"] = float(self._passes)
        metrics.update(self._decided.metrics())
        metrics["rollout/trainer_wait_seconds"] = self._wait
        consumed = {key for groups in rounds for key, _ in groups}
        self.generation += 1
        if self.driver is not None:
            version = self.version
            self.driver.withdraw(  # (with in-flight weight updates a group may have started under a newer version)
                keep=lambda item: item.version >= version and item.key[0] == "stream" and item.key not in consumed
            )
            if self.staleness > 0:  # generate the next batch while this one trains
                ahead, cap = self._horizon(len(inputs) * self.process.count, 0), args.max_filter_gen_batches
                self._plan_stream(min(ahead, cap * round_groups) if cap else ahead)
        return batch, metrics

    def _staleness(self, versions: torch.Tensor, completion_mask: torch.Tensor | None) -> dict[str, float]:
        """Mean and max of (generation - the version that sampled the row) over the batch's trained rows (filler
        rows, masked out of the loss, left out)."""
        ages = (self.generation - versions.cpu().long()).float()
        if completion_mask is not None:
            ages = ages[completion_mask.sum(dim=1).cpu() > 0]
        if ages.numel() == 0:
            return {"rollout/staleness_mean": 0.0, "rollout/staleness_max": 0.0}
        return {"rollout/staleness_mean": ages.mean().item(), "rollout/staleness_max": ages.max().item()}

    def _horizon(self, target_rows: int, kept_rows: int) -> int:
        """How many more groups to generate for the batch: the fewest whose kept count reaches its missing kept
        groups with ~90% odds if each is kept with the running keep rate (`plan_horizon`). Only what is generated
        ahead depends on it (and so on timing), never what is trained."""
        return plan_horizon(max(0, target_rows - kept_rows) / self.group_size, self.keep_rate)

    def _first_round(self, inputs: list[dict[str, Any]], round_groups: int) -> list[tuple[tuple, dict[str, Any]]]:
        if not self.first_round_from_loader:
            return self._keyed(self._take(round_groups))
        loader_rows = self.process.gather_objects(inputs)
        groups = [
            (("batch", self.generation, g), loader_rows[g * self.group_size])
            for g in range(len(loader_rows) // self.group_size)
        ]
        triage = self.sampler.triage
        if triage is not None:  # the loader's prompts triage skips are replaced by fresh ones, as in rounds
            groups = [(key, row) for key, row in groups if not triage.skips(row["prompt"], f"batch/{key[2]}")]
        extra = round_groups - len(groups)  # over-sampling (and triage's skips): fresh prompts complete the round
        return groups + (self._keyed(self._take(extra)) if extra else [])

    def _take(self, count: int) -> list[tuple[int, Any]]:
        """Consume the next `count` prompts of the stream (every process, in lockstep); the groups planned for
        prompts triage now skips are cancelled."""
        taken = self.cursor.take(count)
        if not hasattr(self.sampler.dataset, "__len__"):  # an IterableDataset: every process must read the same rows
            self.sampler.check_processes_agree([item for _, item in taken])
        if self.cursor.skipped:
            skipped = {("stream", index) for index, _ in self.cursor.skipped}
            self.cursor.skipped.clear()
            if self.driver is not None and skipped & self.driver.planned_keys():
                self.driver.withdraw(keep=lambda item: item.key not in skipped)
        return taken

    def _triage_skips(self, index: int, item: Any, decide: bool) -> bool:
        """Prompt triage's decision (`decide`) or prediction for the stream's prompt at `index`: its draw is its
        stream position, the same whatever the step, so a batch planned ahead predicts what its take decides
        unless the history moved in between."""
        row = item if not hasattr(self.sampler.dataset, "__len__") else self.sampler.dataset[item]
        return self.sampler.triage.skips(row["prompt"], f"stream/{index}", counted=decide, any_step=True)

    def _keyed(self, drawn: list[tuple[int, Any]]) -> list[tuple[tuple, dict[str, Any]]]:
        dataset, streamed = self.sampler.dataset, not hasattr(self.sampler.dataset, "__len__")
        return [(("stream", index), dict(item) if streamed else dict(dataset[item])) for index, item in drawn]

    def _plan_ahead(self, rest: list, filling: Filling, least: int) -> None:
        """Admit the groups the batch is expected to need after the scored ones (`_horizon`), and at least the next
        wave's `least`: first the rest of the current round, then the stream beyond it (at most
        `lookahead_rounds` rounds). Planning less than a whole round ahead keeps the engine off groups that the cut
        would cancel (at k >= 1 the engine is the bottleneck, and every cancelled token is lost time)."""
        if self.driver is None:
            return
        want = max(self._horizon(filling.target_rows, filling.kept_rows), least)
        self._plan(rest[:want])
        if want > len(rest):
            self._plan_stream(min(want - len(rest), self.lookahead_rounds * self._round_groups))

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
        start, most = 0, self.least_wave(len(groups))
        self._most = most
        self._decided.planned += len(groups)
        while start < len(groups):
            least = self._wave_least(filling, most)
            self._plan_ahead(groups[start:], filling, min(least, len(groups) - start))
            wave = self._next_wave(keys[start:], least)
            results = wave.results or []
            count = len(results)
            rows, prepared = self._wave_rows(groups[start : start + count], results)
            scored = score_wave(rows, prepared)
            self._passes += 1
            versions = [result.version for result in results for _ in range(self.group_size)]
            scored.rows[ROW_VERSION] = torch.tensor(versions, device=scored.rows["advantages"].device)
            kept_before = filling.kept_rows
            self.sampler.add(filling, scored)
            wave_kept, target = filling.group_kept[-count:], filling.target_rows
            decided = self._decided.record(scored.row_stats, wave_kept, kept_before, target)
            # Prompt triage learns from the decided groups only: the ones any timing scores for this batch.
            prompts = [row["prompt"] for _, row in groups[start : start + decided]]
            self.sampler.record_outcomes(prompts, scored.accuracy[: decided * self.group_size])
            start += count
            if filling.full and not self.sampler.args.filter_groups_carry_surplus:
                break

    def _wave_least(self, filling: Filling, most: int) -> int:
        """The fewest groups the next wave waits for: a quarter of the round (`most`), or, for the batch's last
        groups, what it is still expected to need if that is less (at most MAX_TAIL_WAVES such short waves a step),
        so the engine is not kept on groups past the cut only to fill a wave."""
        needed = self._horizon(filling.target_rows, filling.kept_rows)
        if filling.full or needed >= most or self._tail_passes >= MAX_TAIL_WAVES:
            return most
        self._tail_passes += 1
        return max(self.unit, math.ceil(needed / self.unit) * self.unit)

    def least_wave(self, round_length: int) -> int:
        """The fewest groups a wave holds (but a round's last): a round is scored in at most MAX_WAVES_PER_ROUND
        passes, each a whole number of `unit`s. Each pass is a full forward of the policy (and the reference): with
        a wave per finished group, ZeRO-3 would gather every parameter once per group."""
        least = max(1, math.ceil(round_length / MAX_WAVES_PER_ROUND))
        return math.ceil(least / self.unit) * self.unit

    def owns(self, key: tuple) -> bool:
        """Whether this process's driver generates the group at `key`."""
        return True

    def _next_wave(self, keys: list[tuple], least: int) -> Wave:
        """Wait for the next in-order finished groups of `keys` (at least `least`, a multiple of `unit`, or the
        round's rest) and return them on every process."""
        raise NotImplementedError

    def _wave_size(self, ready: int, remaining: int) -> int:
        """Groups in the next wave when `ready` leading ones of the `remaining` are done: a multiple of `unit` (so
        the rows split equally across processes), or the round's whole rest; at most a quarter of the round
        (`least_wave`), so what a wave turns into Python lists for TRL is bounded however much finished at once."""
        size = ready if ready == remaining else ready - ready % self.unit
        return size if self._most is None else min(size, self._most)

    def _wave_rows(self, groups: list, results: list[GroupResult]) -> tuple[list[dict[str, Any]], dict[str, list]]:
        """This process's slice of the wave's rows (each group's prompt row, group_size times) and completions: only
        the groups that reach into the slice are read, and only their rows in it become the lists TRL takes."""
        for (key, _), result in zip(groups, results, strict=True):
            if result.key != key or len(result.lengths) != self.group_size:
                raise RuntimeError(
                    f"the engine answered {result.key} with {len(result.lengths)} completions "
                    f"for group {key} of {self.group_size}"
                )
        rows, completions, logprobs, routings, versions = [], [], [], [], []
        for index, first, stop in self.local_rows(len(groups)):
            ids, values, routed = results[index].rows(first, stop)
            rows.extend(dict(groups[index][1]) for _ in range(stop - first))
            completions.extend(ids)
            logprobs.extend(values)
            routings.extend(routed)
            versions.extend(results[index].token_versions(row) for row in range(first, stop))
        prepared = {"completion_ids": completions, "logprobs": logprobs, "routed_experts": routings}
        return rows, {**prepared, "versions": versions}

    def local_rows(self, group_count: int) -> list[tuple[int, int, int]]:
        """(group, first row, row stop) of each group with rows in this process's share of a wave (`share_spans`)."""
        return share_spans(group_count, self.group_size, self.process.index, self.process.count)

    # ------------------------------------------------------------------------------------------- checkpoints
    @property
    def keeps_groups_ahead(self) -> bool:
        """Whether checkpoints keep the groups generated ahead (in-flight weight updates: partial rollouts)."""
        return self.driver is not None and getattr(self.driver.engine, "updates_in_flight", False)

    def state_dict(self) -> dict[str, Any]:
        """The stream's place; with in-flight weight updates also the groups generated ahead so far: the finished
        ones (with their routings under routing replay) and, where answers are streamed, the running ones as far as
        they were sampled. A resumed run continues them instead of generating them again."""
        state = self._place()
        if self.keeps_groups_ahead:
            kept = self.driver.partial_groups().items()
            state["groups"] = [(list(key), partial.state_dict()) for key, partial in kept]
        return state

    def step_end_state(self) -> dict[str, Any]:
        """What a preemption restores of an optimizer step's end (`StepEndState`, taken at every step's end): the
        stream's place and the finished groups held then, by reference (O(groups), no token copied). The groups
        still running then, and those generated since, are taken as far as they got when the preemption stops the
        run (`groups_ahead`, `keep_ahead`)."""
        state = self._place()
        if self.keeps_groups_ahead:
            state["held"] = self.driver.finished_results()
        return state

    def _place(self) -> dict[str, Any]:
        return {"cursor": self.cursor.state_dict(), "generation": self.generation, "staleness": self.staleness}

    def load_state_dict(self, state: dict[str, Any], device: Any = None) -> None:
        saved = state.get("staleness", state.get("lag"))  # "lag": checkpoints written before the rename
        if saved != self.staleness:
            raise ValueError(
                f"the checkpoint was written with rollout_max_staleness={saved}, this run has {self.staleness}: "
                "resume with the same value (the batches depend on it)."
            )
        self.cursor.load_state_dict(state["cursor"])
        self.generation = state["generation"]
        if self.driver is None:
            return
        kept = {tuple(key): PartialGroup.from_state(group) for key, group in state.get("groups") or ()}
        kept |= {key: PartialGroup.of_result(result) for key, result in state.get("held", {}).items()}
        if kept:
            self.driver.restore(self._replayable(kept))

    def groups_ahead(self) -> dict[tuple, PartialGroup]:
        """The groups generated ahead as far as they got now (a preemption, before the rollout is withdrawn)."""
        return self.driver.partial_groups() if self.keeps_groups_ahead else {}

    def keep_ahead(self, groups: dict[tuple, PartialGroup]) -> None:
        """Add `groups` (`groups_ahead`, taken before a preemption withdrew the rollout) to what the driver restores,
        after the step's end was put back: the checkpoint then keeps them, as a periodic one would."""
        if groups and self.driver is not None:
            self.driver.restore(self._replayable(groups), merge=True)

    def _replayable(self, groups: dict[tuple, PartialGroup]) -> dict[tuple, PartialGroup]:
        if getattr(self.driver.engine, "whole_answers", False):  # routing replay: only what has its routings
            return {key: group for key, group in groups.items() if group.routed_experts is not None}
        return groups


class ServerStreamingRollout(StreamingRollout):
    """One engine for every process (a vLLM server): only the main process has a driver; it waits for each wave and
    sends every process its part (`scatter(parts)` returns the main process's `parts[p]` on process p; the groups
    that have no row in a process's share go without their tokens), errors included, so that every process raises
    together instead of one waiting in a collective. Without `scatter` the whole wave is broadcast
    (`broadcast(obj)`)."""

    def __init__(
        self,
        sampler: DynamicSampler,
        driver: RolloutDriver | None,
        tokenize: Callable[[list[Any]], list[list[int]]],
        broadcast: Callable[[Any], Any],
        staleness: int,
        lookahead_rounds: int,
        wave_timeout: float,
        scatter: Callable[[list[Any] | None], Any] | None = None,
    ):
        super().__init__(sampler, driver, tokenize, staleness, lookahead_rounds, wave_timeout)
        self.broadcast = broadcast
        self.scatter = scatter

    def _next_wave(self, keys: list[tuple], least: int) -> Wave:
        """The main process waits for the wave, or for a preemption signal (of any process: `requested`), while the
        others wait for what it sends."""
        wave, preemption = None, self.sampler.preemption
        if self.driver is not None:
            try:
                started = time.monotonic()
                ready = self.driver.ready_prefix(keys, min(least, len(keys)), self.wave_timeout, preemption.requested)
                if ready is None:
                    wave = Wave(None, preempted=True)
                else:
                    wave = Wave(self.driver.take(keys[: self._wave_size(ready, len(keys))]))
                self._wait += time.monotonic() - started
            except Exception as exc:  # noqa: BLE001 - every process raises it below
                wave = Wave(None, f"{type(exc).__name__}: {exc}")
        if self.scatter is None:
            wave = self.broadcast(wave)
        else:
            wave = self.scatter(None if wave is None else self._parts(wave))
        if wave.preempted:
            preemption.abandon("while waiting for a streamed wave")
        if wave.error is not None:
            raise RuntimeError(f"streaming rollout stopped: {wave.error}")
        return wave

    def _parts(self, wave: Wave) -> list[Wave]:
        """The wave as each process is sent it: the groups without a row in its share stripped of their tokens."""
        if wave.results is None:
            return [wave] * self.process.count
        parts = []
        for index in range(self.process.count):
            spans = {
                group for group, _, _ in share_spans(len(wave.results), self.group_size, index, self.process.count)
            }
            parts.append(Wave([r if g in spans else r.without_tokens() for g, r in enumerate(wave.results)]))
        return parts


class ColocatedStreamingRollout(StreamingRollout):
    """An engine on every process (colocated vLLM): each process's driver generates the groups it owns (every P-th
    of the stream), the processes compare which are done until the round's in-order prefix holds a wave, then gather
    the wave's results. The main process's clock decides a timeout, so all stop together."""

    def owns(self, key: tuple) -> bool:
        return key[-1] % self.process.count == self.process.index  # the n-th of the stream / g-th of the batch

    def _next_wave(self, keys: list[tuple], least: int) -> Wave:
        started = time.monotonic()
        minimum = min(least, len(keys))
        mine = [key for key in keys if self.owns(key)]
        while True:
            try:
                done, error = self.driver.done_among(mine, SPREAD_POLL_SECONDS), None
            except Exception as exc:  # noqa: BLE001 - every process raises it below
                done, error = set(), f"{type(exc).__name__}: {exc}"
            timed_out = time.monotonic() - max(started, self.driver.last_done) > self.wave_timeout
            reports = self.process.gather_objects([(done, error, timed_out, self.sampler.preemption.requested())])
            errors = [error for _, error, _, _ in reports if error is not None]
            if errors:
                raise RuntimeError(f"streaming rollout stopped: {errors[0]}")
            if any(preempted for *_, preempted in reports):  # every process saw the same reports
                self.sampler.preemption.abandon("while waiting for a streamed wave")
            ready = done_prefix(keys, set().union(*(done for done, *_ in reports)))
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
