"""Advantages normalised over a dynamic-sampling batch: TRL's batch-level formulas, applied to the final batch.

TRL normalises by batch statistics (`scale_rewards="batch"`, and `multi_objective_aggregation="normalize_then_sum"`)
over the generation batch it just scored. Dynamic sampling trains on groups kept from several rounds, so, as verl
does (filter the groups, then compute advantages on the final batch), those statistics are recomputed over the
trained rows of the assembled batch. Rows whose reward is NaN (zero-advantage filler, unscorable completions) take no
part in the statistics and get advantage 0.
"""

from __future__ import annotations

import torch
from trl.trainer.utils import nanstd  # TRL's own: Bessel-corrected, NaN-ignoring, NaN below two values

# TRL's epsilon in every std division (grpo_trainer.py, `_generate_and_score_completions`).
STD_EPS = 1e-4


def batch_level_rewards(
    rewards_per_func: torch.Tensor, weights: torch.Tensor, group_size: int, aggregation: str
) -> torch.Tensor:
    """The per-row reward TRL normalises with batch statistics, before that normalisation.

    `sum_then_normalize`: the weighted sum of the reward columns (NaN columns skipped);
    `normalize_then_sum`: the weighted sum of each column normalised within its group, (r - mean) / (std + 1e-4).
    A row where every column is NaN (unscorable) is NaN.

    Args:
        rewards_per_func: (N, F) rewards, groups of `group_size` contiguous rows.
        weights: (F,) reward weights.
    Returns:
        (N,) float rewards.
    """
    if aggregation == "normalize_then_sum":
        grouped = rewards_per_func.view(-1, group_size, rewards_per_func.size(1))
        mean = grouped.nanmean(dim=1, keepdim=True)
        normalised = (grouped - mean) / (nanstd(grouped, dim=1, keepdim=True) + STD_EPS)
        rewards_per_func = normalised.view(-1, rewards_per_func.size(1))
    rewards = (rewards_per_func * weights.to(rewards_per_func.device)).nansum(dim=1)
    return rewards.masked_fill(torch.isnan(rewards_per_func).all(dim=1), torch.nan)


def batch_scaled_advantages(rewards: torch.Tensor, group_size: int, center: str = "group") -> torch.Tensor:
    """A_i = (R_i - center_i) / (std(R) + 1e-4), std over every non-NaN reward of the batch (Bessel-corrected).

    `center="group"` subtracts the mean of row i's group (TRL `scale_rewards="batch"`); `center="batch"` the mean of
    the batch (TRL `normalize_then_sum`). NaN rewards are left out of every statistic and get A = 0.

    Args:
        rewards: (N,) the batch's rewards (`batch_level_rewards`), groups of `group_size` contiguous rows.
    Returns:
        (N,) advantages.
    """
    if center == "group":
        centre = rewards.view(-1, group_size).nanmean(dim=1).repeat_interleave(group_size)
    elif center == "batch":
        centre = rewards.nanmean()
    else:
        raise ValueError(f"center={center!r} must be 'group' or 'batch'")
    std = nanstd(rewards) if rewards.numel() > 1 else torch.zeros((), dtype=rewards.dtype, device=rewards.device)
    return torch.nan_to_num((rewards - centre) / (std + STD_EPS), nan=0.0)


def batch_normalisation(args: object) -> str | None:
    """Which batch-level normalisation a config asks for: the `center` of `batch_scaled_advantages`, or None."""
    if args.multi_objective_aggregation == "normalize_then_sum":
        return "batch"
    return "group" if args.scale_rewards == "batch" else None
