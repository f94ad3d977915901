"""DAPO's dynamic sampling as one unit: the prompt stream, carried groups, keep/fill/carry decisions and statistics.

The trainer hands `DynamicSampler.sample` a `score_round` callable ("generate and score these prompts") that returns
the round's rows gathered from every process plus their raw accuracy; the sampler decides everything else and never
reads trainer state. Its checkpoint state is `state_dict()` / `load_state_dict()`.
"""

from __future__ import annotations

import hashlib
import logging
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ...algorithm import assemble_batch, group_keep_mask
from ..faults.preemption import SafePoints
from ..step.replayed_routing import HOST_ROW_TENSORS, ROUTING_ROW_FIELDS
from ..step.routing_shelf import NO_ROUTING, ROUTING_ID
from .advantages import batch_level_rewards, batch_normalisation, batch_scaled_advantages
from .old_logprobs import PROXIMAL_LAG, SCORED_AT
from .prompt_triage import PromptTriage
from .streams import IterablePromptStream, PromptStream

logger = logging.getLogger(__name__)

# Per-row tensors of a generated batch that dynamic sampling moves between processes: 2-D ones are widened with
# (pad value, pad on the left?) to concatenate rounds; the token-id pads use the tokenizer's pad id instead of 0.
ROW_TENSORS = {
    "prompt_ids": (0, True),
    "prompt_mask": (0, True),
    "completion_ids": (0, False),
    "completion_mask": (0, False),
    "advantages": (0, False),
    "old_per_token_logps": (0.0, False),
    "ref_per_token_logps": (0.0, False),
    "sampling_per_token_logps": (0.0, False),
    "importance_sampling_ratio": (1.0, False),
    "tool_mask": (1, False),
    PROXIMAL_LAG: (0.0, False),  # old_logprobs_source=interpolated: each token's lag behind pi_old
    SCORED_AT: (0.0, False),
    **ROUTING_ROW_FIELDS,  # routing replay: each row's routing id (the routing stays on the process that scored it)
}
STAT_NAMES = (
    "rounds",
    "groups_generated",
    "groups_kept",
    "filler_groups",
    "carried_in_groups",
    "surplus_carried_groups",
    "surplus_discarded_groups",
)
# The per-row reward batch-level advantages are recomputed from (`advantages`); NaN for filler rows.
BATCH_REWARDS = "dapo_batch_rewards"
SAMPLING_STATE_FILE = "dapo_sampling_state.pt"


@dataclass
class ScoredRound:
    """One generation round as every process sees it: all rows in global (process) order, their raw accuracy,
    (rewards_per_func, reward_weights) as TRL weighted them (only read when advantages are normalised by batch
    statistics: `advantages.batch_level_rewards`), and for a streamed wave its rows' figures for the step's metrics
    (`batch_metrics.row_statistics`)."""

    rows: dict[str, torch.Tensor]
    accuracy: torch.Tensor
    rewards: tuple[torch.Tensor, torch.Tensor] | None = None
    row_stats: dict[str, Any] | None = None


RoundScorer = Callable[[list[dict[str, Any]]], ScoredRound]


@dataclass
class Filling:
    """A batch being filled: kept parts in stream order, counts, and the current round's rejected rows (filler)."""

    target_rows: int
    stats: Counter = field(default_factory=Counter)
    parts: list[dict[str, torch.Tensor]] = field(default_factory=list)
    kept_rows: int = 0
    carried_in_rows: int = 0
    round_dropped: list[dict[str, torch.Tensor]] = field(default_factory=list)
    group_kept: list[bool] = field(default_factory=list)  # every scored group's decision, in stream order
    generated_tokens: int = 0  # completion tokens of every group scored for this batch

    @property
    def full(self) -> bool:
        return self.kept_rows >= self.target_rows


@dataclass
class Process:
    """Where this process sits, and how to gather Python objects from all processes (in process order)."""

    index: int = 0
    count: int = 1
    gather_objects: Callable[[list[Any]], list[Any]] = list


class DynamicSampler:
    """Keeps only groups whose accuracy has spread, generating more rounds from fresh prompts until the batch is full.

    Round 1 uses the dataloader's prompts (plus fresh ones when over-sampling); later rounds draw fresh prompts from
    the sampler's own seeded stream (`streams`: a permutation of a map-style dataset, or a shuffle buffer
    over an IterableDataset). Every process scores the same gathered rounds, so all take the same keep decisions;
    the batch is cut at a group boundary to exactly the generation batch. No weights change between rounds, so the
    old log-probs of every round stay valid. Advantages that TRL normalises by batch statistics are recomputed over
    the final batch's trained rows.
    """

    def __init__(
        self,
        args: Any,
        dataset: Sequence[dict[str, Any]],
        group_size: int,
        padding: dict[str, tuple[float, bool]],
        process: Process | None = None,
        shuffle: bool = True,
        preemption: SafePoints | None = None,
    ):
        self.args = args
        self.dataset = dataset
        self.group_size = group_size
        self.padding = padding
        self.process = process or Process()
        self.shuffle = shuffle
        self.preemption = preemption or SafePoints()  # where a step may be abandoned (a preemption signal)
        self._stream: PromptStream | IterablePromptStream | None = None
        self.carried: dict[str, torch.Tensor] | None = None
        self.normalisation = batch_normalisation(args)  # None, or the centre of batch-level advantages
        self._checked_agreement = False
        self.release: Callable[[list[int]], None] | None = None  # routing replay: rows dropped, their routings freed
        self.triage = (  # prompts skipped before generation from their outcome history (`prompt_triage`)
            PromptTriage(
                args.seed,
                args.prompt_triage_target_zero_variance,
                args.prompt_triage_exploration_floor,
                args.prompt_triage_min_agreement,
            )
            if getattr(args, "prompt_triage", False)
            else None
        )
        self._round_prompts: list[Any] = []  # the current round's prompts, one per group, in global order
        self._drawn = 0  # fresh prompts considered this step (each triage decision's own draw)

    @property
    def stream(self) -> PromptStream | IterablePromptStream:
        if self._stream is None and not hasattr(self.dataset, "__len__"):  # a datasets.IterableDataset
            buffer_size = self.args.filter_groups_shuffle_buffer_size
            self._stream = IterablePromptStream(self.dataset, self.args.seed, buffer_size, shuffle=self.shuffle)
        elif self._stream is None:
            self._stream = PromptStream(len(self.dataset), self.args.seed, shuffle=self.shuffle)
        return self._stream

    def sample(self, inputs: list[dict[str, Any]], score_round: RoundScorer) -> tuple[dict[str, torch.Tensor], dict]:
        """The step's whole batch (every process's rows, in global order) and its `dynamic_sampling/*` metrics."""
        filling = self.begin(len(inputs))
        round_inputs = self._first_round_inputs(inputs)
        while True:
            filling.stats["rounds"] += 1
            filling.round_dropped = []
            scored = score_round(round_inputs)
            self.record_outcomes(self._round_prompts, scored.accuracy)
            self.add(filling, scored)
            if filling.full or not self.rounds_left(filling):
                break
            self.preemption.safe_point("between dynamic-sampling rounds")
            round_inputs = self._fresh_round_inputs(len(inputs) * self.args.filter_groups_oversample)
        return self.finish(filling)

    def begin(self, local_rows: int) -> Filling:
        """A batch to fill with `local_rows` rows per process, starting with the groups carried from the last step."""
        filling = Filling(target_rows=local_rows * self.process.count)
        self._drawn = 0
        if self.triage is not None:
            self.triage.begin_step()
        if self.carried is not None:
            filling.parts.append(self.carried)
            filling.stats["carried_in_groups"] = self.carried["advantages"].numel() // self.group_size
            filling.carried_in_rows = filling.kept_rows = self.carried["advantages"].numel()
            self.carried = None
        return filling

    def add(self, filling: Filling, scored: ScoredRound) -> None:
        """Keep the groups of a scored round (or a part of one, in stream order) whose accuracy has spread."""
        if self.normalisation is not None:
            aggregation = self.args.multi_objective_aggregation
            rewards = batch_level_rewards(*scored.rewards, self.group_size, aggregation)
            scored.rows[BATCH_REWARDS] = rewards.to(scored.rows["advantages"].device)
        if self.args.filter_groups_enable:
            group_kept = group_keep_mask(scored.accuracy.cpu(), self.group_size, self.args.filter_groups_atol)
        else:  # the streaming rollout without dynamic sampling: every group is kept, the first round fills the batch
            group_kept = torch.ones(len(scored.accuracy) // self.group_size, dtype=torch.bool)
        row_kept = group_kept.repeat_interleave(self.group_size).to(scored.rows["advantages"].device)
        filling.stats["groups_generated"] += group_kept.numel()
        filling.stats["groups_kept"] += int(group_kept.sum())
        if "completion_mask" in scored.rows:
            filling.generated_tokens += int(scored.rows["completion_mask"].sum())
        filling.group_kept.extend(bool(kept) for kept in group_kept)
        if row_kept.any():
            filling.parts.append({key: value[row_kept] for key, value in scored.rows.items()})
            filling.kept_rows += int(row_kept.sum())
        if not row_kept.all():
            filling.round_dropped.append({key: value[~row_kept] for key, value in scored.rows.items()})
            self._released(filling.round_dropped[-1])

    def _released(self, rows: dict[str, torch.Tensor]) -> None:
        """Rows no batch will hold: routing replay frees their routings now (a wave's dropped groups, at DAPO's keep
        rates most of what is scored, would otherwise stay in host memory until the step's end)."""
        if self.release is not None and ROUTING_ID in rows:
            self.release(rows[ROUTING_ID].tolist())

    def rounds_left(self, filling: Filling) -> bool:
        max_rounds = self.args.max_filter_gen_batches
        return max_rounds == 0 or filling.stats["rounds"] < max_rounds

    def finish(self, filling: Filling) -> tuple[dict[str, torch.Tensor], dict]:
        """Cut the kept groups to the batch (filler when short), carry or drop the surplus, rescale advantages."""
        stats, target_rows = filling.stats, filling.target_rows
        if filling.kept_rows < target_rows:
            self._on_exhausted(stats, filling.kept_rows // self.group_size, target_rows // self.group_size)
            dropped, _ = assemble_batch(filling.round_dropped, target_rows - filling.kept_rows, self.padding)
            filling.parts.append(zero_advantage_filler(dropped, target_rows - filling.kept_rows))
            stats["filler_groups"] = (target_rows - filling.kept_rows) // self.group_size
        batch, surplus = assemble_batch(filling.parts, target_rows, self.padding)
        self._keep_surplus(surplus, filling.carried_in_rows, target_rows, stats)
        if self.normalisation is not None:  # verl: advantages over the final batch; filler rows (NaN) left out
            batch["advantages"] = batch_scaled_advantages(batch.pop(BATCH_REWARDS), self.group_size, self.normalisation)
        metrics = self._metrics(stats)
        if "completion_mask" in batch:  # carried-in groups were generated (and counted) in an earlier step
            trained = int(batch["completion_mask"].sum())
            metrics["rollout/generated_tokens_per_trained_token"] = filling.generated_tokens / max(trained, 1)
        if self.triage is not None:
            metrics.update(self.triage.end_step())
        return batch, metrics

    def record_outcomes(self, prompts: list[Any], accuracy: torch.Tensor) -> None:
        """Prompt triage: each scored group's prompt (`prompts`, in the round's global order), with its rows'
        `accuracy`, and whether its responses all agreed, into the outcome history."""
        if self.triage is None:
            return
        accuracy = accuracy.cpu()
        agreed = ~group_keep_mask(accuracy, self.group_size, self.args.filter_groups_atol)
        self.triage.record(prompts, agreed.tolist(), accuracy.view(-1, self.group_size)[:, 0].tolist())

    def draw(self, count: int) -> list[dict[str, Any]]:
        """The next `count` fresh prompts of the stream (dataset rows), those prompt triage skips passed over:
        they are drawn again in a later pass."""
        rows: list[dict[str, Any]] = []
        streamed = isinstance(self.stream, IterablePromptStream)
        while len(rows) < count:
            drawn = self.stream.draw(count - len(rows))
            if streamed:
                self.check_processes_agree(drawn)
            for item in drawn:
                row = item if streamed else self.dataset[item]
                self._drawn += 1
                if self.triage is None or not self.triage.skips(row["prompt"], f"draw/{self._drawn}"):
                    rows.append(row)
        return rows

    def _keep_surplus(
        self, surplus: dict[str, torch.Tensor] | None, carried_in_rows: int, target_rows: int, stats: Counter
    ) -> None:
        """Carry this step's leftover kept groups to the next step (paper), or count them as discarded.

        Carried groups come first in the batch, so any left over now are two steps old: drop them and carry only
        this step's groups, which bounds both the backlog and the staleness to one step.
        """
        surplus_rows = 0 if surplus is None else surplus["advantages"].numel()
        if not (self.args.filter_groups_carry_surplus and surplus is not None):
            stats["surplus_discarded_groups"] = surplus_rows // self.group_size
            if surplus is not None:
                self._released(surplus)
            return
        stale_rows = max(0, carried_in_rows - target_rows)
        self._released({key: value[:stale_rows] for key, value in surplus.items()})
        if surplus_rows > stale_rows:
            self.carried = {key: value[stale_rows:] for key, value in surplus.items()}
        stats["surplus_carried_groups"] = (surplus_rows - stale_rows) // self.group_size
        stats["surplus_discarded_groups"] = stale_rows // self.group_size

    def _fresh_round_inputs(self, local_rows: int) -> list[dict[str, Any]]:
        """This process's slice of a round of fresh prompts, each repeated group_size times."""
        drawn = self.draw(local_rows * self.process.count // self.group_size)
        self._round_prompts = [row["prompt"] for row in drawn]
        start = self.process.index * local_rows
        # One copy per row: TRL may write per-row fields into its input dicts.
        return [dict(drawn[position // self.group_size]) for position in range(start, start + local_rows)]

    def check_processes_agree(self, drawn: list[dict[str, Any]]) -> None:
        """Once: every process must have drawn the same rows of an IterableDataset (rounds are sliced by position)."""
        if self._checked_agreement:
            return
        digest = hashlib.sha256(repr(drawn).encode()).hexdigest()
        if len(set(self.process.gather_objects([digest]))) > 1:
            raise RuntimeError(
                "processes drew different fresh prompts from the IterableDataset train_dataset: give every process "
                "the same whole stream in the same order (not split_dataset_by_node), as for GRPOTrainer."
            )
        self._checked_agreement = True

    def _first_round_inputs(self, inputs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The dataloader's prompts, plus fresh ones when over-sampling, re-sliced so groups stay contiguous; with
        prompt triage, the loader's prompts it skips are replaced by fresh ones."""
        oversample = self.args.filter_groups_oversample
        if oversample == 1 and self.triage is None:
            return inputs
        local_rows = len(inputs) * oversample
        loader = self.process.gather_objects(inputs)
        groups = [loader[g * self.group_size] for g in range(len(loader) // self.group_size)]
        if self.triage is not None:
            groups = [row for g, row in enumerate(groups) if not self.triage.skips(row["prompt"], f"batch/{g}")]
        groups += self.draw(local_rows * self.process.count // self.group_size - len(groups))
        self._round_prompts = [row["prompt"] for row in groups]
        start = self.process.index * local_rows
        return [dict(groups[position // self.group_size]) for position in range(start, start + local_rows)]

    def _on_exhausted(self, stats: Counter, kept_groups: int, target_groups: int) -> None:
        message = (
            f"dynamic sampling kept {kept_groups} of the {target_groups} groups a step needs after "
            f"{stats['rounds']} rounds ({stats['groups_kept']} kept of {stats['groups_generated']} generated)"
        )
        if self.args.filter_groups_on_exhausted == "error":
            raise RuntimeError(
                f"{message}. The data is too easy or too hard for the model: raise max_filter_gen_batches "
                "(0 = unlimited) or filter_groups_oversample, change the data, or set "
                "filter_groups_on_exhausted='fill' to train on the kept groups."
            )
        logger.warning("%s; training on them plus zero-advantage filler", message)

    @staticmethod
    def _metrics(stats: Counter) -> dict[str, float]:
        metrics = {f"dynamic_sampling/{name}": float(stats[name]) for name in STAT_NAMES}
        metrics["dynamic_sampling/keep_rate"] = stats["groups_kept"] / max(stats["groups_generated"], 1)
        return metrics

    def state_dict(self) -> dict[str, Any]:
        carried = None if self.carried is None else {key: value.cpu() for key, value in self.carried.items()}
        settings = self._reward_settings()
        state = {"prompt_stream": self.stream.state_dict(), "carried_groups": carried, "rewards": settings}
        if self.triage is not None:
            state["prompt_triage"] = self.triage.state_dict()
        return state

    def checkpoint_files(self) -> dict[str, DynamicSampler]:
        """{file: self} when dynamic sampling or the streaming rollout is on: its prompt stream and carried groups
        are run state to save."""
        return {SAMPLING_STATE_FILE: self} if self.args.filter_groups_enable or self.args.rollout_streaming else {}

    def _reward_settings(self) -> list[str]:
        """What a carried group's advantage (or stored reward) was computed under."""
        return [str(self.args.scale_rewards), str(self.args.multi_objective_aggregation)]

    def load_state_dict(self, state: dict[str, Any], device: torch.device | str = "cpu") -> None:
        self.stream.load_state_dict(state["prompt_stream"])
        if self.triage is not None and "prompt_triage" in state:  # absent: saved without triage, its history starts
            self.triage.load_state_dict(state["prompt_triage"])
        carried = state["carried_groups"]
        saved_settings = state.get("rewards")  # absent in older checkpoints: then, whether rows carry their reward
        if carried is not None and (
            saved_settings != self._reward_settings()
            if saved_settings is not None
            else (BATCH_REWARDS in carried) != (self.normalisation is not None)
        ):
            # Their advantages (or stored rewards) follow other scale_rewards / multi_objective_aggregation settings:
            # training on them would mix two normalisations in one batch. Their prompts are not replayed.
            logger.warning(
                "dropping %d carried groups from the checkpoint: they were saved with other reward-normalisation "
                "settings (scale_rewards / multi_objective_aggregation) than this run's",
                carried["advantages"].numel() // self.group_size,
            )
            carried = None
        if carried is not None and HOST_ROW_TENSORS[0] in carried:  # an older checkpoint: routings in the rows
            logger.warning("carried groups from an older checkpoint: their forwards route themselves (no replay)")
            carried = {key: value for key, value in carried.items() if key not in HOST_ROW_TENSORS}
            carried[ROUTING_ID] = torch.full_like(carried["advantages"], NO_ROUTING, dtype=torch.int64)
        self.carried = None if carried is None else {key: value.to(device) for key, value in carried.items()}


def zero_advantage_filler(dropped: dict[str, torch.Tensor], rows: int) -> dict[str, torch.Tensor]:
    """Zero-spread groups that pad a short batch: no advantage, and masked out of the loss and its denominator."""
    filler = {key: value[:rows].clone() for key, value in dropped.items()}
    filler["advantages"].zero_()
    filler["completion_mask"].zero_()
    if ROUTING_ID in filler:
        filler[ROUTING_ID].fill_(NO_ROUTING)  # dropped rows' routings are freed; not trained, they route themselves
    if BATCH_REWARDS in filler:
        filler[BATCH_REWARDS].fill_(torch.nan)  # not trained: no part in batch-level statistics
    return filler


def row_padding(pad_token_id: int) -> dict[str, tuple[float, bool]]:
    """How to widen each per-row tensor: ROW_TENSORS with the tokenizer's pad id for token ids."""
    return {**ROW_TENSORS, "prompt_ids": (pad_token_id, True), "completion_ids": (pad_token_id, False)}


def check_regroupable(output: dict[str, Any]) -> None:
    """Dynamic sampling regroups rows by the fields it knows (ROW_TENSORS); anything else (images) is refused."""
    unsupported = sorted(set(output) - set(ROW_TENSORS) - {"num_items_in_batch"})
    if unsupported:
        raise ValueError(
            f"dynamic sampling cannot regroup these batch fields yet: {unsupported} (multimodal inputs); "
            "disable filter_groups_enable for this model."
        )


def gather_rows(accelerator: Any, local: dict[str, Any], pad_token_id: int) -> dict[str, torch.Tensor]:
    """A round's rows from every process on every process, in process order (TRL's global row order). The caller
    has checked `local` with `check_regroupable` (before any forward of its rows)."""
    padding = row_padding(pad_token_id)
    rows = {}
    for key, value in local.items():
        if key == "num_items_in_batch" or value is None:
            continue
        if value.dim() >= 2:
            pad_value, pad_left = padding[key]
            value = accelerator.pad_across_processes(value, dim=1, pad_index=pad_value, pad_first=pad_left)
        rows[key] = accelerator.gather(value)
    return rows
