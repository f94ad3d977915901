"""Ulysses sequence parallelism for the training-phase forwards: N consecutive processes run their rows as one packed
sequence cut into N shards, each process computing one shard, with DeepSpeed's Ulysses attention in between.

How a forward runs on a group of N processes (`SequenceParallel.per_token`):
1. The group gathers its processes' rows (token ids only): every process of the group holds the same rows.
2. They are packed padding-free into sequences (position ids restarting per row), at most N x the per-process token
   budget each, exactly as a single process packs its own rows (`packing.padding_free_per_token`). Under a token
   budget the training passes are planned over the group's rows (`group_passes`), so a row longer than the budget
   gets a pass of its own, split N ways: each process holds about the budget, however long the row.
3. Each sequence's labels are shifted by one *before* it is cut, so a row cut at a shard boundary keeps its next
   token; the sequence is padded to a multiple of N (the padding is a block of its own) and process r takes shard r.
4. Inside attention, DeepSpeed's `UlyssesSPAttentionHF` all-to-alls the shards' queries, keys and values into whole
   sequences of 1/N of the heads, gathers the position ids, runs the core attention, and all-to-alls back. The core
   attention keeps packed rows apart: flash-attention's varlen kernels (from the position ids), or, for models loaded
   with sdpa, causal SDPA run row by row (`segment_causal_attention`, any device, no L x L mask).
5. TRL's fused LM head scores each shard (no full logits); the per-token log-probs (and entropies) are gathered over
   the group, and each process keeps its own rows. The gather's backward sums every process's gradient and keeps the
   local shard, so each process's parameter gradient is its shard's share of the group's loss: summed by the usual
   data-parallel average (DDP, ZeRO), the update equals the one without sequence parallelism.
6. A mixture-of-experts router's auxiliary loss is a function of per-expert sums over the whole sequence, so each
   shard's router load (`algorithm.router_aux`) is summed over the group first (`sum_router_load`; its backward
   summed the same way): every process of the group gets the loss of the unsharded sequence.

Generation, rewards, dynamic sampling, token counts and the loss stay per process as without sequence parallelism:
only the forwards are shared, so every decision and metric keeps its meaning.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as torch_dist

from ...algorithm.router_aux import RouterLoad
from .batching import token_budget_chunks
from .packing import IGNORE_INDEX, PackedRows, PerTokenOutput, padding_free_per_token

logger = logging.getLogger(__name__)

# Core attentions inside Ulysses that keep packed rows apart: flash attention from the gathered position ids (varlen);
# models loaded with sdpa get `segment_causal_attention`, which does the same with SDPA, row by row. (Eager is not
# registered in transformers' attention table: each model brings its own, which the dispatch could not fall back to.)
VARLEN_CORE = ("flash_attention_2", "flash_attention_3")
SEGMENT_CORE = ("sdpa",)
# Layers that mix tokens only through attention: what Ulysses shards exactly (linear attention, SSM or convolution
# layers of hybrid models would mix each shard alone).
ATTENTION_LAYERS = ("full_attention", "sliding_attention")

# A sharded forward passes its Ulysses attention down to the attention functions as this keyword argument
# (transformers forwards a model's extra keyword arguments to attention), so activation checkpointing's recomputation,
# which runs outside any context, attends the same way; every other forward (generation, other models) is unchanged.
ULYSSES_KWARG = "ulysses_attention"
# Attention implementations whose masks are skipped while a sharded forward builds them (Ulysses attends from the
# gathered position ids): non-empty only inside `SequenceParallel.sharded`.
_ACTIVE: set[str] = set()
_INSTALLED: set[str] = set()

# (one shard's input ids, position ids, pre-shifted labels, keyword arguments for the model) -> (its per-token
# log-probs, entropies or None, its router load or None); the last argument is (1, shard) bool, the shard's real tokens
ShardForward = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, dict[str, Any], torch.Tensor],
    tuple[torch.Tensor, torch.Tensor | None, RouterLoad | None],
]


def valid_sizes(query_heads: int, kv_heads: int, world_size: int) -> list[int]:
    """Sequence-parallel sizes Ulysses can run: dividing the world size and the query heads, with KV heads divisible
    by the size or the size by them (KV heads are then replicated)."""
    return [
        size
        for size in range(1, world_size + 1)
        if world_size % size == 0 and query_heads % size == 0 and (kv_heads % size == 0 or size % kv_heads == 0)
    ]


def check_sequence_parallel(size: int, model_config: Any, world_size: int, distributed_type: str) -> str:
    """Refuse a layout Ulysses cannot run, naming the fix; return the model's attention implementation."""
    text_config = model_config.get_text_config()
    query_heads, kv_heads = text_config.num_attention_heads, text_config.num_key_value_heads
    if world_size % size:
        raise ValueError(
            f"sequence_parallel_size={size} does not divide the world size {world_size}: groups of {size} processes "
            f"must tile all processes. Launch a multiple of {size} processes, or choose one of "
            f"{valid_sizes(query_heads, kv_heads, world_size)} (the sizes this model and world size allow)."
        )
    if query_heads % size or not (kv_heads % size == 0 or size % kv_heads == 0):
        raise ValueError(
            f"sequence_parallel_size={size} does not fit the model's {query_heads} query heads and {kv_heads} KV "
            f"heads: Ulysses gives each process of a group 1/{size} of the heads, so query heads must be divisible "
            f"by it, and KV heads by it (or it by them). Valid sizes with {world_size} processes: "
            f"{valid_sizes(query_heads, kv_heads, world_size)}."
        )
    if "FSDP" in distributed_type:
        raise ValueError(
            "sequence_parallel_size > 1 runs on DeepSpeed (any ZeRO stage) or DDP, not FSDP: launch with a DeepSpeed "
            "config (e.g. accelerate launch --config_file configs/accelerate/zero3_1node_8gpu.yaml)."
        )
    attention = getattr(model_config, "_attn_implementation", None)
    if attention not in VARLEN_CORE + SEGMENT_CORE:
        raise ValueError(
            f"sequence_parallel_size > 1 cannot run {attention!r} attention: inside Ulysses it would treat the packed "
            "rows of a forward as one sequence and let them attend to each other (or, for eager, replace the "
            "model's own attention everywhere). Load the model with attn_implementation='flash_attention_2' (GPU, "
            "fastest) or 'sdpa'."
        )
    layer_types = set(getattr(text_config, "layer_types", None) or ["full_attention"])
    if not layer_types <= set(ATTENTION_LAYERS):
        raise ValueError(
            f"sequence_parallel_size > 1 cannot shard this model's {sorted(layer_types - set(ATTENTION_LAYERS))} "
            "layers: Ulysses gathers whole sequences inside attention only, so those layers would see 1/N of each "
            "sequence. Use sequence_parallel_size=1 for hybrid models."
        )
    if "sliding_attention" in layer_types and attention in SEGMENT_CORE:
        raise ValueError(
            "sequence_parallel_size > 1 with sliding-window attention layers needs "
            "attn_implementation='flash_attention_2' (the row-by-row SDPA core is full causal attention)."
        )
    return attention


def segment_causal_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    position_ids: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Causal attention of each packed row on its own (rows start where the position ids restart at 0).

    query (1, heads, L, head_dim), key / value (1, kv_heads, L, head_dim); returns (1, L, heads, head_dim) as
    transformers' attention functions do. Exact (each row attends to its own past only) with no L x L mask.
    """
    if sliding_window is not None or kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None:
        raise NotImplementedError(
            "sequence parallelism's row-by-row SDPA is plain causal attention (no sliding window, logit soft-capping "
            "or attention sinks): load the model with attn_implementation='flash_attention_2'"
        )
    if position_ids is None or query.size(0) != 1:
        raise ValueError("segment_causal_attention needs one packed sequence (batch 1) and its position ids")
    length = query.size(2)
    starts = (position_ids.reshape(-1) == 0).nonzero().flatten().tolist()
    bounds = ([0] if not starts or starts[0] != 0 else []) + starts + [length]
    grouped = query.size(1) != key.size(1)
    outputs = [
        torch.nn.functional.scaled_dot_product_attention(
            query[:, :, start:end],
            key[:, :, start:end],
            value[:, :, start:end],
            dropout_p=dropout,
            is_causal=True,
            scale=scaling,
            enable_gqa=grouped,
        )
        for start, end in zip(bounds[:-1], bounds[1:], strict=True)
        if end > start
    ]
    return torch.cat(outputs, dim=2).transpose(1, 2).contiguous(), None


def _install_dispatch(attention: str) -> None:
    """Route transformers' `attention` implementation through the Ulysses attention a forward passes as
    `ULYSSES_KWARG`, and to the original function otherwise; skip building its mask while a sharded forward runs."""
    if attention in _INSTALLED:
        return
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    original = ALL_ATTENTION_FUNCTIONS[attention]
    original_mask = ALL_MASK_ATTENTION_FUNCTIONS[attention]

    def attention_function(module, query, key, value, attention_mask, *args, **kwargs):
        ulysses = kwargs.pop(ULYSSES_KWARG, None)
        if ulysses is None:
            return original(module, query, key, value, attention_mask, *args, **kwargs)
        groups = getattr(module, "num_key_value_groups", None)
        try:  # Ulysses rewrites num_key_value_groups when it replicates KV heads: restore it for later forwards
            return ulysses(module, query, key, value, None, *args, **kwargs)
        finally:
            if groups is not None:
                module.num_key_value_groups = groups

    def mask_function(*args, **kwargs):
        return None if attention in _ACTIVE else original_mask(*args, **kwargs)

    ALL_ATTENTION_FUNCTIONS[attention] = attention_function
    ALL_MASK_ATTENTION_FUNCTIONS[attention] = mask_function
    _INSTALLED.add(attention)


def _all_gather(tensor: torch.Tensor, group: Any, size: int) -> list[torch.Tensor]:
    """Every process's `tensor` (equal shapes), in rank order; the list form gloo supports."""
    parts = [torch.empty_like(tensor) for _ in range(size)]
    torch_dist.all_gather(parts, tensor.contiguous(), group=group)
    return parts


class _SumOverGroup(torch.autograd.Function):
    """All-reduce (sum) over a group; the backward sums every process's gradient too (each process's loss reads the
    group's sum), as `_GatherSequence` does for log-probs."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        total = local.clone()
        torch_dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        torch_dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _GatherSequence(torch.autograd.Function):
    """All-gather of equal-length shards along dim 1 over a group; the backward sums every process's gradient and
    keeps the local shard (each process's loss may read any shard)."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group: Any, rank: int, size: int) -> torch.Tensor:
        ctx.group, ctx.rank, ctx.width = group, rank, local.size(1)
        return torch.cat(_all_gather(local, group, size), dim=1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        torch_dist.all_reduce(grad, group=ctx.group)
        return grad[:, ctx.rank * ctx.width : (ctx.rank + 1) * ctx.width], None, None, None


@dataclass
class GroupRows:
    """A group's rows in TRL's layout (prompts left-padded | completions right-padded), and where this process's are."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    logits_to_keep: int
    own_rows: slice
    own_keep: int


def shard_bounds(length: int, size: int, rank: int) -> tuple[int, int]:
    """The [start, end) of shard `rank` once a sequence of `length` tokens is padded to a multiple of `size`."""
    width = -(-length // size)
    return rank * width, (rank + 1) * width


def shard_packed(packed: PackedRows, size: int, rank: int, pad_token_id: int) -> tuple[torch.Tensor, ...]:
    """Shard `rank` of a one-sequence pack: (input ids, position ids, next-token labels, real-token mask), each
    (1, ceil(L / size)).

    Labels are shifted before the cut (label j is token j + 1's, IGNORE_INDEX where unscored), so the last position
    of a shard scores the first token of the next; padding to a multiple of `size` is a block of its own (position
    ids from 0), never scored.
    """
    ids, positions, labels, real = packed.input_ids, packed.position_ids, packed.labels, packed.real_tokens()
    if ids.size(0) != 1:
        raise ValueError("sequence parallelism shards one packed sequence at a time (batch 1)")
    length = ids.size(1)
    shifted = torch.cat([labels[:, 1:], labels.new_full((1, 1), IGNORE_INDEX)], dim=1)
    start, end = shard_bounds(length, size, rank)
    padding = shard_bounds(length, size, size - 1)[1] - length
    if padding:
        ids = torch.cat([ids, ids.new_full((1, padding), pad_token_id)], dim=1)
        positions = torch.cat([positions, torch.arange(padding, device=ids.device).unsqueeze(0)], dim=1)
        shifted = torch.cat([shifted, shifted.new_full((1, padding), IGNORE_INDEX)], dim=1)
        real = torch.cat([real, real.new_zeros((1, padding))], dim=1)
    return ids[:, start:end], positions[:, start:end], shifted[:, start:end], real[:, start:end]


def group_pass_rows(members: list[list[int]], rank: int, max_tokens: int) -> list[list[int]]:
    """Process `rank`'s rows in each pass when the rows of all `members` (their token counts, by process) are cut
    into passes of at most `max_tokens` tokens, longest first, a longer row alone (`token_budget_chunks`)."""
    owners = [(member, row) for member, rows in enumerate(members) for row in range(len(rows))]
    chunks = token_budget_chunks([length for rows in members for length in rows], max_tokens)
    return [sorted(owners[i][1] for i in chunk if owners[i][0] == rank) for chunk in chunks]


class SequenceParallel:
    """The group of N processes this process shares its training forwards with, and those forwards."""

    def __init__(self, size: int, model_config: Any, attention: str):
        if not torch_dist.is_initialized():
            raise RuntimeError("sequence_parallel_size > 1 needs a distributed launch (accelerate launch / torchrun)")
        try:
            import deepspeed.comm as ds_comm
            from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
        except ImportError as error:
            raise ImportError(
                "sequence_parallel_size > 1 runs DeepSpeed's Ulysses attention (DeepSpeed >= 0.19): "
                "pip install 'dapo-trl[deepspeed]'"
            ) from error

        ds_comm.init_distributed(dist_backend=torch_dist.get_backend(), auto_mpi_discovery=False)  # wraps torch's
        world, rank = torch_dist.get_world_size(), torch_dist.get_rank()
        self.size, self.rank = size, rank % size
        self.group = None
        for first in range(0, world, size):  # every process creates every group, in the same order
            group = torch_dist.new_group(list(range(first, first + size)))
            if first <= rank < first + size:
                self.group = group
        self.attention = attention
        self.sharded_forwards = 0  # forwards run sharded so far (each shard is one forward on every process)
        text_config = model_config.get_text_config()
        core = segment_causal_attention if attention in SEGMENT_CORE else None
        if core is None:
            from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

            core = ALL_ATTENTION_FUNCTIONS[attention]
        self.ulysses = UlyssesSPAttentionHF(
            attn=core,
            batch_size=1,
            attn_head_count=text_config.num_attention_heads,
            attn_head_size=getattr(text_config, "head_dim", None)
            or text_config.hidden_size // text_config.num_attention_heads,
            kv_head_count=text_config.num_key_value_heads,
            num_hidden_layers=text_config.num_hidden_layers,
            process_group=self.group,
            seq_length_is_variable=True,
            disable_in_eval=False,
        )
        _install_dispatch(attention)
        logger.info(
            "sequence parallelism: groups of %d processes (this one: shard %d), %s attention inside Ulysses",
            size,
            self.rank,
            "row-by-row SDPA" if attention in SEGMENT_CORE else attention,
        )

    @contextlib.contextmanager
    def sharded(self) -> Iterator[dict[str, Any]]:
        """Within the block, the model builds no attention mask; pass the yielded keyword arguments to the model so
        its attention runs through Ulysses (see `_install_dispatch`)."""
        _ACTIVE.add(self.attention)
        try:
            yield {ULYSSES_KWARG: self.ulysses}
        finally:
            _ACTIVE.discard(self.attention)

    # ---------------------------------------------------------------------------------------- collectives
    def gather_sequence(self, local: torch.Tensor) -> torch.Tensor:
        """(1, L/N) per process -> (1, L) everywhere; differentiable (see `_GatherSequence`)."""
        return _GatherSequence.apply(local, self.group, self.rank, self.size)

    def sum_router_load(self, load: RouterLoad) -> RouterLoad:
        """The router load of the whole sequence from each shard's: the auxiliary loss of the unsharded sequence."""
        counts = torch.stack([*load.assignments, load.rows]).detach().clone()
        torch_dist.all_reduce(counts, group=self.group)
        probabilities = _SumOverGroup.apply(load.probabilities, self.group)
        return RouterLoad(counts[:-1], probabilities, counts[-1])

    def gather_rows(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int) -> GroupRows:
        """The group's rows, in rank order, prompts left-padded and completions right-padded to the group's widest."""
        rows, width = input_ids.shape
        shape = torch.tensor([rows, width - logits_to_keep, logits_to_keep], device=input_ids.device)
        shapes = [part.tolist() for part in _all_gather(shape, self.group, self.size)]
        max_rows = max(shape[0] for shape in shapes)
        prompt_width = max(shape[1] for shape in shapes)
        keep = max(shape[2] for shape in shapes)

        # ids and mask as one (2, rows, width) tensor, zero-filled: prompts on the left, completions and rows after
        both = torch.stack([input_ids, attention_mask.to(input_ids.dtype)])
        prompt, completion = both[:, :, : width - logits_to_keep], both[:, :, width - logits_to_keep :]
        left, right = prompt_width - prompt.size(2), keep - completion.size(2)
        aligned = torch.nn.functional.pad(
            torch.cat(
                [prompt.new_zeros(2, rows, left), prompt, completion, completion.new_zeros(2, rows, right)], dim=2
            ),
            (0, 0, 0, max_rows - rows),
        )
        counts = [shape[0] for shape in shapes]
        group = torch.cat(
            [part[:, :count] for part, count in zip(_all_gather(aligned, self.group, self.size), counts, strict=True)],
            dim=1,
        )
        start = sum(counts[: self.rank])
        return GroupRows(
            group[0],
            group[1].to(attention_mask.dtype),
            keep,
            slice(start, start + rows),
            logits_to_keep,
        )

    def group_passes(self, lengths: list[int], budget: int) -> list[list[int]]:
        """Backward passes planned over the group's rows (`StepPlanner`): the group's rows (every process's token
        counts, gathered) cut into passes of at most N x `budget` tokens, a longer row alone; returns this process's
        rows in each pass (empty where it has none: it then runs a masked row). The same plan on every process of
        the group, so each pass's sharded forward holds at most about `budget` tokens per process."""
        members: list[list[int]] = [[] for _ in range(self.size)]
        torch_dist.all_gather_object(members, list(lengths), group=self.group)
        return group_pass_rows(members, self.rank, budget * self.size)

    # -------------------------------------------------------------------------------------------- forwards
    def per_token(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        logits_to_keep: int,
        *,
        shard_forward: ShardForward,
        padded_forward: Callable[[torch.Tensor, torch.Tensor, int], PerTokenOutput],
        max_tokens: int | None,
        max_rows: int | None,
        pad_token_id: int,
        agree_count: Callable[[int], int] | None,
        one_forward: bool,
    ) -> PerTokenOutput:
        """This process's rows' per-token log-probs (and entropies), (rows, logits_to_keep), computed by the group's
        sharded forwards. `max_tokens` / `max_rows` are per process: a group's forward holds N times as many, so
        each process holds about as many tokens as without sequence parallelism. They chunk no-grad forwards only:
        a training pass is one forward, its size planned over the group by `group_passes` (chunking it again would
        run the masked rows of processes without a row in the pass as extra forwards)."""
        group_rows = self.gather_rows(input_ids, attention_mask, logits_to_keep)

        def packed_forward(packed: PackedRows) -> PerTokenOutput:
            length = packed.input_ids.size(1)
            self.sharded_forwards += 1
            ids, positions, labels, real = shard_packed(packed, self.size, self.rank, pad_token_id)
            with self.sharded() as attention_kwargs:
                logps, entropy, load = shard_forward(ids, positions, labels, attention_kwargs, real)
            logps = self.gather_sequence(logps)[:, : length - 1]
            if entropy is not None:
                entropy = self.gather_sequence(entropy)[:, : length - 1]
            return logps, entropy, None if load is None else self.sum_router_load(load)

        if torch.is_grad_enabled():  # a training pass: `group_passes` already bounded it (its masked rows aside)
            max_tokens = max_rows = None
        logps, entropy, aux_loss = padding_free_per_token(
            group_rows.input_ids,
            group_rows.attention_mask,
            group_rows.logits_to_keep,
            packed_forward=packed_forward,
            padded_forward=padded_forward,
            max_tokens=None if max_tokens is None else max_tokens * self.size,
            max_rows=None if max_rows is None else max_rows * self.size,
            one_sequence=True,
            pad_token_id=pad_token_id,
            agree_count=agree_count,
            one_forward=one_forward,
        )
        own, keep = group_rows.own_rows, group_rows.own_keep
        return logps[own, :keep], None if entropy is None else entropy[own, :keep], aux_loss
