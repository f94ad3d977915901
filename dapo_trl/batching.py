"""Shaping training batches so that forwards feed real tokens only: balanced partitions, token budgets, packing.

Pure functions, no trainer state. Why moving rows is exact: DAPO's token-level loss of an optimizer step is a sum over
its tokens divided by the step's exact token count (all micro-batches, all processes), so which micro-batch or process
a row of the step lands in changes nothing but the cost of the forwards.
Rows are (prompt left-padded | completion right-padded), TRL's layout; a row's real tokens are where its attention
mask is 1, contiguous.
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

IGNORE_INDEX = -100
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


def token_budget_chunks(lengths: Sequence[int], max_tokens: int | None, max_rows: int | None = None) -> list[list[int]]:
    """Row indices grouped into forwards of at most `max_tokens` real tokens (and `max_rows` rows), longest first.

    First-fit decreasing: few chunks, and rows of similar length together (so a padded fallback wastes little). A
    single row longer than the budget gets a chunk of its own: it is never dropped nor truncated.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    chunks: list[list[int]] = []
    loads: list[int] = []
    for index in order:
        for chunk_index, chunk in enumerate(chunks):
            fits_tokens = max_tokens is None or loads[chunk_index] + lengths[index] <= max_tokens
            fits_rows = max_rows is None or len(chunk) < max_rows
            if fits_tokens and fits_rows:
                chunk.append(index)
                loads[chunk_index] += lengths[index]
                break
        else:
            chunks.append([index])
            loads.append(lengths[index])
    return chunks


def trimmed_columns(attention_mask: torch.Tensor, logits_to_keep: int) -> tuple[int, int]:
    """(first, last + 1) columns any row attends to, never cutting into the completion's left edge.

    Left-padded prompts lose their all-pad columns on the left, right-padded completions theirs on the right; the
    completion block keeps starting at the same place relative to the cut, so results map back by an offset.
    """
    used = attention_mask.bool().any(dim=0).nonzero()
    width = attention_mask.size(1)
    completion_start = width - logits_to_keep
    if used.numel() == 0:
        return completion_start, completion_start + 1
    first = min(int(used[0]), completion_start)
    last = max(int(used[-1]) + 1, completion_start + 1)
    return first, last


@dataclass
class PackedRows:
    """Rows concatenated into one sequence: what the model needs, and where each real token came from."""

    input_ids: torch.Tensor  # (1, T) real tokens of every row, row after row
    position_ids: torch.Tensor  # (1, T) restarting at 0 for each row
    labels: torch.Tensor  # (1, T) token ids at completion positions, IGNORE_INDEX elsewhere
    token_mask: torch.Tensor  # (rows, width) bool: which padded positions hold the packed tokens, row-major


def pack_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int) -> PackedRows:
    """Pack padded rows padding-free: only attended tokens, position ids restarting per row.

    Labels follow TRL's padded forward exactly: only completion tokens (the last `logits_to_keep` columns) that are
    attended are scored; the first token of each row (a prompt token) is never a label, so no log-prob crosses rows.
    """
    token_mask = attention_mask.bool()
    positions = token_mask.long().cumsum(dim=1) - 1
    completion_column = torch.zeros_like(token_mask)
    completion_column[:, input_ids.size(1) - logits_to_keep :] = True
    labels = input_ids.masked_fill(~completion_column, IGNORE_INDEX)
    return PackedRows(
        input_ids=input_ids[token_mask].unsqueeze(0),
        position_ids=positions[token_mask].unsqueeze(0),
        labels=labels[token_mask].unsqueeze(0),
        token_mask=token_mask,
    )


def unpack_per_token(packed: PackedRows, values: torch.Tensor, logits_to_keep: int) -> torch.Tensor:
    """(rows, logits_to_keep) from a packed model's (1, T - 1) next-token values (zero where nothing was scored).

    values[0, j] belongs to packed token j + 1 (the fused head scores token j + 1 from position j); packed token 0
    is a prompt token, never scored.
    """
    aligned = torch.cat([values.new_zeros(1, 1), values], dim=1)[0]
    out = values.new_zeros(packed.token_mask.shape)
    out = out.masked_scatter(packed.token_mask, aligned)
    return out[:, -logits_to_keep:]


def real_token_counts(attention_mask: torch.Tensor) -> torch.Tensor:
    """(rows,) attended tokens per row: what a padding-free forward feeds."""
    return attention_mask.sum(dim=1)


# Attention implementations that build a block-diagonal (per-row) mask from position ids restarting at 0 (transformers
# 5: sdpa, eager and flex through `find_packed_sequence_indices`, flash-attention through varlen cu_seqlens).
PACKING_ATTENTION = ("sdpa", "eager", "flex_attention", "flash_attention_2", "flash_attention_3")

PerTokenOutput = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]  # (logps, entropies, aux_loss)


def padding_free_per_token(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    logits_to_keep: int,
    *,
    packed_forward: Callable[[PackedRows], PerTokenOutput] | None,
    padded_forward: Callable[[torch.Tensor, torch.Tensor, int], PerTokenOutput],
    max_tokens: int | None,
    max_rows: int | None,
) -> PerTokenOutput:
    """Per-token log-probs (and entropies) of padded rows, computed by forwards that feed real tokens only.

    Rows are grouped longest-first into chunks of at most `max_tokens` real tokens (`max_rows` rows when no budget is
    set); each chunk is packed into one sequence when `packed_forward` is given, otherwise trimmed to its own widest
    row and run padded. Results come back in the rows' original order and (rows, logits_to_keep) shape, zero where
    nothing is scored, exactly as the padded forward returns them.
    """
    if input_ids.size(0) == 0:
        return padded_forward(input_ids, attention_mask, logits_to_keep)
    lengths = real_token_counts(attention_mask).tolist()
    chunks = token_budget_chunks(lengths, max_tokens, None if max_tokens else max_rows)
    logps, entropies, aux_losses = [], [], []
    for chunk in chunks:
        index = torch.tensor(chunk, device=input_ids.device)
        ids, mask = input_ids.index_select(0, index), attention_mask.index_select(0, index)
        if packed_forward is not None:
            packed = pack_rows(ids, mask, logits_to_keep)
            chunk_logps, chunk_entropies, aux = packed_forward(packed)
            chunk_logps = unpack_per_token(packed, chunk_logps, logits_to_keep)
            if chunk_entropies is not None:
                chunk_entropies = unpack_per_token(packed, chunk_entropies, logits_to_keep)
        else:
            first, last = trimmed_columns(mask, logits_to_keep)
            kept = last - (ids.size(1) - logits_to_keep)
            chunk_logps, chunk_entropies, aux = padded_forward(ids[:, first:last], mask[:, first:last], kept)
            missing = logits_to_keep - kept
            chunk_logps = torch.nn.functional.pad(chunk_logps, (0, missing))
            if chunk_entropies is not None:
                chunk_entropies = torch.nn.functional.pad(chunk_entropies, (0, missing))
        logps.append(chunk_logps)
        entropies.append(chunk_entropies)
        aux_losses.append(aux)
    inverse = torch.empty(len(lengths), dtype=torch.long, device=input_ids.device)
    inverse[torch.tensor([i for chunk in chunks for i in chunk], device=input_ids.device)] = torch.arange(
        len(lengths), device=input_ids.device
    )
    entropy = None if entropies[0] is None else torch.cat(entropies)[inverse]
    aux_loss = None if aux_losses[0] is None else torch.stack(aux_losses).mean()
    return torch.cat(logps)[inverse], entropy, aux_loss


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
        if isinstance(value, torch.Tensor) and value.dim() == 2 and key.startswith("prompt_"):
            value = value[:, first:] if value.size(1) == prompt_width else value
        elif isinstance(value, torch.Tensor) and value.dim() == 2 and value.size(1) == completion_width:
            value = value[:, :last]
        trimmed[key] = value
    return trimmed


def select_rows(batch: dict[str, object], rows: Sequence[int]) -> dict[str, object]:
    """The given rows of every per-row field (other fields unchanged)."""
    size = batch["prompt_ids"].size(0)
    index = torch.tensor(list(rows), dtype=torch.long, device=batch["prompt_ids"].device)
    return {key: value.index_select(0, index) if _is_row_tensor(value, size) else value for key, value in batch.items()}


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
        merged = {
            key: torch.cat([batch[key] for batch in group]) if _is_row_tensor(value, rows) else value
            for key, value in group[0].items()
        }
        if any(batch["prompt_ids"].size(0) != rows for batch in group):
            balanced.extend(trim_micro_batch(batch) for batch in group)
            continue
        parts = balanced_partition(fed_tokens(merged).tolist(), len(group), equal_count=True)
        balanced.extend(trim_micro_batch(select_rows(merged, part)) for part in parts)
    return balanced


def process_rows(num_rows: int, weights: Sequence[int], num_processes: int, balance: bool) -> list[list[int]]:
    """Which rows of a batch every process holds go to each process: token-balanced, or TRL's contiguous slices."""
    if not balance:
        size = num_rows // num_processes
        return [list(range(rank * size, (rank + 1) * size)) for rank in range(num_processes)]
    return balanced_partition(weights, num_processes, equal_count=True)


def loss_mask(batch: dict[str, object]) -> torch.Tensor:
    """The tokens the loss and its denominator count: completion tokens minus tool replies."""
    mask = batch["completion_mask"]
    return mask if batch.get("tool_mask") is None else mask * batch["tool_mask"]


def packing_supported(model: torch.nn.Module) -> bool:
    """Whether `model`'s attention builds per-row masks from restarting position ids; logs the choice once."""
    attention = getattr(model.config, "_attn_implementation", None)
    if attention in PACKING_ATTENTION:
        logger.info("padding-free training: each forward packs its rows into one sequence (%s attention)", attention)
        return True
    logger.warning(
        "padding-free training: %s attention cannot pack rows; forwards run on rows trimmed to their widest instead "
        "(attn_implementation='sdpa' or 'flash_attention_2' packs them)",
        attention,
    )
    return False


def budget_passes(batch: dict[str, object], max_tokens: int) -> int:
    """How many forward/backward passes a micro-batch needs so that none holds more than `max_tokens` tokens."""
    return len(token_budget_chunks(fed_tokens(batch).tolist(), max_tokens))


def split_for_budget(batch: dict[str, object], max_tokens: int, passes: int) -> list[dict[str, object]]:
    """A micro-batch as exactly `passes` parts of at most `max_tokens` tokens each (a longer row alone).

    `passes` is agreed across processes (DDP and ZeRO-3 need the same number of backward passes everywhere), so a
    process needing fewer splits its heaviest part further, or adds a one-row part that is masked out of the loss
    (zero advantage, zero mask: it only runs so the collectives match).
    """
    chunks = token_budget_chunks(fed_tokens(batch).tolist(), max_tokens)
    weights = fed_tokens(batch).tolist()
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


def masked_rows(batch: dict[str, object], count: int) -> dict[str, object]:
    """`count` copies of the batch's first row that feed one token and count for nothing: no completion token
    attended, zero advantage. They only make processes run forwards of equal row counts (TRL gathers per-row
    metrics across processes, and DDP / ZeRO-3 need matching passes)."""
    rows = select_rows(batch, [0] * count)
    rows["completion_mask"] = torch.zeros_like(rows["completion_mask"])
    rows["advantages"] = torch.zeros_like(rows["advantages"])
    prompt_mask = torch.zeros_like(rows["prompt_mask"])
    prompt_mask[:, -1] = 1
    rows["prompt_mask"] = prompt_mask
    return rows


def pad_with_masked_rows(batch: dict[str, object], rows: int) -> dict[str, object]:
    """The batch grown to `rows` rows with `masked_rows` (same widths, so the columns line up)."""
    missing = rows - batch["prompt_ids"].size(0)
    if missing <= 0:
        return batch
    size = batch["prompt_ids"].size(0)
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

    MEANS = ("entropy", "kl", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean",
             "cispo_clip_ratio", "vespo/phi_seq_mean")  # fmt: skip
    EXTREMES = {"clip_ratio/low_min": min, "clip_ratio/high_max": max}

    def __init__(self) -> None:
        self.weights: dict[str, list[float]] = {"train": [], "eval": []}

    def record(self, mode: str, tokens: float) -> None:
        """The token count of the forward whose metrics TRL just appended."""
        self.weights[mode].append(tokens)

    def apply(self, mode: str, metrics: dict[str, list[float]]) -> None:
        """Collapse each weighted metric's list to its window aggregate, in place, before TRL averages the lists."""
        weights = self.weights[mode]
        for name in self.MEANS:
            values = metrics.get(name)
            if values and len(values) == len(weights) and sum(weights) > 0:
                metrics[name] = [sum(v * w for v, w in zip(values, weights, strict=True)) / sum(weights)]
        for name, extreme in self.EXTREMES.items():
            values = [v for v in metrics.get(name) or [] if v == v]  # drop NaN (micro-batches without tokens)
            if values:
                metrics[name] = [extreme(values)]
        for name in [name for name, values in metrics.items() if all(v != v for v in values)]:
            del metrics[name]  # nothing measured in the window: TRL would log None, which loggers reject
        self.weights[mode] = []
