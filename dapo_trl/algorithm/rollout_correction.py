"""Rollout rejection: the loss tokens dropped because the trainer's pi_old and the engine that sampled them disagree.

verl's rollout correction (`algorithm.rollout_correction`, docs/algo/rollout_corr_math.md) has two parts: an
importance weight pi_old / pi_rollout multiplied into the loss (`rollout_is`; TRL's `vllm_importance_sampling_*`
computes the same truncated weight) and a rejection that drops tokens or whole responses whose ratio leaves a band
(`rollout_rs`), which TRL lacks. This module is the rejection, as pure tensor functions.

Notation, per token t of row i: the log-ratio x_it = log pi_old(o_it) - log pi_rollout(o_it) (the trainer's log-prob
of the sampled token over the engine's), 0 where the engine sent no log-prob (NaN, as TRL treats it), clamped to
[-LOG_RATIO_BOUND, LOG_RATIO_BOUND] token by token; m_it the loss mask. The statistic s tested, by `level`:

- `token`:     s_it = x_it                          each token on its own
- `sequence`:  s_i  = sum_t m_it x_it               log of the response's ratio prod_t pi_old / pi_rollout
- `geometric`: s_i  = sum_t m_it x_it / sum_t m_it  log of the geometric mean of its token ratios (0 without tokens)

A token (`token`) or every token of a row (`sequence`, `geometric`) is kept when lower <= exp(s) <= upper, tested
as log(lower) <= s <= log(upper), and rejected otherwise: the caller multiplies its loss by 0. `lower` defaults to
1 / upper (verl's `rollout_rs_threshold_lower` default).

verl (0.7's `rollout_corr_helper.compute_rollout_rejection_mask`) clamps the summed or averaged log-ratio instead
of each token's; the two decisions differ only for a response holding a token whose ratio is beyond e^20.
"""

from __future__ import annotations

import math

import torch

from .losses import LOG_RATIO_BOUND

REJECTION_LEVELS = ("token", "sequence", "geometric")


def rejection_bounds(upper: float, lower: float | None = None) -> tuple[float, float]:
    """(lower, upper) on the ratio pi_old / pi_rollout: `lower` defaults to 1 / upper."""
    return (1.0 / upper if lower is None else lower), upper


def rejection_statistic(log_ratio: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """s of the module docstring: (N, T) for `token`, (N, 1) for `sequence` and `geometric`. `log_ratio` is
    log pi_old - log pi_rollout per token (N, T), NaN where the engine sent no log-prob."""
    if level not in REJECTION_LEVELS:
        raise ValueError(f"rollout rejection level {level!r}: choose one of {', '.join(REJECTION_LEVELS)}.")
    x = torch.nan_to_num(log_ratio, nan=0.0).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    if level == "token":
        return x
    mask = mask.to(x.dtype)
    total = (x * mask).sum(-1, keepdim=True)
    if level == "sequence":
        return total
    return total / mask.sum(-1, keepdim=True).clamp(min=1.0)


def rejection_mask(log_ratio: torch.Tensor, mask: torch.Tensor, level: str, lower: float, upper: float) -> torch.Tensor:
    """(N, T) float: 1 for a kept token, 0 for a rejected one (`level`'s statistic outside [log lower, log upper]);
    a row-level decision covers all of the row's tokens. Off-mask tokens are whatever their row's decision is: the
    caller multiplies by the loss mask. No gradient flows through it."""
    if not 0.0 < lower <= upper:
        raise ValueError(f"rollout rejection bounds must satisfy 0 < lower <= upper, got lower={lower}, upper={upper}.")
    with torch.no_grad():
        statistic = rejection_statistic(log_ratio.detach(), mask, level)
        kept = (statistic >= math.log(lower)) & (statistic <= math.log(upper))
        return kept.expand_as(log_ratio).to(log_ratio.dtype)
