"""Where a scored batch's pi_old comes from (`DAPOConfig.old_logprobs_source`): TRL's scoring forward, or the
engine's sampling log-probs with no forward (`algorithm.proximal` has the formulas).

TRL's `_generate_and_score_completions` runs the policy's no-grad forward for pi_old first, then the reference's.
With pi_old from the engine, `OldLogProbs.scoring` arms a one-shot around one TRL scoring pass: that first forward
returns NaN instead of running (`skipped_forward`), so TRL's importance weight sees a zero difference and is 1, and
its mismatch figures, computed against nothing, are dropped. `complete` then sets `old_per_token_logps` to the
engine's log-probs and, for `interpolated`, adds what the loss needs to place each token between the sampler and
the weights being trained: each token's lag (optimizer steps from the weights that sampled it to pi_old) and each
row's scoring step. The loss (`training.step.policy_loss`) measures the trainer/engine mismatch at its own forwards.

The forward still runs where something else reads it: KL in the reward (the policy's log-probs) and routing replay
(its logprob-mismatch metric); pi_old then still comes from the engine.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from .. import trl_seam
from .batch_metrics import per_pass_figures_dropped

PROXIMAL_LAG = "dapo_proximal_lag"  # (rows, tokens) optimizer steps from each token's sampler to pi_old
SCORED_AT = "dapo_scored_at_step"  # (rows,) the optimizer step whose weights pi_old is


def measured_in_training(name: str) -> bool:
    """TRL's per-pass figures of the trainer/engine mismatch: with pi_old from the engine, the loss logs them."""
    return name in trl_seam.ENGINE_MISMATCH_METRICS


class OldLogProbs:
    """The trainer's source of pi_old for its training batches (evaluation keeps TRL's forward)."""

    def __init__(self, args: Any) -> None:
        self.source: str = args.old_logprobs_source
        self.forward_needed = bool(args.kl_in_reward or args.routing_replay)  # the policy forward's other readers
        self._skip_next = False

    @property
    def from_engine(self) -> bool:
        return self.source != "trainer"

    @contextlib.contextmanager
    def scoring(self, trainer: Any) -> Iterator[None]:
        """Around one TRL scoring pass of a training batch: its pi_old forward is skipped unless another reads it."""
        if not (self.from_engine and trainer.model.training):
            yield
            return
        self._skip_next = not self.forward_needed and trl_seam.scores_old_log_probs(trainer)
        try:
            with per_pass_figures_dropped(trl_seam.metrics(trainer, "train"), measured_in_training):
                yield
        finally:
            self._skip_next = False

    def score(self, trainer: Any, score: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """One TRL scoring pass (`score`) of a batch dynamic sampling does not regroup, with pi_old from this source."""
        with self.scoring(trainer):
            output = score()
        self.complete(trainer, output, None)
        return output

    def skipped_forward(self, model: Any, trainer: Any, input_ids: torch.Tensor, logits_to_keep: int) -> tuple | None:
        """In place of TRL's pi_old forward (the pass's first no-grad forward of the policy): NaN log-probs, no
        entropies; None for any other forward."""
        policy = trainer.accelerator.unwrap_model(model) is trainer.model
        if not self._skip_next or torch.is_grad_enabled() or not policy:
            return None
        self._skip_next = False
        placeholder = torch.full((input_ids.size(0), logits_to_keep), float("nan"), device=input_ids.device)
        return placeholder, None, None

    def complete(self, trainer: Any, output: dict[str, Any], token_versions: Sequence[Sequence[int]] | None) -> None:
        """After TRL scored a training batch: pi_old := the engine's log-probs (NaN where it sent none: the loss
        then uses pi_theta's, a ratio of 1). `token_versions`: a streamed wave's weights version per sampled token,
        per local row (None: every token sampled by the weights it is scored with)."""
        if not (self.from_engine and trainer.model.training):
            return
        engine = output.get("sampling_per_token_logps")
        if engine is None:
            raise RuntimeError(
                f"old_logprobs_source={self.source!r}: the engine sent no sampling log-probs for this batch; use "
                "vLLM (use_vllm true), a streaming engine that returns log-probs, or old_logprobs_source: trainer."
            )
        output["old_per_token_logps"] = engine
        if output.get("importance_sampling_ratio") is not None:  # pi_old / pi_engine = 1
            output["importance_sampling_ratio"] = torch.ones_like(output["importance_sampling_ratio"])
        if self.source == "interpolated":
            output[PROXIMAL_LAG] = self._lag(trainer, engine, token_versions)
            step = float(trainer.state.global_step)
            output[SCORED_AT] = torch.full((engine.size(0),), step, device=engine.device)

    @staticmethod
    def _lag(trainer: Any, engine: torch.Tensor, token_versions: Sequence[Sequence[int]] | None) -> torch.Tensor:
        """(rows, tokens) optimizer steps from each token's weights to those it is scored with: weights versions
        count generation batches, each `steps_per_generation * num_iterations / gradient_accumulation_steps`
        optimizer steps. Tokens past a row's versions (a tool loop's later turns) were sampled by current weights."""
        lag = torch.zeros_like(engine, dtype=torch.float32)
        rollout = getattr(trainer, "_rollout", None)
        if token_versions is None or rollout is None:
            return lag
        args = trainer.args
        steps_per_version = args.steps_per_generation * trainer.num_iterations / args.gradient_accumulation_steps
        width = lag.size(1)
        for row, versions in enumerate(token_versions):
            behind = torch.as_tensor(list(versions)[:width], dtype=torch.float32)
            lag[row, : behind.numel()] = (rollout.generation - behind).clamp(min=0) * steps_per_version
        return lag
