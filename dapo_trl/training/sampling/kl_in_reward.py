"""verl's KL in the reward (`algorithm.use_kl_in_reward`): R = score - beta * sum_t KL_t, before the group advantage.

A built-in shaping column (see `shaping.ShapingColumns`) named `kl_in_reward`. Its value is the response's summed
per-token KL estimate between the policy that sampled it and the reference model, over the model's own tokens (tool
outputs excluded, as by verl's response mask); its weight is -beta, read before the controller moves. TRL adds it to
the user's weighted rewards, so the group advantage, `scale_rewards` and dynamic sampling see the penalised reward
exactly as verl's `apply_kl_penalty` + GRPO advantage do; TRL logs the column as `rewards/kl_in_reward/*` (the summed
KL), and `kl/in_reward` (the batch mean of each response's mean per-token KL, verl's `actor/reward_kl_penalty`) and
`kl/coef` (the beta used) are logged per generation batch. Training only: validation rewards are the plain scores.

beta comes from a `KLController`: fixed, or verl's adaptive controller, stepped after every generation batch (with
dynamic sampling, every round, as in verl's DAPO recipe) with that batch's KL and response count. An adaptive beta
is saved in checkpoints and continues on resume. The log-probs come from two no-grad forwards of the batch (policy,
reference); verl makes the same two (old_log_prob and ref_log_prob). Where TRL already ran either of them on this very
batch before scoring (its old log-probs, its KL loss's reference log-probs), the KL reuses it: the trainer records
each no-grad forward by `forward_role`, which for a PEFT model tells the two apart by whether the adapter was on. The
reference model is TRL's, or, when TRL's KL loss is off, the one `reference.build_reference_model` builds; for a PEFT
model, the adapter turned off (or TRL's "ref" copy of a pre-trained adapter).
The math is `dapo_trl.algorithm.kl_penalty_per_token` and `adaptive_kl_coef`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ...algorithm import adaptive_kl_coef, kl_penalty_per_token
from .. import trl_seam
from ..step.packing import forward_count_agreement
from ..trl_seam import trl_function

KL_IN_REWARD_NAME = "kl_in_reward"
KL_CONTROLLER_STATE_FILE = "dapo_kl_controller.pt"

# (policy log-probs, reference log-probs, mask of the model's own tokens), each (N, T), for one generation batch.
LogProbs = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class KLController:
    """The KL coefficient beta: fixed, or adapted towards `target` over `horizon` responses (verl's kl_ctrl)."""

    def __init__(self, coef: float, kind: str = "fixed", target: float = 0.1, horizon: int = 10000) -> None:
        if kind not in ("fixed", "adaptive"):
            raise ValueError(f"kl_in_reward_controller={kind!r} must be 'fixed' or 'adaptive'.")
        self.value, self.kind, self.target, self.horizon = float(coef), kind, target, horizon

    def update(self, current_kl: float, num_responses: int) -> None:
        if self.kind == "adaptive":
            self.value = adaptive_kl_coef(self.value, current_kl, self.target, self.horizon, num_responses)

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value, "kind": self.kind}

    def load_state_dict(self, state: dict[str, Any], device: Any = None) -> None:
        """An adaptive beta continues from the saved one; a fixed beta is the one configured now (it may be new)."""
        if self.kind == "adaptive" and state.get("kind", "adaptive") == "adaptive":
            self.value = float(state["value"])


class KLInReward:
    """The `kl_in_reward` shaping column: each response's summed per-token KL to the reference (weight -beta)."""

    __name__ = KL_IN_REWARD_NAME
    train_only = True  # verl's validation scores carry no KL

    def __init__(self, controller: KLController, estimator: str, log_probs: Callable[[Any], LogProbs]) -> None:
        self.controller, self.estimator, self.log_probs = controller, estimator.rstrip("+"), log_probs
        kl_penalty_per_token(torch.zeros(1), torch.zeros(1), self.estimator)  # an unknown estimator fails here

    @property
    def weight(self) -> float:
        return -self.controller.value

    def __call__(
        self, completion_ids: list[list[int]], generation: Any, gather: Callable, log_metric: Callable, **kwargs: Any
    ) -> list[float]:
        policy, reference, mask = self.log_probs(generation)
        per_token = kl_penalty_per_token(policy.float(), reference.float(), self.estimator) * mask
        summed = per_token.sum(dim=1)
        mean_per_response = gather(summed / mask.sum(dim=1).clamp(min=1))  # every process's responses
        current_kl = mean_per_response.mean().item() if mean_per_response.numel() else 0.0
        log_metric("kl/in_reward", current_kl)
        log_metric("kl/coef", self.controller.value)
        self.controller.update(current_kl, mean_per_response.numel())
        return summed.tolist()


def policy_and_reference_log_probs(trainer: Any, generation: Any) -> LogProbs:
    """No-grad log-probs of one generation batch (a `shaping.GenerationRecord`) under the policy and the reference.

    The reference is `trainer.ref_model` (TRL's, or `reference.build_reference_model`'s when TRL's KL loss is off),
    or for a PEFT model the base (or the "ref" adapter TRL copied from a pre-trained one), as GRPOTrainer computes
    its KL loss's reference. Each of the two is the forward TRL already made of this very batch before scoring (same
    rows, same layout: its old log-probs, its KL loss's reference log-probs) when there is one, else one of its own.
    """
    pad = trl_function("pad")
    output = generation.output
    if output.images is not None:
        raise ValueError("kl_in_reward does not support image inputs yet: turn it off for multimodal training.")
    device, pad_id = trainer.accelerator.device, trl_seam.tokenizer(trainer).pad_token_id

    def padded(rows: list[list[int]], value: int, side: str) -> torch.Tensor:
        return pad([torch.tensor(row, device=device) for row in rows], padding_value=value, padding_side=side)

    prompts, completions = padded(output.prompt_ids, pad_id, "left"), padded(output.completion_ids, pad_id, "right")
    prompt_mask = padded([[1] * len(row) for row in output.prompt_ids], 0, "left")
    completion_mask = padded([[1] * len(row) for row in output.completion_ids], 0, "right")
    input_ids, attention_mask = torch.cat([prompts, completions], 1), torch.cat([prompt_mask, completion_mask], 1)
    # The KL is summed over the model's own tokens: tool outputs (in the context, so attended) are left out.
    tool_mask = output.tool_mask
    mask = completion_mask if tool_mask is None else completion_mask * padded(tool_mask, 0, "right")

    # Forwards that are collective (ZeRO-3 / FSDP gathers, a sequence-parallel group) must run on every process or on
    # none: reuse a recorded forward only where every process can.
    sequence_parallel = trainer.args.sequence_parallel_size > 1
    collective = sequence_parallel or forward_count_agreement(trainer.accelerator) is not None

    def recorded(forward: tuple | None) -> torch.Tensor | None:
        found = forward is not None and same_tensor(forward[0], input_ids) and same_tensor(forward[1], attention_mask)
        if collective:
            flag = torch.tensor(int(found), device=device)
            found = bool(trainer.accelerator.reduce(flag, reduction="min").item())
        return forward[2] if found else None

    def forward(model: Any) -> torch.Tensor:
        return trl_seam.per_token_log_probs(trainer, model, input_ids, attention_mask, completions.size(1))

    with torch.no_grad():
        policy = recorded(generation.policy_forward)
        if policy is None:
            policy = forward(trainer.model)
        reference = recorded(generation.reference_forward)
        if reference is None and trainer.ref_model is not None:
            reference = forward(trainer.ref_model)
        elif reference is None:
            unwrapped = trainer.accelerator.unwrap_model(trainer.model)
            with trl_function("use_adapter")(unwrapped, adapter_name=reference_adapter(unwrapped)):
                reference = forward(trainer.model)
    return policy, reference, mask.float()


def reference_adapter(peft_model: Any) -> str | None:
    """The adapter a PEFT policy's reference runs with, as GRPOTrainer chooses it: TRL's "ref" copy of a pre-trained
    adapter, or None (every adapter off: the base model)."""
    return "ref" if "ref" in peft_model.peft_config else None


def forward_role(trainer: Any, model: Any) -> str | None:
    """Which of KL in the reward's two forwards a no-grad forward of `model` is: "policy", "reference" or None.

    `trainer.ref_model` is the reference. `trainer.model` is the policy, except for a PEFT model running as its
    reference: its adapters off, or TRL's "ref" adapter active (GRPOTrainer's KL-loss reference forward, and ours).
    """
    if model is not trainer.model:
        return "reference" if model is not None and model is trainer.ref_model else None
    from accelerate.utils import is_peft_model

    unwrapped = trainer.accelerator.unwrap_model(model)
    if not is_peft_model(unwrapped):
        return "policy"
    disabled = adapters_disabled(unwrapped)
    if reference_adapter(unwrapped) is None:
        return "reference" if disabled else "policy"
    if disabled:
        return None  # neither: the base model is not this run's reference
    return "reference" if unwrapped.active_adapter == "ref" else "policy"


def adapters_disabled(peft_model: Any) -> bool:
    """Whether a PEFT model runs with its adapter layers off (inside `disable_adapter()`)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    for module in peft_model.modules():
        if isinstance(module, BaseTunerLayer):
            return bool(module.disable_adapters)
    return False


def same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b))
