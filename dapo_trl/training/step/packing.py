"""Padding-free forwards: rows packed into one sequence (position ids restarting per row), or trimmed when the
model's attention cannot pack, computing exactly what TRL's padded forward computes, on real tokens only.

Rows are (prompt left-padded | completion right-padded), TRL's layout; a row's real tokens are where its attention
mask is 1, contiguous.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ...algorithm.router_aux import RouterLoad, load_balancing_loss
from .batching import balanced_partition, token_budget_chunks

if TYPE_CHECKING:
    from ...config import DAPOConfig

IGNORE_INDEX = -100
BIN_ALIGNMENT = 64
logger = logging.getLogger(__name__)


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
    """Rows packed into bins (sequences of rows one after another): what the model needs, and the way back."""

    input_ids: torch.Tensor  # (bins, capacity) the rows' real tokens, then pad at a bin's end
    position_ids: torch.Tensor  # (bins, capacity) restarting at 0 for each row; a bin's tail continues its last row
    labels: torch.Tensor  # (bins, capacity) token ids at attended completion positions, IGNORE_INDEX elsewhere
    token_mask: torch.Tensor  # (rows, width) bool: the padded layout's real tokens, row-major
    gather_index: torch.Tensor  # (real tokens,) for each of them in that order, its flat place in the bins
    routing: torch.Tensor | None = None  # (bins, capacity, layers, top-k) a replayed routing, 0 where none

    def real_tokens(self) -> torch.Tensor:
        """(bins, capacity) bool: where the bins hold a row's token (not a bin's tail of padding)."""
        flat = torch.zeros(self.input_ids.numel(), dtype=torch.bool, device=self.input_ids.device)
        flat[self.gather_index] = True
        return flat.view_as(self.input_ids)


def pack_rows(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    logits_to_keep: int,
    capacity: int | None = None,
    pad_token_id: int = 0,
    alignment: int = 1,
    routing: torch.Tensor | None = None,
) -> PackedRows:
    """Pack padded rows padding-free into bins of `capacity` tokens (None: one bin holding every row).

    Rows go to bins first-fit decreasing; each bin is one sequence whose position ids restart at 0 for every row,
    so attention implementations that read packed sequences from position ids keep rows apart. Bins cap the
    attention cost when the mask is dense (SDPA, eager): a bin of C tokens costs C^2, not (all tokens)^2. Labels
    follow TRL's padded forward exactly: only attended completion tokens (the last `logits_to_keep` columns) are
    scored; a row's first token (a prompt token) never is, so no log-prob crosses rows. Bins are as wide as
    `capacity` rounded up to a multiple of `alignment`. A `routing` (rows, width, layers, top-k) aligned with the rows
    is packed the same way (`moe.routing_replay`).
    """
    token_mask = attention_mask.bool()
    lengths = token_mask.sum(dim=1).tolist()
    capacity = max(capacity or sum(lengths), max(lengths, default=1), 1)
    capacity = -(-capacity // alignment) * alignment  # the extra tokens are tail padding
    bins = token_budget_chunks(lengths, capacity)
    completion_column = torch.zeros_like(token_mask)
    completion_column[:, input_ids.size(1) - logits_to_keep :] = True
    labels = input_ids.masked_fill(~completion_column, IGNORE_INDEX)
    device = input_ids.device
    packed_ids = torch.full((len(bins), capacity), pad_token_id, dtype=input_ids.dtype, device=device)
    packed_labels = torch.full((len(bins), capacity), IGNORE_INDEX, dtype=labels.dtype, device=device)
    positions = torch.zeros((len(bins), capacity), dtype=torch.long, device=device)
    starts = [0] * len(lengths)
    for bin_index, rows in enumerate(bins):
        offset = 0
        for row in rows:
            span = slice(offset, offset + lengths[row])
            packed_ids[bin_index, span] = input_ids[row][token_mask[row]]
            packed_labels[bin_index, span] = labels[row][token_mask[row]]
            positions[bin_index, span] = torch.arange(lengths[row], device=device)
            starts[row] = bin_index * capacity + offset
            offset += lengths[row]
        # The tail of padding continues the last row's positions: never scored, and after every real token, so
        # causal attention keeps it out of the rows. A bin holding one row then reads as one unpacked sequence, and
        # a forward whose bins each hold one row needs no mask (sdpa runs its causal kernels, flash included).
        last = lengths[rows[-1]]
        positions[bin_index, offset:] = torch.arange(last, last + capacity - offset, device=device)
    gather_index = torch.cat(
        [torch.arange(starts[row], starts[row] + lengths[row], device=device) for row in range(len(lengths))]
    )
    packed_routing = None
    if routing is not None:
        packed_routing = routing.new_zeros(len(bins) * capacity, *routing.shape[2:])  # where the routing lives
        packed_routing[gather_index.to(routing.device)] = routing[token_mask.to(routing.device)]
        packed_routing = packed_routing.view(len(bins), capacity, *routing.shape[2:]).to(device)  # one pack's
    return PackedRows(packed_ids, positions, packed_labels, token_mask, gather_index, packed_routing)


def unpack_per_token(packed: PackedRows, values: torch.Tensor, logits_to_keep: int) -> torch.Tensor:
    """(rows, logits_to_keep) from a packed model's (bins, capacity - 1) next-token values, zero where unscored.

    values[b, j] belongs to token j + 1 of bin b (the fused head scores token j + 1 from position j); a bin's
    token 0 is a prompt token, never scored.
    """
    aligned = torch.cat([values.new_zeros(values.size(0), 1), values], dim=1).reshape(-1)
    out = values.new_zeros(packed.token_mask.shape)
    out = out.masked_scatter(packed.token_mask, aligned.index_select(0, packed.gather_index))
    return out[:, -logits_to_keep:]


# Attention implementations that keep packed rows apart from position ids restarting at 0 (transformers 5): flash
# attention through varlen kernels and flex attention through a block-sparse mask, on one sequence (batch 1); sdpa
# and eager through a dense packed-sequence mask, so on bins (a bin of C tokens costs C^2, not all tokens squared).
VARLEN_ATTENTION = ("flash_attention_2", "flash_attention_3", "flex_attention")
MASKED_PACKING_ATTENTION = ("sdpa", "eager")

PerTokenOutput = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]  # (logps, entropies, aux_loss)


def balanced_chunks(lengths: list[int], max_tokens: int | None) -> list[list[int]]:
    """The fewest chunks of at most `max_tokens` tokens (a longer row alone), each a balanced mix of lengths."""
    if max_tokens is None:
        return [list(range(len(lengths)))]
    alone = [[row] for row, length in enumerate(lengths) if length > max_tokens]
    rest = [row for row, length in enumerate(lengths) if length <= max_tokens]
    count = -(-sum(lengths[row] for row in rest) // max_tokens)
    while rest:
        parts = balanced_partition([lengths[row] for row in rest], min(count, len(rest)))
        if all(sum(lengths[rest[i]] for i in part) <= max_tokens for part in parts):
            return alone + [[rest[i] for i in part] for part in parts if part]
        count += 1
    return alone


def bin_forwards(rows: list[int], lengths: list[int]) -> list[tuple[list[int], int]]:
    """(rows, bin width) of the forwards that pack `rows` into bins as wide as the longest row.

    First-fit decreasing fills all bins but the emptiest almost completely; that one runs as its own forward at its
    own width, so the batch of bins wastes only FFD's fragmentation instead of a whole bin's slack.
    """
    bins = token_budget_chunks([lengths[row] for row in rows], max(lengths[row] for row in rows))
    loads = [sum(lengths[rows[i]] for i in members) for members in bins]
    if len(bins) == 1:
        return [(rows, loads[0])]
    emptiest = min(range(len(bins)), key=lambda b: (loads[b], b))
    full = [rows[i] for b, members in enumerate(bins) if b != emptiest for i in members]
    full_width = max(load for b, load in enumerate(loads) if b != emptiest)
    return [(full, full_width), ([rows[i] for i in bins[emptiest]], loads[emptiest])]


def padding_free_per_token(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    logits_to_keep: int,
    *,
    packed_forward: Callable[[PackedRows], PerTokenOutput] | None,
    padded_forward: Callable[[torch.Tensor, torch.Tensor, int], PerTokenOutput],
    max_tokens: int | None,
    max_rows: int | None,
    one_sequence: bool = False,
    pad_token_id: int = 0,
    agree_count: Callable[[int], int] | None = None,
    one_forward: bool = False,
    routing: torch.Tensor | None = None,
) -> PerTokenOutput:
    """Per-token log-probs (and entropies) of padded rows, computed by forwards that feed real tokens only.

    Rows are split into chunks of at most `max_tokens` real tokens (without a budget, the tokens of `max_rows` rows
    as wide as the longest: the memory TRL's row chunks take). With `packed_forward`, a chunk is a balanced mix of
    long and short rows, packed into one sequence (`one_sequence`, for varlen attention kernels) or into bins as
    long as its longest row (dense-mask attention); otherwise it holds rows of similar length, trimmed to its own
    widest row and run padded. Results come back in the rows' original order and (rows, logits_to_keep) shape,
    zero where nothing is scored, exactly as the padded forward returns them.

    With sharded weights (ZeRO-3, FSDP) every forward gathers parameters collectively, so every process must run as
    many: `agree_count` (the max over processes) says how many, and a process with fewer chunks runs its first row
    alone for the missing ones, results dropped but kept in the autograd graph at zero weight (the backward passes
    gather too).

    `one_forward` runs every row in a single forward (bins as wide as the longest row): where one backward pass may
    not see a module run twice (`one_forward_per_backward`), whatever the budget.

    A `routing` (rows, width, layers, top-k) rides with the rows into the packs (routing replay: packed forwards
    only). A packed forward's auxiliary value may be a `RouterLoad`: the chunks' loads are then summed into one
    load-balancing loss of all the rows (`algorithm.router_aux`), else TRL's per-chunk losses are averaged.
    """
    if routing is not None and packed_forward is None:
        raise ValueError("a replayed routing needs packed forwards (padding_free with sdpa, eager or flash attention)")
    if input_ids.size(0) == 0:
        for _ in range(agree_count(1) - 1 if agree_count else 0):
            padded_forward(input_ids, attention_mask, logits_to_keep)
        return padded_forward(input_ids, attention_mask, logits_to_keep)
    lengths = attention_mask.sum(dim=1).tolist()  # real tokens per row: what a padding-free forward feeds
    if max_tokens is None and max_rows is not None:  # TRL's row chunks bound memory by rows x widest: keep that
        max_tokens = max_rows * max(lengths)
    if one_forward:
        every_row = list(range(len(lengths)))
        units = [(every_row, None if packed_forward is None or one_sequence else max(lengths))]
    elif packed_forward is None:
        units = [(chunk, None) for chunk in token_budget_chunks(lengths, max_tokens)]
    elif one_sequence:
        units = [(chunk, None) for chunk in balanced_chunks(lengths, max_tokens)]
    else:
        units = [unit for chunk in balanced_chunks(lengths, max_tokens) for unit in bin_forwards(chunk, lengths)]
    lockstep = agree_count(len(units)) - len(units) if agree_count else 0
    units += [([units[0][0][0]], None)] * lockstep  # one row each, their results dropped below
    logps, entropies, aux_losses = [], [], []
    for chunk, capacity in units:
        index = torch.tensor(chunk, device=input_ids.device)
        ids, mask = input_ids.index_select(0, index), attention_mask.index_select(0, index)
        if packed_forward is not None:
            # On CUDA, dense masks reach SDPA's fast kernels only with an aligned last dimension (measured: 64-aligned
            # bins ran 1.75x faster than unaligned ones at L_max 4096); CPU kernels need no alignment.
            alignment = BIN_ALIGNMENT if ids.is_cuda and not one_sequence else 1
            rows_routing = None if routing is None else routing.index_select(0, index.to(routing.device))
            packed = pack_rows(ids, mask, logits_to_keep, capacity, pad_token_id, alignment, rows_routing)
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
    if lockstep:
        dropped, logps = logps[len(logps) - lockstep :], logps[: len(logps) - lockstep]
        entropies, aux_losses, units = entropies[:-lockstep], aux_losses[:-lockstep], units[:-lockstep]
        logps[0] = logps[0] + sum(torch.nan_to_num(extra).sum() for extra in dropped) * 0.0
    inverse = torch.empty(len(lengths), dtype=torch.long, device=input_ids.device)
    inverse[torch.tensor([i for chunk, _ in units for i in chunk], device=input_ids.device)] = torch.arange(
        len(lengths), device=input_ids.device
    )
    entropy = None if entropies[0] is None else torch.cat(entropies)[inverse]
    return torch.cat(logps)[inverse], entropy, combined_aux_loss(aux_losses)


def combined_aux_loss(parts: list[Any]) -> torch.Tensor | None:
    """One auxiliary loss from the forwards' parts: summed router loads (exact), or the mean of TRL's losses."""
    if parts[0] is None:
        return None
    if isinstance(parts[0], RouterLoad):
        return load_balancing_loss(sum(parts[1:], parts[0]))
    return torch.stack(parts).mean()


def one_forward_per_backward(accelerator: Any, args: DAPOConfig, leaf_modules: bool = False) -> bool:
    """DeepSpeed ZeRO-3 fails when a backward pass meets a module that ran more than once ("assert len(set(p.ds_id
    for p in params_in_bucket)) == len(params_in_bucket)") in two cases: with reentrant activation checkpointing
    (what TRL forces for a PEFT model under ZeRO-3), each reentrant segment reports its parameters' gradients again;
    with ZeRO-3 leaf modules (a mixture of experts' blocks, `leaf_modules`), each call's backward hook reports the
    block's gradients again. Training forwards then run all their rows at once."""
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is None or plugin.zero_stage != 3:
        return False
    reentrant = args.gradient_checkpointing and bool((args.gradient_checkpointing_kwargs or {}).get("use_reentrant"))
    if (reentrant or leaf_modules) and args.max_tokens_per_microbatch:
        logger.warning(
            "max_tokens_per_microbatch=%s is not applied to training forwards: under ZeRO-3 with %s each "
            "micro-batch runs as one forward, as GRPOTrainer's does; lower per_device_train_batch_size to bound its "
            "memory",
            args.max_tokens_per_microbatch,
            "mixture-of-experts leaf modules"
            if leaf_modules
            else "reentrant activation checkpointing (TRL's choice for PEFT models)",
        )
    return reentrant or leaf_modules


def packing_mode(model: torch.nn.Module) -> str | None:
    """How forwards pack rows for `model`'s attention: "sequence", "bins" or None (trimmed rows); logged once."""
    attention = getattr(model.config, "_attn_implementation", None)
    if attention in VARLEN_ATTENTION:
        mode = "sequence"
    elif attention in MASKED_PACKING_ATTENTION:
        mode = "bins"
    else:
        logger.warning(
            "padding-free training: %s attention cannot pack rows; forwards run on rows trimmed to their widest "
            "instead (attn_implementation='sdpa' or 'flash_attention_2' packs them)",
            attention,
        )
        return None
    logger.info("padding-free training: rows packed into %s (%s attention)", mode, attention)
    return mode


def forward_count_agreement(accelerator: Any) -> Callable[[int], int] | None:
    """For `padding_free_per_token`: the max of a count over processes when weights are sharded (ZeRO-3, FSDP), whose
    forwards must then run in lockstep; None otherwise (DDP and one process need no agreement)."""
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    sharded = (plugin is not None and plugin.zero_stage == 3) or str(accelerator.distributed_type).endswith("FSDP")
    if not sharded or accelerator.num_processes == 1:
        return None

    def agree(count: int) -> int:
        return int(accelerator.reduce(torch.tensor(count, device=accelerator.device), reduction="max").item())

    return agree
