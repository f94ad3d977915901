"""DAPO's math as pure tensor functions: no trainer state, each one testable against the paper's formula.

Shapes use N = number of completions, G = completions per prompt (a group), S = micro-batches per generation
batch (`steps_per_generation`), K = micro-batches per optimizer step (`gradient_accumulation_steps`), T = completion
tokens.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

# verl clamps log(pi / pi_old) to [-20, 20] before exp (core_algos.compute_policy_loss_vanilla): one stale token can
# then cost at most exp(20) * |A| (5e8), not an overflow to inf, or NaN once multiplied by a zero advantage.
LOG_RATIO_BOUND = 20.0
# TRL loss types whose policy term sees the current log-probs only through the ratio exp(log pi - log pi_old), so
# clamping the log-probs is clamping the ratio. cispo and vespo also use log pi directly (and bound their weights).
RATIO_LOSS_TYPES = ("dapo", "grpo", "dr_grpo", "bnpo", "luspo", "sapo")


def soft_overlong_penalty(
    completion_lengths: torch.Tensor, max_completion_length: int, overlong_buffer_len: int
) -> torch.Tensor:
    """Soft overlong punishment, paper Eq. 13, before `overlong_penalty_factor`.

    With L_max = max_completion_length, L_cache = overlong_buffer_len and |y| the completion length:
    0 if |y| <= L_max - L_cache; ((L_max - L_cache) - |y|) / L_cache in between; -1 if |y| > L_max.

    Args:
        completion_lengths: (N,) number of completion tokens per response.
    Returns:
        (N,) float penalties in [-1, 0].
    """
    if overlong_buffer_len <= 0 or overlong_buffer_len > max_completion_length:
        raise ValueError(
            f"overlong_buffer_len={overlong_buffer_len} must be in [1, max_completion_length={max_completion_length}]"
        )
    lengths = completion_lengths.to(torch.float64)
    expected_len = max_completion_length - overlong_buffer_len
    linear = (expected_len - lengths) / overlong_buffer_len
    penalty = torch.where(lengths <= expected_len, torch.zeros_like(lengths), linear)
    penalty = torch.where(lengths > max_completion_length, torch.full_like(lengths, -1.0), penalty)
    return penalty.to(torch.float32)


def trl_items_for_exact_normalizer(
    window_tokens: torch.Tensor, steps_per_generation: int, gradient_accumulation_steps: int
) -> torch.Tensor:
    """The `num_items_in_batch` that makes TRL's "dapo" normaliser equal the optimizer step's exact token count.

    TRL divides each process's summed micro-batch loss by num_items * K / (S * P), and DDP then averages the P
    gradients, so the optimizer step sees sum(loss over the step) * S / (num_items * K). Choosing
    num_items = window_tokens * S / K makes that sum(loss over the step) / window_tokens: paper Eq. 11's
    1 / sum_i |o_i| over the whole step, whatever P, K and S are (P cancels out).
    """
    return window_tokens.to(torch.float32) * steps_per_generation / gradient_accumulation_steps


def group_keep_mask(accuracy: torch.Tensor, num_generations: int, atol: float = 1e-6) -> torch.Tensor:
    """Dynamic sampling's filter (paper Eq. 11 constraint 0 < |{o_i correct}| < G): groups whose accuracy varies.

    A group whose accuracy is all-correct or all-wrong has zero advantage everywhere and no gradient. The spread
    is compared with a tolerance so float noise in a constant group does not keep it. NaN (unscorable) entries
    are ignored; a group with fewer than two scored responses is dropped.

    Args:
        accuracy: (N,) raw accuracy reward per response, N = num_groups * G, group members contiguous.
    Returns:
        (num_groups,) bool, True where the group is kept.
    """
    if accuracy.numel() % num_generations != 0:
        raise ValueError(f"{accuracy.numel()} rewards do not split into groups of {num_generations}")
    groups = accuracy.reshape(-1, num_generations).to(torch.float64)
    scored = ~torch.isnan(groups)
    highest = torch.where(scored, groups, torch.full_like(groups, -torch.inf)).amax(dim=1)
    lowest = torch.where(scored, groups, torch.full_like(groups, torch.inf)).amin(dim=1)
    return (scored.sum(dim=1) >= 2) & (highest - lowest > atol)


def concat_padded(tensors: list[torch.Tensor], pad_value: float, pad_left: bool) -> torch.Tensor:
    """Concatenate (rows, width_k) tensors along rows, padding each to the widest on the left or the right."""
    if tensors[0].dim() == 1:
        return torch.cat(tensors)
    width = max(t.size(1) for t in tensors)
    padded = []
    for tensor in tensors:
        missing = width - tensor.size(1)
        if missing:
            filler = tensor.new_full((tensor.size(0), missing), pad_value)
            tensor = torch.cat([filler, tensor] if pad_left else [tensor, filler], dim=1)
        padded.append(tensor)
    return torch.cat(padded)


def assemble_batch(
    parts: list[dict[str, torch.Tensor]], target_rows: int, padding: dict[str, tuple[float, bool]]
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor] | None]:
    """Concatenate kept groups in arrival order, cut to exactly `target_rows` rows, return (batch, surplus).

    `padding[key] = (pad_value, pad_left)` says how to widen each 2-D tensor. `target_rows` must be a whole number
    of groups, so the cut always falls on a group boundary; surplus is None when nothing is left over.
    """
    keys = parts[0].keys()
    merged = {key: concat_padded([part[key] for part in parts], *padding.get(key, (0, False))) for key in keys}
    total_rows = next(iter(merged.values())).size(0)
    if total_rows < target_rows:
        raise ValueError(f"only {total_rows} rows to assemble a batch of {target_rows}")
    batch = {key: value[:target_rows] for key, value in merged.items()}
    surplus = {key: value[target_rows:] for key, value in merged.items()} if total_rows > target_rows else None
    return batch, surplus


def clamp_log_ratio(
    per_token_logps: torch.Tensor, old_per_token_logps: torch.Tensor, bound: float = LOG_RATIO_BOUND
) -> torch.Tensor:
    """The current log-probs, with their log-ratio to the old ones clamped to [-bound, bound] (verl's clamp).

    Where |log pi - log pi_old| <= bound (or is NaN) the log-probs are returned as they are, values and gradient.
    Elsewhere they become the constant log pi_old +- bound, so a loss computing exp(log pi - log pi_old) sees
    exp(+-bound) with no gradient through the ratio, exactly as with verl's torch.clamp(log_ratio, -20, 20).

    Args:
        per_token_logps, old_per_token_logps: (N, T) log-probabilities under the current and the old policy.
    Returns:
        (N, T) in the dtype of per_token_logps.
    """
    old = old_per_token_logps.detach()
    log_ratio = per_token_logps.detach() - old
    clamped = (old + log_ratio.clamp(-bound, bound)).to(per_token_logps.dtype)
    return torch.where(log_ratio.abs() > bound, clamped, per_token_logps)


def dapo_token_loss(
    per_token_logps: torch.Tensor,
    old_per_token_logps: torch.Tensor,
    advantages: torch.Tensor,
    epsilon_low: float,
    epsilon_high: float,
    clip_ratio_c: float | None = None,
    log_ratio_bound: float = LOG_RATIO_BOUND,
) -> torch.Tensor:
    """DAPO's per-token policy loss: paper Eq. 10 with clip-higher, verl's dual-clip and its log-ratio clamp.

    r = exp(clamp(log pi - log pi_old, -bound, bound)); loss = -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A);
    where A < 0 and `clip_ratio_c` is set, the loss is capped at -A c (dual-clip, verl's `clip_ratio_c`).

    Args:
        per_token_logps, old_per_token_logps: (N, T) log-probabilities of the sampled tokens (at the sampling
            temperature) under the current and the behaviour policy.
        advantages: (N,) one advantage per response, shared by its tokens.
    Returns:
        (N, T) per-token losses; padding positions hold whatever the inputs give there (mask them).
    """
    log_ratio = (per_token_logps - old_per_token_logps).clamp(-log_ratio_bound, log_ratio_bound)
    ratio, advantage = torch.exp(log_ratio), advantages[:, None]
    clipped = torch.clamp(ratio, 1.0 - epsilon_low, 1.0 + epsilon_high)
    loss = -torch.minimum(ratio * advantage, clipped * advantage)
    if clip_ratio_c is not None:
        loss = torch.where(advantage < 0, torch.minimum(loss, -advantage * clip_ratio_c), loss)
    return loss


def dapo_objective(
    per_token_loss: torch.Tensor, completion_mask: torch.Tensor, num_loss_tokens: torch.Tensor | float | None = None
) -> torch.Tensor:
    """Paper Eq. 11's token-level normalisation: the sum of the losses of every loss token, divided by the number of
    loss tokens of the whole optimizer step (`num_loss_tokens`, over all its micro-batches and processes; default
    the tokens of this batch). One micro-batch's share of a step's loss is this with the step's count.
    """
    mask = completion_mask.to(per_token_loss.dtype)
    total = mask.sum() if num_loss_tokens is None else num_loss_tokens
    return (per_token_loss * mask).sum() / total


# verl's KL estimators for the reward penalty (core_algos.kl_penalty_forward), by name and alias. The '+' variants
# (k3+ ...) differ from these in their gradient only, and the reward penalty carries none: callers strip the '+'.
KL_ESTIMATORS = {"kl": "k1", "k1": "k1", "abs": "abs", "mse": "k2", "k2": "k2", "low_var_kl": "k3", "k3": "k3"}
# verl's k3 clamps: the log-ratio to [-20, 20] before exp, the estimate to [-10, 10].
K3_LOG_RATIO_BOUND, K3_ESTIMATE_BOUND = 20.0, 10.0


def kl_penalty_per_token(logps: torch.Tensor, ref_logps: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from the sampled tokens' log-probs (Schulman, "Approximating KL").

    With log r = log pi_ref - log pi: k1 ("kl") = -log r; "abs" = |log r|; k2 ("mse") = (log r)^2 / 2;
    k3 ("low_var_kl") = r - log r - 1, with verl's clamps (log r to [-20, 20], the estimate to [-10, 10]).

    Args:
        logps, ref_logps: (N, T) log-probabilities of the sampled tokens under the policy and the reference.
    Returns:
        (N, T) estimates (padding positions are whatever the inputs hold there: mask them).
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {estimator!r}: choose one of {sorted(KL_ESTIMATORS)}")
    kind, log_ratio = KL_ESTIMATORS[estimator], ref_logps - logps
    if kind == "k1":
        return -log_ratio
    if kind == "abs":
        return log_ratio.abs()
    if kind == "k2":
        return 0.5 * log_ratio.square()
    log_ratio = log_ratio.clamp(-K3_LOG_RATIO_BOUND, K3_LOG_RATIO_BOUND)
    return (log_ratio.exp() - log_ratio - 1).clamp(-K3_ESTIMATE_BOUND, K3_ESTIMATE_BOUND)


def adaptive_kl_coef(coef: float, current_kl: float, target_kl: float, horizon: int, num_responses: int) -> float:
    """The next KL coefficient of the adaptive controller (Ziegler et al. 2019, as verl's AdaptiveKLController).

    beta <- beta * (1 + clip(KL / KL_target - 1, -0.2, 0.2) * n / horizon), with n the responses the KL was measured
    on: the coefficient grows while the measured KL is above target and shrinks below it, by at most 20% per horizon.
    """
    error = min(max(current_kl / target_kl - 1.0, -0.2), 0.2)
    return coef * (1.0 + error * num_responses / horizon)


def ratio_anchor(loss_type: str, inputs: Mapping[str, Any]) -> torch.Tensor | None:
    """The old log-probs a loss forward's log-probs are clamped against (`clamp_log_ratio`), or None.

    TRL's GRPOTrainer computes `exp(per_token_logps - old_per_token_logps)` unclamped inside `_compute_loss`; the
    trainer clamps what its one forward there returns. Nothing to clamp without old log-probs (the ratio is then 1)
    or for loss types outside RATIO_LOSS_TYPES.
    """
    return inputs.get("old_per_token_logps") if loss_type in RATIO_LOSS_TYPES else None
