"""Independent references for the policy losses, written from the papers and verl's formulas (core_algos's
`compute_policy_loss_*` and `agg_loss`), in plain tensor code that shares nothing with `dapo_trl.algorithm.losses`.

Every function takes (N, T) log-probs and a (N, T) float mask; advantages are (N,) (one per response, as verl's
GRPO advantages are, broadcast over the tokens).
"""

from __future__ import annotations

import torch


def log_ratio(logps: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    return torch.clamp(logps - old, min=-20.0, max=20.0)


def verl_vanilla(logps, old, advantages, low: float, high: float, clip_ratio_c: float | None) -> torch.Tensor:
    """verl's `vanilla` PPO loss per token (DAPO Eq. 10 with clip-higher) and its dual-clip: for A < 0 the clipped
    loss is capped at -A c."""
    ratio, a = torch.exp(log_ratio(logps, old)), advantages[:, None]
    unclipped, clipped = -a * ratio, -a * torch.clamp(ratio, 1.0 - low, 1.0 + high)
    pessimistic = torch.maximum(unclipped, clipped)
    if clip_ratio_c is None:
        return pessimistic
    return torch.where(a < 0, torch.minimum(-a * clip_ratio_c, pessimistic), pessimistic)


def verl_gspo(logps, old, advantages, mask, low: float, high: float) -> torch.Tensor:
    """verl's GSPO (`loss_mode=gspo`, Zheng et al. 2025, GSPO-token form) per token: s_i,t = exp(sg[mean_t log
    ratio] + log pi_t - sg[log pi_t]) (log capped at 10), clipped to [1 - low, 1 + high]."""
    sequence = ((logps - old) * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    log_s = torch.clamp(logps - logps.detach() + sequence.detach()[:, None], max=10.0)
    s, a = torch.exp(log_s), advantages[:, None]
    return torch.maximum(-a * s, -a * torch.clamp(s, 1 - low, 1 + high))


def verl_geo_mean(logps, old, advantages, mask, low: float, high: float, rollout_weights=None) -> torch.Tensor:
    """verl's GMPO (`loss_mode=geo_mean`, Zhao et al. 2025) per sequence (N,): -A exp(mean_t of the token log-ratio,
    clipped in log space to [-low, high] on the pessimistic side for the advantage's sign); rollout importance
    weights enter as their geometric mean over the sequence."""
    x, a = logps - old, advantages[:, None].expand_as(logps)
    sign = torch.sign(a)
    x_min = sign * torch.min(sign * x, sign * torch.clamp(x, -low, high))
    length = mask.sum(-1)
    ratio = torch.exp((x_min * mask).sum(-1) / (length + 1e-8))
    per_sequence = -((a * mask).sum(-1) / (length + 1e-8)) * ratio
    if rollout_weights is not None:
        per_sequence = per_sequence * torch.exp((torch.log(rollout_weights + 1e-10) * mask).sum(-1) / (length + 1e-8))
    return per_sequence


def verl_sapo(logps, old, advantages, tau_pos: float, tau_neg: float) -> torch.Tensor:
    """verl's SAPO (Gao et al. 2025) per token: -A sigmoid(tau (r - 1)) 4 / tau, tau by the advantage's sign."""
    ratio, a = torch.exp(log_ratio(logps, old)), advantages[:, None]
    tau = torch.where(a > 0, torch.full_like(a, tau_pos), torch.full_like(a, tau_neg))
    return -a * torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)


def trl_cispo(logps, old, advantages, cap: float) -> torch.Tensor:
    """CISPO as TRL 1.16 defines it (MiniMax-M1): -sg[min(r, cap)] A log pi per token."""
    weight = torch.clamp(torch.exp(log_ratio(logps, old)), max=cap).detach()
    return -weight * advantages[:, None] * logps


# verl's agg_loss modes (and TRL's names for them), on a batch whose every row has a loss token.
def token_mean(per_token, mask) -> torch.Tensor:
    return (per_token * mask).sum() / mask.sum()


def seq_mean_token_mean(per_token, mask) -> torch.Tensor:
    return ((per_token * mask).sum(-1) / mask.sum(-1)).mean()


def seq_mean_token_sum(per_token, mask) -> torch.Tensor:
    return (per_token * mask).sum(-1).mean()


def seq_mean_token_sum_norm(per_token, mask, max_length: int) -> torch.Tensor:
    return (per_token * mask).sum(-1).sum() / max_length / per_token.size(0)
