"""DAPO's soft overlong punishment (paper Eq. 13) as a built-in shaping column the user's reward list never shows.

TRL sums `rewards_per_func * reward_weights` into the reward the group advantage is computed from, and logs every
column as `rewards/<name>/*`. `ShapingColumns` appends the penalty to the *gathered* reward matrix after TRL scored
the user's functions, and shows the matching name and weight on the trainer only while that one generation batch is
scored: outside `_generate_and_score_completions`, `reward_funcs`, `reward_func_names`,
`reward_processing_classes` and `reward_weights` are exactly what the user (or TRL's environments) put there, and
TRL's "All reward functions returned None" check runs on the user's columns alone.
The math is `dapo_trl.algorithm.soft_overlong_penalty`. Needs torch, so `dapo_trl.rewards` does not import this
module (its math-verify workers must stay light).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..algorithm import soft_overlong_penalty

OVERLONG_PENALTY_NAME = "overlong_penalty"
_SHOWN_LISTS = ("reward_funcs", "reward_func_names", "reward_processing_classes")


class SoftOverlongPenalty:
    """Eq. 13 per completion, before `overlong_penalty_factor`; also reports the share of penalised completions."""

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


class ShapingColumns:
    """Built-in reward columns (name, function, weight) added after the user's, for one scoring pass at a time."""

    def __init__(self, columns: list[tuple[SoftOverlongPenalty, float]]) -> None:
        self.columns = columns
        self._hidden: dict[str, Any] | None = None  # the trainer's own attributes while the columns are shown

    def __bool__(self) -> bool:
        return bool(self.columns)

    def append(
        self,
        trainer: Any,
        rewards_per_func: torch.Tensor,
        completion_ids: list[list[int]],
        gather: Callable[[torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """The gathered user columns followed by the shaping columns; shows their names and weights on `trainer`.

        Each process scores its own completions and `gather` concatenates them in process order, as TRL does for the
        user's columns. A row no user function could score stays unscorable (NaN in every column), so TRL still
        excludes it from the group baseline and zeroes its advantage.
        """
        if not self.columns:
            return rewards_per_func
        device = rewards_per_func.device
        local = [fn(completion_ids=completion_ids, log_metric=trainer._log_metric) for fn, _ in self.columns]
        shaped = gather(torch.tensor(local, dtype=torch.float32, device=device).T.reshape(len(completion_ids), -1))
        shaped[torch.isnan(rewards_per_func).all(dim=1)] = torch.nan
        self.show(trainer)
        return torch.cat([rewards_per_func, shaped], dim=1)

    def show(self, trainer: Any) -> None:
        """Point the trainer's reward lists at extended copies; the user's own list objects are never mutated."""
        if self._hidden is not None:
            return
        self._hidden = {name: getattr(trainer, name) for name in (*_SHOWN_LISTS, "reward_weights")}
        trainer.reward_funcs = [*self._hidden["reward_funcs"], *(fn for fn, _ in self.columns)]
        trainer.reward_func_names = [*self._hidden["reward_func_names"], *(fn.__name__ for fn, _ in self.columns)]
        trainer.reward_processing_classes = [*self._hidden["reward_processing_classes"], *[None] * len(self.columns)]
        weights = torch.tensor([weight for _, weight in self.columns], dtype=torch.float32)
        trainer.reward_weights = torch.cat([self._hidden["reward_weights"], weights.to(trainer.reward_weights)])

    def hide(self, trainer: Any) -> None:
        """Give the trainer back its own reward lists (called when a generation batch is fully scored)."""
        if self._hidden is None:
            return
        for name, value in self._hidden.items():
            setattr(trainer, name, value)
        self._hidden = None
