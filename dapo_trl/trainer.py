"""DAPOTrainer: TRL's GRPOTrainer with DAPO's reward shaping, exact token-level loss and dynamic sampling.

The trainer stays thin: the math lives in `dapo_trl.algorithm`, and every override calls `super()`.
- clip-higher and the token-level loss are TRL's `epsilon_high` and `loss_type="dapo"`; dual-clip is TRL's `delta`
  (equal to verl's `clip_ratio_c` when it exceeds 1 + epsilon_high, which DAPOConfig enforces);
- overlong filtering is TRL's `mask_truncated_completions`;
- the soft overlong punishment is a built-in reward column (weight `overlong_penalty_factor`), so it is added to
  the correctness reward before the group advantage and logged as `rewards/overlong_penalty/*`;
- the token denominator is made exact per optimizer step in `_prepare_inputs`.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from trl import GRPOTrainer

from .algorithm import optimizer_window_token_counts, soft_overlong_penalty, trl_items_for_exact_normalizer
from .config import DAPOConfig
from .rewards import dapo_math_reward

logger = logging.getLogger(__name__)

OVERLONG_PENALTY_NAME = "overlong_penalty"


class SoftOverlongPenalty:
    """Built-in reward column for Eq. 13; TRL weights it by `overlong_penalty_factor` and adds it to the reward."""

    __name__ = OVERLONG_PENALTY_NAME

    def __init__(self, max_completion_length: int, overlong_buffer_len: int):
        self.max_completion_length = max_completion_length
        self.overlong_buffer_len = overlong_buffer_len

    def __call__(self, completion_ids: list[list[int]], **kwargs: Any) -> list[float]:
        lengths = torch.tensor([len(ids) for ids in completion_ids])
        penalty = soft_overlong_penalty(lengths, self.max_completion_length, self.overlong_buffer_len)
        log_metric = kwargs.get("log_metric")
        if log_metric is not None and len(penalty) > 0:
            log_metric("overlong/penalized_frac", (penalty < 0).float().mean().item())
        return penalty.tolist()


class DAPOTrainer(GRPOTrainer):
    """Drop-in for `trl.GRPOTrainer` (same arguments) that trains with DAPO.

    `reward_funcs` defaults to DAPO's "Answer:" correctness reward (+1 / -1) on the dataset's `solution` column.
    """

    def __init__(
        self,
        model: Any,
        reward_funcs: Any = None,
        args: DAPOConfig | None = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        **kwargs: Any,
    ):
        if args is None:
            model_name = model if isinstance(model, str) else model.config._name_or_path
            args = DAPOConfig(f"{str(model_name).rstrip('/').split('/')[-1]}-DAPO")
        elif not isinstance(args, DAPOConfig):
            raise TypeError(
                f"DAPOTrainer needs a DAPOConfig, got {type(args).__name__}: build it with "
                "DAPOConfig(**same_arguments) (DAPOConfig accepts every GRPOConfig field)."
            )
        if reward_funcs is None:
            reward_funcs = [dapo_math_reward]
        super().__init__(
            model=model,
            reward_funcs=reward_funcs,
            args=args,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            **kwargs,
        )
        self.accuracy_reward_index = self._resolve_accuracy_reward_index()
        if args.apply_overlong_penalty:
            self._add_reward_column(
                SoftOverlongPenalty(args.max_completion_length, args.overlong_buffer_len),
                weight=args.overlong_penalty_factor,
            )
        if args.max_prompt_length is not None and self.train_dataset is not None:
            from .data import filter_overlong_prompts

            self.train_dataset = filter_overlong_prompts(
                self.train_dataset,
                self.processing_class,
                args.max_prompt_length,
                policy=args.overlong_prompt_policy,
                chat_template_kwargs=self.chat_template_kwargs,
            )

    # ----------------------------------------------------------------------------------------------------- rewards
    def _resolve_accuracy_reward_index(self) -> int:
        """Which reward column is raw accuracy (dynamic sampling and accuracy metrics read it)."""
        name = self.args.accuracy_reward_name
        if name is None:
            if not self.reward_func_names:
                raise ValueError("DAPOTrainer needs at least one reward function (the correctness reward).")
            return 0
        if name not in self.reward_func_names:
            raise ValueError(
                f"accuracy_reward_name={name!r} is not one of the reward functions {self.reward_func_names}."
            )
        return self.reward_func_names.index(name)

    def _add_reward_column(self, reward_func: Any, weight: float) -> None:
        """Append a built-in reward function, the way TRL itself appends environment rewards."""
        self.reward_funcs.append(reward_func)
        self.reward_func_names.append(reward_func.__name__)
        self.reward_processing_classes.append(None)
        self.reward_weights = torch.cat([self.reward_weights, torch.tensor([weight], dtype=torch.float32)])

    # ------------------------------------------------------------------------------------ exact token denominator
    def _prepare_inputs(self, generation_batch: dict[str, Any]) -> dict[str, Any]:
        buffered_before = self._buffered_inputs
        inputs = super()._prepare_inputs(generation_batch)
        if self.model.training and self._buffered_inputs is not buffered_before:
            self._set_exact_token_denominators(self._buffered_inputs)
        return inputs

    def _set_exact_token_denominators(self, micro_batches: list[dict[str, Any]]) -> None:
        """Give each buffered micro-batch the active-token count of its own optimizer step, over all processes.

        TRL scales one generation-wide count by K / S, which is exact only when S == K (TRL #5619, #6024, #5890,
        #6439); here each step's real count is used, so 1 process x 4 accumulation steps and 2 processes x 2 give
        the same loss, and S = 2K steps are each normalised by their own tokens.
        """
        if self.loss_type not in ("dapo", "cispo", "vespo"):
            return
        device = self.accelerator.device
        local_counts = torch.stack([self._loss_mask(batch).sum() for batch in micro_batches]).to(device)
        global_counts = self.accelerator.reduce(local_counts.float(), reduction="sum")
        window_counts = optimizer_window_token_counts(global_counts, self.args.gradient_accumulation_steps)
        num_items = trl_items_for_exact_normalizer(
            window_counts,
            self.args.steps_per_generation,
            self.args.gradient_accumulation_steps,
        )
        for batch, items in zip(micro_batches, num_items, strict=True):
            batch["num_items_in_batch"] = items

    @staticmethod
    def _loss_mask(batch: dict[str, Any]) -> torch.Tensor:
        mask = batch["completion_mask"]
        return mask if batch.get("tool_mask") is None else mask * batch["tool_mask"]
