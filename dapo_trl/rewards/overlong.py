"""DAPO's soft overlong punishment (paper Eq. 13) as a built-in reward column.

As a reward column TRL weights it by `overlong_penalty_factor`, adds it to the correctness reward before the group
advantage, and logs it as `rewards/overlong_penalty/*`. The math is `dapo_trl.algorithm.soft_overlong_penalty`.
Needs torch, so `dapo_trl.rewards` does not import this module (its math-verify workers must stay light).
"""

from __future__ import annotations

from typing import Any

import torch

from ..algorithm import soft_overlong_penalty

OVERLONG_PENALTY_NAME = "overlong_penalty"


class SoftOverlongPenalty:
    """Built-in reward column for Eq. 13; TRL weights it by `overlong_penalty_factor` and adds it to the reward."""

    __name__ = OVERLONG_PENALTY_NAME

    def __init__(self, max_completion_length: int, overlong_buffer_len: int) -> None:
        self.max_completion_length = max_completion_length
        self.overlong_buffer_len = overlong_buffer_len

    def __call__(self, completion_ids: list[list[int]], **kwargs: Any) -> list[float]:
        lengths = torch.tensor([len(ids) for ids in completion_ids])
        penalty = soft_overlong_penalty(lengths, self.max_completion_length, self.overlong_buffer_len)
        log_metric = kwargs.get("log_metric")
        if log_metric is not None and len(penalty) > 0:
            log_metric("overlong/penalized_frac", (penalty < 0).float().mean().item())
        return penalty.tolist()
