"""Optimizer steps: which micro-batches one step trains on, their exact token count, and skipping empty steps.

TRL's Trainer loop fetches an optimizer step's `gradient_accumulation_steps` (K) dataloader batches at once
(`get_batch_samples`), then runs them one micro-step at a time; TRL generates every `steps_per_generation` (S) x
`num_iterations` micro-steps and hands out the buffered micro-batch `step % S`. When K does not divide S, an
optimizer step spans two generation batches and the second is not generated yet when the step begins, so DAPO's
exact token denominator (paper Eq. 11: the active tokens of the whole step) cannot be known. `OptimizerSteps`
generates, at a step's first micro-step, every generation batch that starts inside the step. The weights only change
at the end of a step, so this samples from exactly the policy TRL's own timing would, and the denominator is exact
for every S, K and `num_iterations`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from transformers import TrainerCallback

from ...algorithm import trl_items_for_exact_normalizer
from ..trl_seam import metrics
from .replayed_routing import HOST_ROW_TENSORS

if TYPE_CHECKING:
    from ...config import DAPOConfig

logger = logging.getLogger(__name__)

# Per process, checkpoint-N/<this>_rank<r>.pt: `OptimizerSteps.state_dict()`.
OPTIMIZER_STEPS_FILE = "dapo_generation_batch"

# A generation batch's prompts -> its planned micro-batches (each with "loss_tokens": its loss tokens, all processes).
Generate = Callable[[int, Any], list[dict[str, Any]]]


def resumed_at_max_steps(state: Any, control: Any) -> bool:
    """Whether a run resumed from a checkpoint already at `max_steps` (a finished run requeued): Trainer's loop checks
    the bound only after a step, so it would train one step more and write a checkpoint past the end. Stops the loop
    before that step (`control.should_training_stop`), saying so; the model holds the checkpoint's weights."""
    if not (state.max_steps > 0 and state.global_step >= state.max_steps):
        return False
    logger.warning(
        "the run resumed at step %d, its max_steps: nothing left to train (raise --max_steps to train further)",
        state.global_step,
    )
    control.should_training_stop = True
    return True


class OptimizerSteps:
    """Hands out each training micro-step's micro-batch with its optimizer step's exact normaliser.

    `begin(step, batches)` is called with a step's dataloader batches before its first micro-step (`step` is TRL's
    micro-step counter `_step`); `micro_batch(step, generate)` then returns micro-step `step`'s micro-batch.
    `tokens` is the current optimizer step's loss-token count over all its micro-batches and processes (the same on
    every process), which `SkipEmptySteps` reads.
    """

    def __init__(self, args: DAPOConfig, device: Any, exact_denominator: bool):
        self.steps_per_generation = args.steps_per_generation
        self.num_iterations = args.num_iterations
        self.generate_every = args.steps_per_generation * args.num_iterations
        self.device = device
        self.exact_denominator = exact_denominator
        self.start: int | None = None
        self.batches: list[Any] = []
        self.buffer: list[dict[str, Any]] | None = None  # the micro-batches of the generation batch in use
        self.ahead: dict[int, list[dict[str, Any]]] = {}  # generation batches made early, by their first micro-step
        self.tokens: float | None = None
        self.resumed_micro_step: int | None = None  # set by `load_state_dict`: where TRL's counter continues

    def begin(self, step: int, batches: list[Any]) -> None:
        self.start, self.batches = step, list(batches)

    def micro_batch(self, step: int, generate: Generate) -> dict[str, Any]:
        if self.start is None or not 0 <= step - self.start < len(self.batches):
            raise RuntimeError(
                f"micro-step {step} is outside the optimizer step that began at {self.start}: DAPOTrainer trains "
                "through Trainer.train(), whose get_batch_samples announces each optimizer step."
            )
        if step == self.start:
            self._prepare(generate)
        self.buffer = self.ahead.pop(step, self.buffer)
        inputs = self.buffer[step % self.steps_per_generation]
        if self.exact_denominator:
            tokens = torch.tensor(self.tokens, device=self.device)
            inputs["num_items_in_batch"] = trl_items_for_exact_normalizer(
                tokens, self.steps_per_generation, len(self.batches)
            )
        return inputs

    def last_use(self, step: int) -> bool:
        """Whether micro-step `step` trains its micro-batch for the last time (its last PPO epoch of
        `num_iterations`): routing replay keeps the micro-batch's routings until then."""
        epoch = (step % self.generate_every) // self.steps_per_generation
        return epoch == self.num_iterations - 1

    def in_use(self) -> list[dict[str, Any]]:
        """The micro-batches made and not yet trained for the last time: the generation batch in use and those made
        ahead in this optimizer step (an optimizer step may span two)."""
        return [*(self.buffer or ()), *(batch for batches in self.ahead.values() for batch in batches)]

    def _prepare(self, generate: Generate) -> None:
        """Generate the generation batches starting inside this optimizer step; sum the step's loss tokens."""
        if self.start % self.generate_every == 0:  # the last generation batch is trained: its rows go before the next
            self.buffer = None
        buffer, tokens = self.buffer, 0.0
        for offset, prompts in enumerate(self.batches):
            step = self.start + offset
            if buffer is None or step % self.generate_every == 0:
                buffer = self.ahead[step] = generate(step, prompts)
            tokens += buffer[step % self.steps_per_generation]["loss_tokens"]
        self.tokens = tokens

    # ----------------------------------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Where the run stands in its generation batches at the end of an optimizer step (a checkpoint): the next
        micro-step, and this process's micro-batches of the generation batch still being trained, if the step
        ended inside one. With several optimizer steps per generation batch (DAPO's 16 updates per rollout) a
        checkpoint usually falls inside one: a resume then trains its remaining micro-batches, exactly as the
        uninterrupted run does, instead of generating a new batch from other weights."""
        next_step = 0 if self.start is None else self.start + len(self.batches)
        inside = self.buffer is not None and next_step % self.generate_every != 0
        return {"micro_step": next_step, "micro_batches": self.buffer if inside else None}

    def load_state_dict(self, state: dict[str, Any], device: Any = None) -> None:
        """Back to the end of an optimizer step (`state_dict()` then returns `state`): a resume, or a step abandoned
        for a preemption before its checkpoint is written."""
        self.resumed_micro_step = self.start = state["micro_step"]
        self.batches, self.ahead, self.tokens = [], {}, None
        batches = state["micro_batches"]
        self.buffer = None if batches is None else [_to_device(batch, device) for batch in batches]

    @staticmethod
    def needs_same_processes(state: dict[str, Any]) -> bool:
        """A checkpoint inside a generation batch holds each process's own rows: only as many processes resume it."""
        return state["micro_batches"] is not None


def _to_device(value: Any, device: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device) if device is not None else value
    if isinstance(value, dict):  # routing replay's routings stay in host memory
        return {key: item if key in HOST_ROW_TENSORS else _to_device(item, device) for key, item in value.items()}
    if isinstance(value, list):
        return [_to_device(item, device) for item in value]
    return value


class SkipEmptySteps(TrainerCallback):
    """An optimizer step with no loss token at all (every group zero-advantage filler, or every completion masked by
    `mask_truncated_completions`) leaves the weights and the optimizer state untouched.

    Right before `optimizer.step()` every gradient is set to None: torch optimizers skip a parameter without a
    gradient entirely (no weight decay, no moment update, no step count), which `zero_grad(set_to_none=True)`
    documents. The step still counts: `global_step` and the LR schedule advance, as verl's step counter does, so
    `max_steps`, `save_steps`, warm-up and decay stay in optimizer steps. The metric `skipped_steps` (1 for a skipped
    step, 0 otherwise, averaged over the logging window like every TRL metric: the share of skipped steps) counts
    them. Every process holds the same all-reduced count, so all skip together. DeepSpeed steps its optimizer inside
    the last backward pass, before this hook: there an empty step is taken (zero gradient: weight decay and Adam's
    moment decay still apply), logged once as a warning and not counted.
    """

    def __init__(self, trainer: Any, optimizer_steps: OptimizerSteps):
        self.trainer, self.optimizer_steps = trainer, optimizer_steps
        self.warned = False

    def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        empty = self.optimizer_steps.tokens == 0
        skipped = empty and not self.trainer.is_deepspeed_enabled
        if skipped:
            optimizer.zero_grad(set_to_none=True)
        elif empty and not self.warned:
            self.warned = True
            logger.warning(
                "optimizer step %d has no loss token; DeepSpeed takes it anyway (zero gradient: weight decay and "
                "Adam's moment decay still apply)",
                state.global_step + 1,
            )
        metrics(self.trainer, "train")["skipped_steps"].append(float(skipped))
