"""Shaping the training micro-batches of an optimizer step: balanced by tokens, trimmed, split under a token budget.

Why moving rows is exact: DAPO's token-level loss of an optimizer step is a sum over its tokens divided by the
step's exact token count (all micro-batches, all processes), so which micro-batch or process a row of the step
lands in changes nothing but the cost of the forwards. Pure functions, except `StepPlanner` and
`backward_without_sync`, which talk to the accelerator.
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ...algorithm.losses import POLICY_LOSSES, Aggregation, policy_loss

if TYPE_CHECKING:
    from ...config import DAPOConfig

logger = logging.getLogger(__name__)


def balanced_partition(weights: Sequence[int], num_parts: int, equal_count: bool = False) -> list[list[int]]:
    """Indices split into `num_parts` parts of near-equal total weight (longest-processing-time greedy).

    Heaviest first, each row goes to the lightest part; with `equal_count`, only parts holding fewer than
    len(weights) / num_parts rows qualify (needs num_parts to divide len(weights)). Each part is sorted by index so
    row order stays deterministic. LPT is within 4/3 of the optimum makespan, plenty for token balancing.
    """
    if num_parts < 1:
        raise ValueError(f"num_parts={num_parts} must be >= 1")
    if equal_count and len(weights) % num_parts:
        raise ValueError(f"{len(weights)} rows do not split into {num_parts} equal parts")
    capacity = len(weights) // num_parts if equal_count else len(weights)
    parts: list[list[int]] = [[] for _ in range(num_parts)]
    heap = [(0, part) for part in range(num_parts)]  # (load, part index): lightest first, ties by index
    order = sorted(range(len(weights)), key=lambda i: (-weights[i], i))
    for index in order:
        skipped = []
        load, part = heapq.heappop(heap)
        while len(parts[part]) >= capacity:
            skipped.append((load, part))
            load, part = heapq.heappop(heap)
        parts[part].append(index)
        heapq.heappush(heap, (load + weights[index], part))
        for entry in skipped:
            heapq.heappush(heap, entry)
    return [sorted(part) for part in parts]


def token_budget_chunks(lengths: Sequence[int], max_tokens: int | None) -> list[list[int]]:
    """Row indices grouped into forwards of at most `max_tokens` real tokens, longest first.

    First-fit decreasing: few chunks, and rows of similar length together (so a padded fallback wastes little). A
    single row longer than the budget gets a chunk of its own: it is never dropped nor truncated.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    chunks: list[list[int]] = []
    loads: list[int] = []
    for index in order:
        for chunk_index, chunk in enumerate(chunks):
            if max_tokens is None or loads[chunk_index] + lengths[index] <= max_tokens:
                chunk.append(index)
                loads[chunk_index] += lengths[index]
                break
        else:
            chunks.append([index])
            loads.append(lengths[index])
    return chunks


def _is_row_tensor(value: object, rows: int) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() >= 1 and value.size(0) == rows


def trim_micro_batch(batch: dict[str, object]) -> dict[str, object]:
    """Cut a micro-batch's all-padding columns: prompts' on the left, completions' (and per-token fields') right."""
    prompt_used = batch["prompt_mask"].bool().any(dim=0).nonzero()
    completion_used = batch["completion_mask"].bool().any(dim=0).nonzero()
    prompt_width, completion_width = batch["prompt_ids"].size(1), batch["completion_ids"].size(1)
    first = int(prompt_used[0]) if prompt_used.numel() else prompt_width - 1
    last = int(completion_used[-1]) + 1 if completion_used.numel() else 1
    trimmed = {}
    for key, value in batch.items():
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and key.startswith("prompt_"):
            value = value[:, first:] if value.size(1) == prompt_width else value
        elif isinstance(value, torch.Tensor) and value.dim() >= 2 and value.size(1) == completion_width:
            value = value[:, :last]
        trimmed[key] = value
    return trimmed


def select_rows(batch: dict[str, object], rows: Sequence[int]) -> dict[str, object]:
    """The given rows of every per-row field (other fields unchanged)."""
    size = batch["prompt_ids"].size(0)
    index = torch.tensor(list(rows), dtype=torch.long)
    return {
        key: value.index_select(0, index.to(value.device)) if _is_row_tensor(value, size) else value
        for key, value in batch.items()
    }


def fed_tokens(batch: dict[str, object]) -> torch.Tensor:
    """(rows,) tokens a padding-free forward feeds for each row: attended prompt plus completion tokens."""
    return batch["prompt_mask"].sum(dim=1) + batch["completion_mask"].sum(dim=1)


def balance_micro_batches(micro_batches: list[dict[str, object]], window: int) -> list[dict[str, object]]:
    """Re-deal the rows of each optimizer step's `window` micro-batches by token count, then trim each.

    Every micro-batch keeps its row count (processes gather per-row metrics, which needs equal sizes), so the
    step's work spreads evenly and each micro-batch is as narrow as its own widest row.
    """
    balanced = []
    for start in range(0, len(micro_batches), window):
        group = micro_batches[start : start + window]
        rows = group[0]["prompt_ids"].size(0)
        if any(batch["prompt_ids"].size(0) != rows for batch in group):
            balanced.extend(trim_micro_batch(batch) for batch in group)
            continue
        merged = {
            key: torch.cat([batch[key] for batch in group]) if _is_row_tensor(value, rows) else value
            for key, value in group[0].items()
        }
        parts = balanced_partition(fed_tokens(merged).tolist(), len(group), equal_count=True)
        balanced.extend(trim_micro_batch(select_rows(merged, part)) for part in parts)
    return balanced


def process_rows(weights: Sequence[int], num_processes: int, balance: bool) -> list[list[int]]:
    """Which rows of a batch every process holds go to each process: token-balanced, or TRL's contiguous slices."""
    if not balance:
        size = len(weights) // num_processes
        return [list(range(rank * size, (rank + 1) * size)) for rank in range(num_processes)]
    return balanced_partition(weights, num_processes, equal_count=True)


def loss_mask(batch: dict[str, object]) -> torch.Tensor:
    """The tokens the loss and its denominator count: completion tokens minus tool replies."""
    mask = batch["completion_mask"]
    return mask if batch.get("tool_mask") is None else mask * batch["tool_mask"]


def budget_passes(batch: dict[str, object], max_tokens: int) -> int:
    """How many forward/backward passes a micro-batch needs so that none holds more than `max_tokens` tokens."""
    return len(token_budget_chunks(fed_tokens(batch).tolist(), max_tokens))


def split_for_budget(batch: dict[str, object], max_tokens: int, passes: int) -> list[dict[str, object]]:
    """A micro-batch as exactly `passes` parts of at most `max_tokens` tokens each (a longer row alone).

    `passes` is agreed across processes (DDP and ZeRO-3 need the same number of backward passes everywhere), so a
    process needing fewer splits its heaviest part further, or adds a one-row part that is masked out of the loss
    (zero advantage, zero mask: it only runs so the collectives match).
    """
    weights = fed_tokens(batch).tolist()
    chunks = token_budget_chunks(weights, max_tokens)
    while len(chunks) < passes:
        heaviest = max(range(len(chunks)), key=lambda i: (len(chunks[i]) > 1, sum(weights[r] for r in chunks[i])))
        if len(chunks[heaviest]) < 2:
            break
        halves = balanced_partition([weights[r] for r in chunks[heaviest]], 2)
        rows = chunks.pop(heaviest)
        chunks.extend([[rows[i] for i in half] for half in halves])
    parts = [trim_micro_batch(select_rows(batch, sorted(chunk))) for chunk in chunks]
    while len(parts) < passes:
        parts.append(trim_micro_batch(masked_rows(batch, 1)))
    return parts


FILLER_ROWS = "filler_rows"  # (rows,) bool: which rows of a pass are `masked_rows` (absent: none)


def masked_rows(batch: dict[str, object], count: int) -> dict[str, object]:
    """`count` copies of the batch's first row that feed one token and count for nothing: no completion token
    attended, zero advantage, marked in `FILLER_ROWS` (the loss step feeds them a token no router load counts). They
    only make processes run forwards of equal row counts (TRL gathers per-row metrics across processes, and DDP /
    ZeRO-3 need matching passes)."""
    rows = select_rows(batch, [0] * count)
    rows["completion_mask"] = torch.zeros_like(rows["completion_mask"])
    rows["advantages"] = torch.zeros_like(rows["advantages"])
    prompt_mask = torch.zeros_like(rows["prompt_mask"])
    prompt_mask[:, -1] = 1
    rows["prompt_mask"] = prompt_mask
    rows[FILLER_ROWS] = torch.ones(count, dtype=torch.bool, device=prompt_mask.device)
    return rows


def pad_with_masked_rows(batch: dict[str, object], rows: int) -> dict[str, object]:
    """The batch grown to `rows` rows with `masked_rows` (same widths, so the columns line up)."""
    missing = rows - batch["prompt_ids"].size(0)
    if missing <= 0:
        return batch
    size = batch["prompt_ids"].size(0)
    if FILLER_ROWS not in batch:
        batch = {**batch, FILLER_ROWS: torch.zeros(size, dtype=torch.bool, device=batch["prompt_ids"].device)}
    extra = masked_rows(batch, missing)
    return {
        key: torch.cat([value, extra[key]]) if _is_row_tensor(value, size) else value for key, value in batch.items()
    }


def backward_without_sync(trainer: Any, model: torch.nn.Module, loss: torch.Tensor, num_items_in_batch: Any) -> None:
    """Backpropagate one extra part of a micro-batch the way `Trainer.training_step` would, but without the
    gradient sync or optimizer step that belongs to the micro-batch's last backward (DDP no_sync; DeepSpeed
    accumulation boundary off)."""
    from accelerate.utils import DistributedType

    accelerator = trainer.accelerator
    if trainer.args.n_gpu > 1:
        loss = loss.mean()
    scaled = trainer.loss_is_scaled_for_ga
    if scaled is None:
        accepts = trainer.model_accepts_loss_kwargs and num_items_in_batch is not None
        scaled = accepts or trainer.compute_loss_func is not None
    if not scaled:
        loss = loss / trainer.current_gradient_accumulation_steps
    kwargs = {"scale_wrt_gas": False} if accelerator.distributed_type == DistributedType.DEEPSPEED else {}
    state = accelerator.gradient_state
    syncing = state.sync_gradients
    state._set_sync_gradients(False)
    try:
        with accelerator.no_sync(model):
            accelerator.backward(loss, **kwargs)
    finally:
        state._set_sync_gradients(syncing)


class TokenWeightedMetrics:
    """TRL's per-token loss metrics, aggregated over the tokens of the logging window instead of per micro-batch.

    TRL logs one value per micro-batch (a token-weighted mean over that micro-batch, all processes) and averages
    them, so the result depends on how rows are split into micro-batches. Weighting each value by its micro-batch's
    token count gives the mean over all the window's tokens, the same for any split; minima and maxima over
    sequences become the window's minimum and maximum, and a metric with no value in the window is not logged.
    """

    def __init__(self) -> None:
        self.weights: dict[str, list[float]] = {"train": [], "eval": []}

    def record(self, mode: str, tokens: float) -> None:
        """The token count of the forward whose metrics TRL just appended."""
        self.weights[mode].append(tokens)

    def apply(self, mode: str, metrics: dict[str, list[float]]) -> None:
        """Collapse each weighted metric's list to its window aggregate, in place, before TRL averages the lists."""
        weights = self.weights[mode]
        # Every registered loss's metrics (the loss table, read now: a loss may be registered after import), and the
        # entropy and KL every loss logs.
        means = {"entropy", "kl", *(name for loss in POLICY_LOSSES.values() for name in loss.metrics)}
        extremes = {name: kind for loss in POLICY_LOSSES.values() for name, (_, kind) in loss.extremes.items()}
        for name in means:
            values = metrics.get(name)
            if values and len(values) == len(weights) and sum(weights) > 0:
                metrics[name] = [sum(v * w for v, w in zip(values, weights, strict=True)) / sum(weights)]
        for name, kind in extremes.items():
            values = [v for v in metrics.get(name) or [] if v == v]  # drop NaN (micro-batches without tokens)
            if values:
                metrics[name] = [min(values) if kind == "min" else max(values)]
        for name in [name for name, values in metrics.items() if all(v != v for v in values)]:
            del metrics[name]  # nothing measured in the window: TRL would log None, which loggers reject
        self.weights[mode] = []


@dataclass(frozen=True)
class PassShare:
    """What one backward pass is of its micro-batch, per loss term: each term of the pass, multiplied by its share,
    adds up over the passes to the term of the micro-batch run whole (a token budget's passes, `StepPlanner.parts`).

    The policy loss weighs what its aggregation averages over (`StepPlanner.part_weights`). The entropy bonus is a
    mean over the micro-batch's loss tokens on this process, so a pass's mean weighs its share of them. The router's
    auxiliary loss is exact by construction when built from router loads (`algorithm.router_aux.part_of`: each pass's
    loss is its part of the micro-batch's); otherwise (TRL's own per-forward loss) a pass's loss weighs its share of
    the fed tokens, the right scale but not the micro-batch's loss. Per micro-batch bookkeeping (the adaptive entropy
    controller's step, the aux-loss metric) happens once, on the `last` pass.
    """

    policy: float = 1.0
    loss_tokens: float = 1.0
    fed_tokens: float = 1.0
    last: bool = True


WHOLE_PASS = PassShare()  # a micro-batch run as one pass
PASS_SHARE = "pass_share"  # the key of a pass's `PassShare` in the inputs the loss step receives


def token_shares(total: float, counts: Sequence[float]) -> list[float]:
    """Each part's share of a micro-batch's `total` tokens: what a per-part mean over those tokens is multiplied by
    so the parts add up to the mean over the whole (a part without a token has a zero mean, and so a zero share)."""
    return [count / max(total, 1.0) for count in counts]


# (this process's rows' token counts, token budget per process) -> this process's rows in each backward pass its
# sequence-parallel group plans over all its processes' rows (`SequenceParallel.group_passes`)
GroupPasses = Callable[[list[int], int], list[list[int]]]


class StepPlanner:
    """Prepares a generation batch's micro-batches for training and splits them under the token budget.

    `plan` deals each optimizer step's rows to its micro-batches by tokens (padding-free; only when every optimizer
    step lies inside one generation batch, i.e. K divides S), records each micro-batch's loss tokens over all
    processes as `loss_tokens` (one all-reduce per generation batch; `steps.OptimizerSteps` sums them into each
    optimizer step's exact denominator, where TRL scales one generation-wide count by K / S, exact only when S == K:
    TRL #5619, #6024, #5890, #6439) and agrees on how many backward passes each needs under
    `max_tokens_per_microbatch`; `parts` cuts one micro-batch into those passes, with equal rows on every process.
    With sequence parallelism the passes are planned over the rows of the whole group (`group_passes`): a pass holds
    at most N x the budget of the group's tokens, so each process holds about the budget, and a row longer than the
    budget gets a pass of its own, split N ways, while the group's other processes run a masked row.
    """

    def __init__(self, args: DAPOConfig, accelerator: Any, loss_type: str, group_passes: GroupPasses | None = None):
        self.args = args
        self.accelerator = accelerator
        aggregation = policy_loss(loss_type).aggregation
        self.split_weight = aggregation.split_weight
        self.exact_denominator = aggregation is Aggregation.STEP_TOKENS  # normalised by the step's own token count
        self.group_passes = group_passes  # with sequence parallelism: passes planned over the group's rows

    def plan(self, micro_batches: list[dict[str, Any]]) -> list[dict[str, Any]]:
        window = self.args.gradient_accumulation_steps
        if self.args.padding_free:
            aligned = self.args.steps_per_generation % window == 0
            micro_batches = balance_micro_batches(micro_batches, window if aligned else 1)
        device = self.accelerator.device
        local_counts = torch.stack([loss_mask(batch).sum() for batch in micro_batches]).to(device)
        global_counts = self.accelerator.reduce(local_counts.float(), reduction="sum").tolist()
        for batch, count in zip(micro_batches, global_counts, strict=True):
            batch["loss_tokens"] = count
        budget = self.args.max_tokens_per_microbatch
        if budget:
            if self.group_passes is not None:
                for batch in micro_batches:
                    batch["pass_rows"] = self.group_passes(fed_tokens(batch).tolist(), budget)
                local = torch.tensor([len(batch["pass_rows"]) for batch in micro_batches], device=device)
            else:
                local = torch.tensor([budget_passes(batch, budget) for batch in micro_batches], device=device)
            agreed = self.accelerator.reduce(local, reduction="max").tolist()
            for batch, passes in zip(micro_batches, agreed, strict=True):
                batch["backward_passes"] = passes
            longest = max(int(fed_tokens(batch).max()) for batch in micro_batches)
            sequence_parallel = self.args.sequence_parallel_size
            limit = budget * sequence_parallel  # a sequence-parallel group shares its forwards
            if longest > limit:
                logger.warning(
                    "a row of %d tokens exceeds max_tokens_per_microbatch=%d x sequence_parallel_size=%d: it "
                    "trains alone in its own pass (nothing is dropped or truncated); raise max_tokens_per_microbatch "
                    "(or sequence_parallel_size) to bound memory by it",
                    longest,
                    budget,
                    sequence_parallel,
                )
        return micro_batches

    def part_weights(self, batch: dict[str, Any], parts: list[dict[str, Any]]) -> list[float]:
        """What each backward pass's policy loss is multiplied by so that the passes add up to the micro-batch's.

        A loss normalised by the step's own token count (`Aggregation.STEP_TOKENS`: dapo, cispo, vespo) adds up as it
        is. The others average over the micro-batch they are given, its rows or its loss tokens
        (`Aggregation.split_weight`): a part's loss, averaged over the part, weighs its share of the micro-batch's
        rows or tokens (padding rows included in a part's own count, as the row mean counts them).
        """
        if len(parts) == 1 or self.split_weight == "none":
            return [1.0] * len(parts)
        if self.split_weight == "tokens":
            total = max(float(loss_mask(batch).sum()), 1.0)
            return [max(float(loss_mask(part).sum()), 1.0) / total for part in parts]
        rows = batch["prompt_ids"].size(0)
        return [part["prompt_ids"].size(0) / rows for part in parts]

    def pass_shares(self, batch: dict[str, Any], parts: list[dict[str, Any]]) -> list[PassShare]:
        """Each backward pass's share of the micro-batch, per loss term (`PassShare`)."""
        if len(parts) == 1:
            return [WHOLE_PASS]
        policy = self.part_weights(batch, parts)
        loss_tokens = token_shares(float(loss_mask(batch).sum()), [float(loss_mask(part).sum()) for part in parts])
        fed = token_shares(float(fed_tokens(batch).sum()), [float(fed_tokens(part).sum()) for part in parts])
        last = len(parts) - 1
        return [PassShare(policy[i], loss_tokens[i], fed[i], i == last) for i in range(len(parts))]

    def parts(self, batch: dict[str, Any]) -> list[dict[str, Any]]:
        """The micro-batch's backward passes (itself, or its budget parts padded to equal rows on every process),
        each carrying its `PassShare` under `PASS_SHARE`."""
        passes = batch.get("backward_passes", 1)
        if passes == 1:
            return [{**batch, PASS_SHARE: WHOLE_PASS}]
        if "pass_rows" in batch:  # the group's plan: this process's rows of each pass (a masked row when none)
            planned = [select_rows(batch, rows) if rows else masked_rows(batch, 1) for rows in batch["pass_rows"]]
            planned += [masked_rows(batch, 1)] * (passes - len(planned))
            parts = [trim_micro_batch(part) for part in planned]
        else:
            parts = split_for_budget(batch, self.args.max_tokens_per_microbatch, passes)
        rows = torch.tensor([part["prompt_ids"].size(0) for part in parts], device=self.accelerator.device)
        rows = self.accelerator.reduce(rows, reduction="max").tolist()
        parts = [pad_with_masked_rows(part, count) for part, count in zip(parts, rows, strict=True)]
        shares = self.pass_shares(batch, parts)
        return [{**part, PASS_SHARE: share} for part, share in zip(parts, shares, strict=True)]


def process_share(batch: dict[str, Any], args: DAPOConfig, accelerator: Any) -> dict[str, Any]:
    """This process's rows of a generation batch every process holds whole (dynamic sampling's), with the batch's
    loss-token count over all processes as `num_items_in_batch`. With one optimizer step per generation batch and
    padding_free, rows are dealt by token count (`process_rows`), so processes carry about equal tokens."""
    balance = args.padding_free and args.steps_per_generation == args.gradient_accumulation_steps
    rows = process_rows(fed_tokens(batch).tolist(), accelerator.num_processes, balance)
    local = select_rows(batch, rows[accelerator.process_index])
    local["num_items_in_batch"] = accelerator.gather(loss_mask(local).sum()).sum()
    return local
