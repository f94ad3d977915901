"""The training loss of one forward: DAPOTrainer's `_compute_loss`, built from `dapo_trl.algorithm.losses`.

It keeps every term GRPOTrainer's loss has, in the same order (so `loss_type="dapo"` trains bit for bit as TRL's):
the policy loss from the table's function, TRL's high-entropy and off-policy masks, vLLM's importance weight, the KL
term (`beta`, verl's clamped k3), the aggregation the table names, the entropy bonus (static or TRL's adaptive
controller, whose state TRL checkpoints) and a router's auxiliary loss; then the same metrics, reduced over processes
in one collective.

Under a token budget a micro-batch runs as several backward passes (`batching.StepPlanner.parts`), each carrying its
`PassShare`: every term of a pass is weighted by its share of the micro-batch, so the passes add up to the micro-batch
run whole (policy loss, entropy bonus; the router loss through `algorithm.router_aux.part_of`), and the adaptive
entropy controller steps once per optimizer step, on the last pass of its last micro-batch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from ...algorithm.kl import kl_penalty_per_token
from ...algorithm.losses import (
    Aggregation,
    LossInputs,
    LossSettings,
    aggregate,
    clamped_log_ratio,
    policy_loss,
    ratio_log,
    step_token_share,
)
from ...algorithm.proximal import importance_weight, interpolation_weight, proximal_log_probs
from ...algorithm.rollout_correction import rejection_bounds, rejection_mask
from ...algorithm.router_aux import RouterLoad, part_of, recorded_loads
from .. import trl_seam
from ..sampling.old_logprobs import PROXIMAL_LAG, SCORED_AT
from .batching import FILLER_ROWS, PASS_SHARE, WHOLE_PASS, PassShare


class PolicyLossStep:
    """Computes one micro-batch's (or token-budget pass's) loss for a GRPOTrainer, and appends its metrics."""

    def __init__(self, trainer: Any, forward: Callable[..., tuple]):
        """`forward` is the trainer's `_get_per_token_logps_and_entropies` (padding-free, sequence-parallel)."""
        args = trainer.args
        self.trainer, self.forward = trainer, forward
        self.loss = policy_loss(args.loss_type)
        self.settings = LossSettings.from_config(args)
        self.entropy_bonus = args.entropy_coef != 0.0 or args.use_adaptive_entropy
        self.old_from_engine = args.old_logprobs_source != "trainer"  # pi_old: the engine's log-probs
        self._entropy_window: torch.Tensor | None = None  # adaptive entropy: (entropy sum, tokens) of the step so far
        self._router_whole: RouterLoad | None = None  # the router load of the micro-batch whose passes are running
        self._aux_so_far: torch.Tensor | float = 0.0  # the micro-batch's aux loss over its passes so far (its metric)

    def begin_micro_batch(self, model: Any, parts: list[dict[str, Any]]) -> None:
        """Before a micro-batch's passes: with a router's auxiliary loss built from router loads and several passes,
        measure the whole micro-batch's load with a no-grad forward of each pass, so each pass trains its part of
        the micro-batch's loss (`algorithm.router_aux.part_loss`): the load-balancing loss is not a sum over tokens,
        but linear in the router probabilities once the assignment shares (no gradient) are the micro-batch's.
        Costs one extra forward of the micro-batch; a micro-batch run whole needs none."""
        self._router_whole, self._aux_so_far = None, 0.0
        trainer = self.trainer
        if len(parts) == 1 or not (trainer.aux_loss_enabled and trainer.model.training):
            return
        if not trainer._forwards.router_loads:
            return
        with torch.no_grad(), recorded_loads() as loads:
            for part in parts:
                self._forward(model, part)
        if loads:
            self._router_whole = sum(loads[1:], loads[0])

    def __call__(self, model: Any, inputs: dict[str, Any]) -> torch.Tensor:
        trainer, args = self.trainer, self.trainer.args
        training = trainer.model.training
        part: PassShare = inputs.get(PASS_SHARE, WHOLE_PASS)  # this pass's share of its micro-batch, per term
        mask = inputs["completion_mask"]
        mask = mask if "tool_mask" not in inputs else mask * inputs["tool_mask"]  # tool replies are not the model's
        with part_of(self._router_whole):  # several passes: each trains its part of the micro-batch's router loss
            logps, entropies, aux_loss = self._forward(model, inputs)
        advantages = inputs["advantages"]
        advantages = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
        old = inputs.get("old_per_token_logps")
        old = logps.detach() if old is None else old
        corrected = trainer.use_vllm and trainer.vllm_importance_sampling_correction
        sampling_ratio = inputs.get("importance_sampling_ratio") if corrected else None
        engine_terms: dict[str, torch.Tensor] = {}
        if self.old_from_engine and training and "sampling_per_token_logps" in inputs:
            old, sampling_ratio, engine_terms = self._old_from_engine(logps, old, sampling_ratio, inputs, mask)

        log_ratio = ratio_log(clamped_log_ratio(logps, old), mask, self.settings.ratio_level)
        terms = self.loss.function(LossInputs(logps, log_ratio, advantages, mask, sampling_ratio), self.settings)
        per_token = terms.per_token
        if args.off_policy_mask_threshold is not None:  # DeepSeek-V3.2's sequence mask, against the sampler's log-probs
            sampler_logps = inputs.get("sampling_per_token_logps", old)
            per_token = per_token * trainer.get_off_policy_mask(
                advantages, logps, sampler_logps, mask, args.off_policy_mask_threshold
            )
        rejected: dict[str, torch.Tensor] = {}
        if args.rollout_rejection is not None:  # verl's rollout_rs: tokens whose pi_old / pi_rollout leaves the band
            kept = self._rollout_kept(logps, old, inputs, mask, training)
            if kept is not None:
                per_token = per_token * kept
                rejected["sampling/rollout_rejected_fraction"] = 1.0 - kept
        entropy_mask = None
        if trainer.top_entropy_quantile < 1.0:
            entropy_mask = trainer.get_high_entropy_mask(entropies, mask, 1 - trainer.top_entropy_quantile)
            per_token = per_token * entropy_mask
        if sampling_ratio is not None and not self.loss.corrects_sampling:
            per_token = per_token * sampling_ratio
        if trainer.beta != 0.0:
            per_token_kl = kl_penalty_per_token(logps, inputs["ref_per_token_logps"], "k3")
            if args.use_bias_correction_kl:
                per_token_kl = per_token_kl * torch.exp(log_ratio)
            per_token = per_token + trainer.beta * per_token_kl

        accumulation = trainer.current_gradient_accumulation_steps if training else 1
        if self.loss.aggregation is Aggregation.STEP_TOKENS:
            share = step_token_share(
                inputs["num_items_in_batch"],
                trainer.accelerator.num_processes,
                accumulation,
                args.steps_per_generation,
                training,
            )
            loss = aggregate(per_token, mask, self.loss.aggregation, step_tokens=share)
            policy_term = loss.detach()
        else:
            length = trainer.max_completion_length
            loss = aggregate(per_token, mask, self.loss.aggregation, max_completion_length=length)
            policy_term = loss.detach()
            loss = loss / accumulation
        loss = loss * part.policy
        metrics = trl_seam.metrics(trainer, "train" if training else "eval")
        if self.entropy_bonus:
            effective_mask = mask if entropy_mask is None else mask * entropy_mask
            loss = loss - self._entropy_term(entropies, effective_mask, accumulation, training, part, metrics)
        if trainer.aux_loss_enabled:  # a mixture-of-experts router's load-balancing loss
            loss = loss + trainer.router_aux_loss_coef * self._aux_term(aux_loss, part, metrics) / accumulation
        metrics["policy_loss"].append(trainer.accelerator.gather(policy_term).nanmean().item())

        means = {"entropy": entropies, **({"kl": per_token_kl} if trainer.beta != 0.0 else {}), **terms.diagnostics}
        means.update(engine_terms)
        means.update(rejected)
        self._log_means(means, mask, metrics)
        self._log_extremes(terms.diagnostics, mask, metrics)
        return loss

    def _rollout_kept(self, logps, old, inputs, mask, training: bool) -> torch.Tensor | None:
        """verl's rollout rejection (`algorithm.rollout_correction`): (N, T) 1 for a kept token, 0 for a rejected one,
        from log(pi_old / pi_rollout) against the engine's sampling log-probs. With old_logprobs_source='engine'
        (verl's bypass mode) pi_old is the engine's own, so pi_theta (no gradient) stands in for it, as verl's bypass
        mode tests pi_theta / pi_rollout. None for an evaluation batch without the engine's log-probs."""
        args = self.trainer.args
        sampling = inputs.get("sampling_per_token_logps")
        if sampling is None:
            if not training:
                return None
            raise RuntimeError(
                f"rollout_rejection={args.rollout_rejection!r} needs the engine's sampling log-probs, and this batch "
                "has none: generate with vLLM (use_vllm true) or a streaming engine that returns log-probs, or unset "
                "rollout_rejection."
            )
        reference = logps.detach() if args.old_logprobs_source == "engine" else old
        lower, upper = rejection_bounds(args.rollout_rejection_upper, args.rollout_rejection_lower)
        return rejection_mask(reference - sampling, mask, args.rollout_rejection, lower, upper)

    def _old_from_engine(
        self, logps: torch.Tensor, engine: torch.Tensor, sampling_ratio: torch.Tensor | None, inputs, mask
    ) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, torch.Tensor]]:
        """pi_old from the engine's log-probs (`old_logprobs_source`, `algorithm.proximal`): `engine` as it is (a
        token the engine sent no log-prob for gets pi_theta's: ratio 1); `interpolated` moved toward pi_theta by
        each token's lag behind pi_old, with the importance weight pi_old / pi_engine recomputed to match. Also the
        per-token figures the scoring pass no longer measures: |log pi_theta - log pi_engine|, and alpha."""
        trainer, args = self.trainer, self.trainer.args
        current = logps.detach()
        engine = torch.where(torch.isnan(engine), current, engine)
        terms = {"sampling/sampling_logp_difference/mean": (current - engine).abs()}
        lag = inputs.get(PROXIMAL_LAG)
        if lag is None:
            return engine, sampling_ratio, terms
        since = (trainer.state.global_step - inputs[SCORED_AT].float()).unsqueeze(1)
        weight = interpolation_weight(lag, since)
        old = proximal_log_probs(engine, current, weight)
        terms["sampling/proximal_weight/mean"] = weight
        if sampling_ratio is not None:
            mode, low, high = (
                args.vllm_importance_sampling_mode,
                args.vllm_importance_sampling_clip_min,
                args.vllm_importance_sampling_clip_max,
            )
            sampling_ratio = importance_weight(old - engine, mask, mode, low, high)
            terms["sampling/importance_sampling_ratio/mean"] = sampling_ratio
        return old, sampling_ratio, terms

    def _forward(self, model: Any, inputs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, Any]:
        prompt_ids, completion_ids = inputs["prompt_ids"], inputs["completion_ids"]
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        fillers = inputs.get(FILLER_ROWS)
        if self.trainer.aux_loss_enabled and fillers is not None and fillers.any():  # no router counts their token
            input_ids = self.trainer._forwards.unrouted(input_ids, attention_mask, fillers)
        multimodal = {name: inputs.get(name) for name in trl_seam.MULTIMODAL_INPUTS}
        flags = {"compute_entropy": True, "compute_aux_loss": self.trainer.aux_loss_enabled}
        replayed = self.trainer._replayed_routing  # routing replay: the rows carry the engine's routing
        with contextlib.nullcontext() if replayed is None or not model.training else replayed.batch(inputs):
            return self.forward(model, input_ids, attention_mask, completion_ids.size(1), **flags, **multimodal)

    def _aux_term(self, aux_loss: torch.Tensor, share: PassShare, metrics) -> torch.Tensor:
        """This pass's part of the micro-batch's router loss: already its part when the micro-batch's load was
        measured (`begin_micro_batch`), else the pass's own loss weighted by its share of the fed tokens (exact for a
        micro-batch run whole). The micro-batch's loss is logged once, on its last pass."""
        term = aux_loss if self._router_whole is not None else aux_loss * share.fed_tokens
        self._aux_so_far = self._aux_so_far + term.detach()
        if share.last:
            metrics["aux_loss"].append(self.trainer.accelerator.gather_for_metrics(self._aux_so_far).mean().item())
            self._router_whole, self._aux_so_far = None, 0.0
        return term

    def _entropy_term(
        self, entropies, mask, accumulation: int, training: bool, share: PassShare, metrics
    ) -> torch.Tensor:
        """coef x the mean entropy of the micro-batch's loss tokens (the bonus subtracted from the loss): a pass's
        mean weighs its share of them. TRL's adaptive controller uses the coefficient of the step before and moves it
        by entropy_coef_delta toward entropy_target once per optimizer step (the last pass of its last micro-batch),
        from the step's exact mean entropy (all micro-batches and passes, all processes)."""
        trainer, args = self.trainer, self.trainer.args
        entropy_sum, tokens = (entropies * mask).sum(), mask.sum()
        mean_entropy = entropy_sum / tokens.clamp(min=1.0) / accumulation * share.loss_tokens
        coef = trainer.entropy_coef
        if args.use_adaptive_entropy:
            coef = coef if trl_seam.last_world_entropy(trainer) <= args.entropy_target else 0.0
            if training:
                stats = torch.stack([entropy_sum, tokens]).detach()
                self._entropy_window = stats if self._entropy_window is None else self._entropy_window + stats
                if trainer.accelerator.sync_gradients and share.last:
                    total = trainer.accelerator.reduce(self._entropy_window, reduction="sum")
                    world_entropy = (total[0] / total[1].clamp(min=1.0)).item()
                    step = args.entropy_coef_delta if world_entropy <= args.entropy_target else -args.entropy_coef_delta
                    trainer.entropy_coef = min(
                        max(trainer.entropy_coef + step, args.entropy_coef_min), args.entropy_coef_max
                    )
                    trl_seam.set_last_world_entropy(trainer, world_entropy)
                    self._entropy_window = None
        if training and trainer.accelerator.sync_gradients and share.last:
            metrics["entropy_coef"].append(trainer.entropy_coef)
        return coef * mean_entropy

    def _log_means(self, values: dict[str, torch.Tensor], mask: torch.Tensor, metrics) -> None:
        """Each value's mean over this forward's loss tokens on every process (per-row values: over rows)."""
        sums = []
        for value in values.values():
            if value.size(1) == 1:
                sums += [value.sum(), torch.tensor(float(value.size(0)), device=value.device)]
            else:
                sums += [(value * mask).sum(), mask.sum().float()]
        totals = self.trainer.accelerator.reduce(torch.stack(sums).detach(), reduction="sum").view(-1, 2)
        for name, (total, count) in zip(values, totals.tolist(), strict=True):
            metrics[name].append(total / max(count, 1.0))

    def _log_extremes(self, diagnostics: dict[str, torch.Tensor], mask: torch.Tensor, metrics) -> None:
        """The table's per-sequence extremes (e.g. the lowest share of low-clipped tokens of any row), every
        process's rows in one gather."""
        if not self.loss.extremes:
            return
        per_row = []
        for source, _ in self.loss.extremes.values():
            value = diagnostics[source]
            per_row.append(value.squeeze(1) if value.size(1) == 1 else (value * mask).sum(-1) / mask.sum(-1))
        gathered = self.trainer.accelerator.gather(torch.stack(per_row, dim=1).detach())  # (rows, extremes)
        for column, (name, (_, kind)) in zip(gathered.unbind(1), self.loss.extremes.items(), strict=True):
            column = column[~torch.isnan(column)]
            metrics[name].append(float("nan") if column.numel() == 0 else getattr(column, kind)().item())
