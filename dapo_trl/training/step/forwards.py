"""Every training-phase forward of DAPOTrainer (old, reference and policy log-probs): TRL's padded forward, or,
with `padding_free`, real tokens only (rows packed into sequences, `training.step.packing`), sharded across a
sequence-parallel group when there is one (`training.step.sequence_parallel`), under the token budget.

For a mixture-of-experts policy, packed forwards collect the router logits through hooks (`moe.routing_replay.
RouterHooks`) and compute the router's auxiliary loss from additive router loads over real tokens only
(`algorithm.router_aux`): the same loss however the rows are chunked or sharded. The planner's filler rows are fed as
a token the loads skip (`TokenForwards.unrouted`, `router_counted`), so they add nothing to it. With routing replay,
a forward's routing rides with its rows into the packs."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from ...algorithm.router_aux import RouterLoad, router_load
from ...moe.architecture import is_moe
from ...moe.routing_replay import ROUTING_KWARG, RouterHooks
from .packing import forward_count_agreement, one_forward_per_backward, packing_mode, padding_free_per_token
from .sequence_parallel import SequenceParallel, check_sequence_parallel

if TYPE_CHECKING:
    from ...config import DAPOConfig


def router_counted(
    real: torch.Tensor, input_ids: torch.Tensor, position_ids: torch.Tensor, pad_token_id: int
) -> torch.Tensor:
    """The tokens a router load counts: the real ones, less a row's first token when it is the pad token. No row of
    the data starts with it (left padding is not fed); a filler row (`batching.masked_rows`, rows that only keep
    processes in step) is fed as one (`TokenForwards.unrouted`), so a micro-batch whose passes carry fillers has the
    router loss of the micro-batch itself. The rule holds for every forward, split or not, sharded or not."""
    return real & ~((input_ids == pad_token_id) & (position_ids == 0))


# TRL's own `_get_per_token_logps_and_entropies` bound to a model: (input_ids, attention_mask, logits_to_keep,
# batch_size=None, **flags and multimodal inputs) -> (log-probs, entropies, aux loss).
TRLForward = Callable[..., tuple]


class TokenForwards:
    """How this run's forwards are fed, decided once: packed or padded, sharded or whole, agreed across processes."""

    def __init__(self, args: DAPOConfig, accelerator: Any, model: Any, pad_token_id: int, router_aux_loss: bool):
        self.args, self.accelerator, self.pad_token_id = args, accelerator, pad_token_id
        self.packing = packing_mode(model) if args.padding_free else None  # said once in the log
        self.agree_count = forward_count_agreement(accelerator)  # ZeRO-3 / FSDP forwards run in lockstep
        moe = is_moe(model)
        # ZeRO-3 with reentrant checkpointing or MoE blocks as leaf modules: one forward per backward
        self.one_forward = one_forward_per_backward(accelerator, args, leaf_modules=moe)
        hooked = moe and args.padding_free and (router_aux_loss or args.routing_replay)
        self.router_hooks = RouterHooks(model) if hooked else None
        self.sequence_parallel = None
        if args.sequence_parallel_size > 1:
            size, config = args.sequence_parallel_size, model.config
            processes, distributed = accelerator.num_processes, str(accelerator.distributed_type)
            attention = check_sequence_parallel(size, config, processes, distributed)
            if router_aux_loss and self.router_hooks is None:
                raise ValueError(
                    f"sequence_parallel_size > 1 computes a router's auxiliary loss only for the mixture-of-experts "
                    f"models transformers marks (router logits recorded): {type(model).__name__} is not one; set "
                    "router_aux_loss_coef=0 (or output_router_logits=false)."
                )
            self.sequence_parallel = SequenceParallel(size, config, attention)

    @contextlib.contextmanager
    def _router_logits(self, collect: bool) -> Iterator[list[torch.Tensor]]:
        """Within the block, the router logits of the policy's forward are collected (a MoE policy's aux loss)."""
        if not collect:
            yield []
            return
        hooks = self.router_hooks
        hooks.collect, hooks.collected = True, []
        try:
            yield hooks.collected
        finally:
            hooks.collect = False

    def _router_load(
        self, logits: list[torch.Tensor], real: torch.Tensor, input_ids: torch.Tensor, position_ids: torch.Tensor
    ) -> RouterLoad | None:
        if not logits:  # not the policy (a reference model without hooks): no auxiliary loss asked of it
            return None
        counted = router_counted(real, input_ids, position_ids, self.pad_token_id)
        return router_load(logits, self.router_hooks.routing.top_k, counted)

    def unrouted(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """`input_ids` with `rows`' fed tokens (filler rows feed one) made the pad token, which no router load counts
        at a row's start (`router_counted`)."""
        return input_ids.masked_fill(rows[:, None] & attention_mask.bool(), self.pad_token_id)

    @property
    def router_loads(self) -> bool:
        """Whether the policy's router loss is built from additive router loads (hooked packed or sharded forwards;
        multimodal inputs aside), so a micro-batch split into passes can train each its part of it exactly."""
        return self.router_hooks is not None and (self.packing is not None or self.sequence_parallel is not None)

    @property
    def group_passes(self) -> Any:
        """With sequence parallelism, how the group plans its token-budget passes (`StepPlanner`); else None."""
        return None if self.sequence_parallel is None else self.sequence_parallel.group_passes

    def per_token(
        self,
        model: Any,
        trl_forward: TRLForward,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        logits_to_keep: int,
        batch_size: int | None,
        flags: dict[str, bool],
        multimodal: dict[str, Any],
        routing: torch.Tensor | None = None,
    ) -> tuple:
        """TRL's forward, fed real tokens only when `padding_free` is on (sharded across the sequence-parallel group
        when there is one). `flags` are TRL's compute_entropy / compute_aux_loss; `routing` a replayed routing
        (rows, width, layers, top-k) aligned with `input_ids`."""

        def padded_forward(ids: torch.Tensor, mask: torch.Tensor, keep: int):
            return trl_forward(ids, mask, keep, **flags)

        if self.sequence_parallel is not None:
            sharded = (input_ids, attention_mask, logits_to_keep, batch_size, flags, multimodal, padded_forward)
            return self._sharded(model, *sharded)
        if not self.args.padding_free or any(value is not None for value in multimodal.values()):
            return trl_forward(input_ids, attention_mask, logits_to_keep, batch_size, **flags, **multimodal)

        def packed_forward(packed):
            entropy, aux = flags["compute_entropy"], flags["compute_aux_loss"]
            hooked = aux and self.router_hooks is not None  # the aux loss from router loads (exact, real tokens)
            extra = {"output_router_logits": True} if aux and not hooked else {}
            if packed.routing is not None:
                extra[ROUTING_KWARG] = packed.routing
            with self.accelerator.autocast(), self._router_logits(hooked) as router_logits:
                out = model(
                    input_ids=packed.input_ids,
                    position_ids=packed.position_ids,
                    labels=packed.labels,
                    fused_lm_head=True,
                    **extra,
                )
            entropies = out.entropy if entropy else None
            if hooked:
                load = self._router_load(router_logits, packed.real_tokens(), packed.input_ids, packed.position_ids)
                return out.log_probs, entropies, load
            return out.log_probs, entropies, out.aux_loss if aux else None

        return padding_free_per_token(
            input_ids,
            attention_mask,
            logits_to_keep,
            packed_forward=packed_forward if self.packing else None,
            padded_forward=padded_forward,
            max_tokens=self.args.max_tokens_per_microbatch,
            max_rows=batch_size,
            one_sequence=self.packing == "sequence",
            pad_token_id=self.pad_token_id,
            agree_count=self.agree_count,
            one_forward=self.one_forward and torch.is_grad_enabled(),
            routing=routing,
        )

    def _sharded(self, model, input_ids, attention_mask, logits_to_keep, batch_size, flags, multimodal, padded_forward):
        """The group's rows packed, each packed sequence sharded across the group
        (`training.step.sequence_parallel`)."""
        if any(value is not None for value in multimodal.values()):
            raise ValueError("sequence_parallel_size > 1 runs text-only models: image inputs cannot be sharded.")
        attention = getattr(self.accelerator.unwrap_model(model).config, "_attn_implementation", None)
        if attention != self.sequence_parallel.attention:
            raise ValueError(
                f"sequence parallelism was set up for {self.sequence_parallel.attention} attention, but a forward "
                f"runs a model with {attention!r}: load the reference model with the policy's attn_implementation."
            )

        aux = flags["compute_aux_loss"]

        def shard_forward(ids: torch.Tensor, positions: torch.Tensor, labels: torch.Tensor, attention: dict, real):
            with self.accelerator.autocast(), self._router_logits(aux) as router_logits:
                out = model(input_ids=ids, position_ids=positions, shift_labels=labels, fused_lm_head=True, **attention)
            load = self._router_load(router_logits, real, ids, positions) if aux else None
            return out.log_probs, out.entropy if flags["compute_entropy"] else None, load

        return self.sequence_parallel.per_token(
            input_ids,
            attention_mask,
            logits_to_keep,
            shard_forward=shard_forward,
            padded_forward=padded_forward,
            max_tokens=self.args.max_tokens_per_microbatch,
            max_rows=batch_size,
            pad_token_id=self.pad_token_id,
            agree_count=self.agree_count,
            one_forward=self.one_forward and torch.is_grad_enabled(),
        )
