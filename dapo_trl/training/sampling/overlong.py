"""DAPO's soft overlong punishment (paper Eq. 13) as a built-in shaping column (`dapo_trl.training.sampling.shaping`).

The math is `dapo_trl.algorithm.soft_overlong_penalty`. Needs torch, so `dapo_trl.rewards` does not import this
module (its math-verify workers must stay light).
"""

from __future__ import annotations

from typing import Any

import torch

from ...algorithm import soft_overlong_penalty

OVERLONG_PENALTY_NAME = "overlong_penalty"


class SoftOverlongPenalty:
    """Eq. 13 per completion, weighted by `overlong_penalty_factor`; also reports the share of penalised ones."""

    __name__ = OVERLONG_PENALTY_NAME
    train_only = False  # validation rewards are penalised too, as verl's reward manager does

    def __init__(self, max_completion_length: int, overlong_buffer_len: int, weight: float = 1.0) -> None:
        self.max_completion_length = max_completion_length
        self.overlong_buffer_len = overlong_buffer_len
        self.weight = weight

    def __call__(self, completion_ids: list[list[int]], **kwargs: Any) -> list[float]:
        lengths = torch.tensor([len(ids) for ids in completion_ids])
        penalty = soft_overlong_penalty(lengths, self.max_completion_length, self.overlong_buffer_len)
        log_metric = kwargs.get("log_metric")
        if log_metric is not None and len(penalty) > 0:
            log_metric("overlong/penalized_frac", (penalty < 0).float().mean().item())
        return penalty.tolist()
