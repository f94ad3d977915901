"""Built-in reward shaping columns (the soft overlong penalty, KL in the reward) the user's reward list never shows.

TRL sums `rewards_per_func * reward_weights` into the reward the group advantage is computed from, and logs every
column as `rewards/<name>/*`. `ShapingColumns` appends the built-in columns to the *gathered* reward matrix after
TRL scored the user's functions, and shows the matching names and weights on the trainer only while that one
generation batch is scored: outside `_generate_and_score_completions`, `reward_funcs`, `reward_func_names`,
`reward_processing_classes` and `reward_weights` are exactly what the user (or TRL's environments) put there, and
TRL's "All reward functions returned None" check runs on the user's columns alone.

A column is a callable with a `__name__`, a `weight` (read once per batch, before the column runs) and `train_only`;
it is called with the batch's `completion_ids`, `generation` (a `GenerationRecord`), `gather` and `log_metric`, and
returns one value per local completion.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from ..trl_seam import GenerationOutput, reward_metric_logger
from .kl_in_reward import (
    KL_CONTROLLER_STATE_FILE,
    KLController,
    KLInReward,
    forward_role,
    policy_and_reference_log_probs,
)
from .overlong import SoftOverlongPenalty

_SHOWN_LISTS = ("reward_funcs", "reward_func_names", "reward_processing_classes")


@dataclass
class GenerationRecord:
    """The generation batch being scored, as the trainer saw it: whether it was generated in training (TRL's paged
    generation leaves the model in train mode even in evaluation), TRL `_generate`'s output, and the first no-grad
    forward since of the policy and of the reference (TRL's old log-probs and its KL loss's reference log-probs, when
    it computes them before scoring), each (input_ids, attention_mask, log-probs)."""

    training: bool = False
    output: GenerationOutput | None = None
    policy_forward: tuple | None = None
    reference_forward: tuple | None = None

    def record_forward(self, trainer: Any, model: Any, input_ids: Any, attention_mask: Any, log_probs: Any) -> None:
        """Keep a no-grad forward of this batch for KL in the reward, as the policy's or the reference's (the first
        of each); a PEFT model's are told apart by whether its adapter was on (`kl_in_reward.forward_role`)."""
        if not self.training or not trainer.args.kl_in_reward:
            return
        role = forward_role(trainer, model)
        if role == "policy" and self.policy_forward is None:
            self.policy_forward = (input_ids, attention_mask, log_probs)
        elif role == "reference" and self.reference_forward is None:
            self.reference_forward = (input_ids, attention_mask, log_probs)


class ShapingColumns:
    """Built-in reward columns added after the user's, for one scoring pass at a time."""

    def __init__(self, columns: list[Any]) -> None:
        self.columns = columns
        self._hidden: dict[str, Any] | None = None  # the trainer's own attributes while the columns are shown

    @classmethod
    def for_trainer(cls, trainer: Any) -> ShapingColumns:
        """The columns `trainer.args` asks for: the overlong penalty (Eq. 13), then KL in the reward."""
        args, columns = trainer.args, []
        if args.apply_overlong_penalty:
            columns.append(
                SoftOverlongPenalty(args.max_completion_length, args.overlong_buffer_len, args.overlong_penalty_factor)
            )
        if args.kl_in_reward:
            kind, target, horizon = args.kl_in_reward_controller, args.kl_in_reward_target, args.kl_in_reward_horizon
            controller = KLController(args.kl_in_reward_coef, kind, target, horizon)
            log_probs = partial(policy_and_reference_log_probs, trainer)
            columns.append(KLInReward(controller, args.kl_in_reward_estimator, log_probs))
        return cls(columns)

    def active(self, training: bool) -> list[Any]:
        return [column for column in self.columns if training or not column.train_only]

    def append(
        self,
        trainer: Any,
        rewards_per_func: torch.Tensor,
        completion_ids: list[list[int]],
        gather: Callable[[torch.Tensor], torch.Tensor],
        generation: GenerationRecord,
    ) -> torch.Tensor:
        """The gathered user columns followed by the shaping columns; shows their names and weights on `trainer`.

        Each process scores its own completions and `gather` concatenates them in process order, as TRL does for the
        user's columns. A row no user function could score stays unscorable (NaN in every column), so TRL still
        excludes it from the group baseline and zeroes its advantage.
        """
        columns = self.active(generation.training)  # as when generated (`trainer.model` may be flipped since)
        if not columns:
            return rewards_per_func
        weights = [column.weight for column in columns]  # before a controller moves (verl: beta, then update)
        context = {"generation": generation, "gather": gather, "log_metric": reward_metric_logger(trainer)}
        local = [column(completion_ids=completion_ids, **context) for column in columns]
        device = rewards_per_func.device
        shaped = gather(torch.tensor(local, dtype=torch.float32, device=device).T.reshape(len(completion_ids), -1))
        shaped[torch.isnan(rewards_per_func).all(dim=1)] = torch.nan
        self.show(trainer, columns, weights)
        return torch.cat([rewards_per_func, shaped], dim=1)

    def show(self, trainer: Any, columns: list[Any], weights: list[float]) -> None:
        """Point the trainer's reward lists at extended copies; the user's own list objects are never mutated."""
        if self._hidden is not None:
            return
        self._hidden = {name: getattr(trainer, name) for name in (*_SHOWN_LISTS, "reward_weights")}
        trainer.reward_funcs = [*self._hidden["reward_funcs"], *columns]
        trainer.reward_func_names = [*self._hidden["reward_func_names"], *(column.__name__ for column in columns)]
        trainer.reward_processing_classes = [*self._hidden["reward_processing_classes"], *[None] * len(columns)]
        shown = torch.tensor(weights, dtype=torch.float32)
        trainer.reward_weights = torch.cat([self._hidden["reward_weights"], shown.to(trainer.reward_weights)])

    def hide(self, trainer: Any) -> None:
        """Give the trainer back its own reward lists (called when a generation batch is fully scored)."""
        if self._hidden is None:
            return
        for name, value in self._hidden.items():
            setattr(trainer, name, value)
        self._hidden = None

    # ------------------------------------------------------------------------------------ checkpointed state
    def checkpoint_files(self) -> dict[str, Any]:
        """{file name: part} for the column state a resumed run must restore (the KL coefficient)."""
        kl = [column.controller for column in self.columns if isinstance(column, KLInReward)]
        return {KL_CONTROLLER_STATE_FILE: kl[0]} if kl else {}
