"""Every policy loss DAPOTrainer trains: one pure function each, and one table of what the trainer must know of it.

A loss is registered with `register_policy_loss(name, ...)`: its function turns log-probabilities and advantages
into per-token losses, and its row in `POLICY_LOSSES` says how they are averaged (`Aggregation`), which
importance-ratio levels it accepts, whether dual-clip applies, and which metrics it logs. Config checks
(`dapo_trl.config.checks`), the batching (`training.step.batching.StepPlanner`), the metrics (`TokenWeightedMetrics`)
and the training step (`training.step.policy_loss.PolicyLossStep`) all read this table; nothing else names a loss type.

Shapes: N rows (completions), T completion tokens. `advantages` is (N, 1); a loss returns (N, T) per-token values,
or (N, 1) for a loss defined per sequence. Every function here sees the log-ratio already clamped to
[-LOG_RATIO_BOUND, LOG_RATIO_BOUND] (`clamped_log_ratio`), as verl clamps it before `exp`.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

# verl clamps log(pi / pi_old) to [-20, 20] before exp (core_algos.compute_policy_loss_vanilla): one stale token can
# then cost at most exp(20) * |A| (5e8), not an overflow to inf, or NaN once multiplied by a zero advantage.
LOG_RATIO_BOUND = 20.0


class Aggregation(enum.Enum):
    """How a loss's per-token values become one number (K = micro-batches per optimizer step)."""

    STEP_TOKENS = "every loss token of the optimizer step, all processes (paper Eq. 11)"
    SEQUENCE_MEAN = "each row's token mean, then the mean over the micro-batch's rows, then K"
    SEQUENCE_SUM = "each row's token sum, then the mean over the micro-batch's rows, then K"
    FIXED_LENGTH = "rows x max_completion_length of the micro-batch, then K"
    MICRO_BATCH_TOKENS = "the micro-batch's loss tokens on this process, then K"

    @property
    def split_weight(self) -> str:
        """What a token-budget pass's share of its micro-batch is measured in (`StepPlanner.part_weights`): nothing
        for a loss normalised by the step's tokens, else the unit the loss averages over."""
        return {"STEP_TOKENS": "none", "MICRO_BATCH_TOKENS": "tokens"}.get(self.name, "rows")


@dataclass(frozen=True)
class LossSettings:
    """The hyper-parameters a loss function may read (built from DAPOConfig by `from_config`)."""

    epsilon_low: float = 0.2
    epsilon_high: float = 0.28
    delta: float | None = None  # the ratio's upper cap (dual-clip: DAPOConfig sets it from clip_ratio_c)
    ratio_level: str = "token"  # importance_sampling_level
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    max_completion_length: int = 256

    @classmethod
    def from_config(cls, args: Any) -> LossSettings:
        names = [name for name in cls.__dataclass_fields__ if name not in ("epsilon_low", "ratio_level")]
        return cls(
            epsilon_low=args.epsilon,
            ratio_level=args.importance_sampling_level,
            **{name: getattr(args, name) for name in names},
        )


class LossInputs(NamedTuple):
    """What every loss function receives. log_ratio is (N, T) or (N, 1) at `ratio_level` sequence (`ratio_log`)."""

    logps: torch.Tensor  # (N, T) current log-probs of the sampled tokens, with gradient
    log_ratio: torch.Tensor  # log(pi / pi_old), clamped: (N, T), or (N, 1) per sequence
    advantages: torch.Tensor  # (N, 1)
    mask: torch.Tensor  # (N, T) float, 1 on loss tokens
    sampling_ratio: torch.Tensor | None  # (N, T) pi_old / pi_sampler (vLLM's truncated weight), when corrected


class LossTerms(NamedTuple):
    """A loss function's result: per-token losses and the named per-token (or per-row) diagnostics it logs."""

    per_token: torch.Tensor  # (N, T) or (N, 1)
    diagnostics: dict[str, torch.Tensor]  # each (N, T) or (N, 1), logged as its mean over loss tokens


LossFunction = Callable[[LossInputs, LossSettings], LossTerms]


@dataclass(frozen=True)
class PolicyLoss:
    """One row of the table: a loss function and the traits the trainer reads."""

    name: str
    function: LossFunction
    aggregation: Aggregation
    ratio_levels: tuple[str, ...] = ("token", "sequence")  # importance_sampling_level values it accepts
    dual_clip: bool = False  # clip_ratio_c / delta cap its ratio
    corrects_sampling: bool = False  # folds vLLM's importance weight itself (else the step multiplies it in)
    metrics: tuple[str, ...] = ()  # its diagnostics, each logged as a mean over loss tokens
    extremes: dict[str, tuple[str, str]] = field(default_factory=dict)  # metric -> (diagnostic, "min" | "max")
    verl_name: str | None = None  # verl's policy_loss.loss_mode, where verl has this loss


POLICY_LOSSES: dict[str, PolicyLoss] = {}


def register_policy_loss(name: str, aggregation: Aggregation, **traits: Any) -> Callable[[LossFunction], LossFunction]:
    """Add a loss to the table: `@register_policy_loss("mine", Aggregation.STEP_TOKENS)` above its function."""

    def register(function: LossFunction) -> LossFunction:
        if name in POLICY_LOSSES:
            raise ValueError(f"a policy loss named {name!r} is already registered")
        POLICY_LOSSES[name] = PolicyLoss(name, function, aggregation, **traits)
        return function

    return register


def policy_loss(name: str) -> PolicyLoss:
    """The table's row for `loss_type`, or an error listing the registered ones."""
    if name not in POLICY_LOSSES:
        raise ValueError(f"loss_type={name!r} is not a registered policy loss; choose one of {sorted(POLICY_LOSSES)}.")
    return POLICY_LOSSES[name]


# ---------------------------------------------------------------------------------------------------- ratios
def clamped_log_ratio(logps: torch.Tensor, old_logps: torch.Tensor, bound: float = LOG_RATIO_BOUND) -> torch.Tensor:
    """log(pi / pi_old) per token, clamped to [-bound, bound] as verl does before exp (no gradient beyond)."""
    return (logps - old_logps).clamp(-bound, bound)


def ratio_log(log_ratio: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """The log importance weight at `level`: per token (N, T), or the sequence's mean log-ratio (N, 1), GSPO's
    s_i = (pi / pi_old)^(1 / |o_i|) (Zheng et al. 2025, Eq. 7)."""
    if level == "token":
        return log_ratio
    if level == "sequence":
        return ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    raise ValueError(f"importance_sampling_level={level!r}: choose 'token' or 'sequence'.")


# ---------------------------------------------------------------------------------------------------- losses
_CLIP_METRICS = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")
_CLIP_EXTREMES = {
    "clip_ratio/low_min": ("clip_ratio/low_mean", "min"),
    "clip_ratio/high_max": ("clip_ratio/high_mean", "max"),
}
_CLIPPED = {"dual_clip": True, "metrics": _CLIP_METRICS, "extremes": _CLIP_EXTREMES}


@register_policy_loss("dapo", Aggregation.STEP_TOKENS, verl_name="vanilla", **_CLIPPED)
@register_policy_loss("grpo", Aggregation.SEQUENCE_MEAN, **_CLIPPED)
@register_policy_loss("dr_grpo", Aggregation.FIXED_LENGTH, **_CLIPPED)
@register_policy_loss("bnpo", Aggregation.MICRO_BATCH_TOKENS, **_CLIPPED)
@register_policy_loss("luspo", Aggregation.SEQUENCE_SUM, **_CLIPPED)
def clipped_surrogate(inputs: LossInputs, settings: LossSettings) -> LossTerms:
    """PPO's clipped surrogate with clip-higher (DAPO Eq. 10) and dual-clip: r = exp(log_ratio),
    l = -min(min(r, delta) A, clip(r, 1 - eps_low, 1 + eps_high) A). With delta = clip_ratio_c > 1 + eps_high this
    is verl's dual-clip: for A < 0 the loss is capped at -A c; for A > 0 the cap never binds."""
    ratio = torch.exp(inputs.log_ratio)
    clipped = torch.clamp(ratio, 1 - settings.epsilon_low, 1 + settings.epsilon_high)
    if settings.delta is not None:
        ratio = torch.clamp(ratio, max=settings.delta)
    advantages = inputs.advantages
    per_token = -torch.min(ratio * advantages, clipped * advantages)
    low = (ratio < 1 - settings.epsilon_low) & (advantages < 0)
    high = (ratio > 1 + settings.epsilon_high) & (advantages > 0)
    diagnostics = {"clip_ratio/low_mean": low, "clip_ratio/high_mean": high, "clip_ratio/region_mean": low | high}
    return LossTerms(per_token, {name: value.float() for name, value in diagnostics.items()})


@register_policy_loss("cispo", Aggregation.STEP_TOKENS, metrics=("cispo_clip_ratio",))
def cispo(inputs: LossInputs, settings: LossSettings) -> LossTerms:
    """CISPO (MiniMax-M1), as TRL defines it: -sg[min(r, eps_high)] A log pi, the ratio clipped only as a detached
    weight, so every token keeps a gradient. `epsilon_high` is the weight's upper bound here (e.g. 5), not
    1 + epsilon. (verl's `cispo` clips the weight on both sides: another loss.)"""
    ratio = torch.exp(inputs.log_ratio)
    weight = torch.clamp(ratio, max=settings.epsilon_high).detach()
    per_token = -weight * inputs.advantages * inputs.logps
    clipped = (ratio > settings.epsilon_high) & (inputs.advantages > 0)
    return LossTerms(per_token, {"cispo_clip_ratio": clipped.float()})


@register_policy_loss("sapo", Aggregation.SEQUENCE_MEAN, verl_name="sapo")
def sapo(inputs: LossInputs, settings: LossSettings) -> LossTerms:
    """SAPO (Gao et al. 2025): a soft gate instead of the clip, -sigmoid(tau (r - 1)) 4 / tau A, with tau
    `sapo_temperature_pos` for A > 0 and `sapo_temperature_neg` otherwise."""
    ratio = torch.exp(inputs.log_ratio)
    tau = torch.where(inputs.advantages > 0, settings.sapo_temperature_pos, settings.sapo_temperature_neg)
    return LossTerms(-torch.sigmoid(tau * (ratio - 1)) * 4 / tau * inputs.advantages, {})


def vespo_weights(inputs: LossInputs, settings: LossSettings) -> torch.Tensor:
    """VESPO's detached gamma weight per sequence, phi(w) = exp(lambda + k log w - lambda w), with w the sequence's
    ratio prod_t r_t (times vLLM's importance weights when given), log w clamped to [log 1e-8, 20], and (k, lambda)
    the positive or negative pair by the sign of A (>= 0 positive). Returns (N, 1); NaN or inf become 0."""
    lower = math.log(1e-8)
    log_w = (inputs.log_ratio * inputs.mask).sum(-1, keepdim=True)
    if inputs.sampling_ratio is not None:
        log_w = log_w + torch.log(inputs.sampling_ratio).clamp(lower, LOG_RATIO_BOUND).sum(-1, keepdim=True)
    log_w = log_w.clamp(lower, LOG_RATIO_BOUND).detach()
    positive = inputs.advantages >= 0
    k = torch.where(positive, settings.vespo_k_pos, settings.vespo_k_neg)
    lam = torch.where(positive, settings.vespo_lambda_pos, settings.vespo_lambda_neg).clamp(min=1e-4)
    return torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


@register_policy_loss(
    "vespo", Aggregation.STEP_TOKENS, ratio_levels=("token",), corrects_sampling=True, metrics=("vespo/phi_seq_mean",)
)
def vespo(inputs: LossInputs, settings: LossSettings) -> LossTerms:
    """VESPO: -phi(w) A log pi, phi the sequence's detached gamma weight (`vespo_weights`), vLLM's importance
    weight folded into w rather than multiplied in."""
    phi = vespo_weights(inputs, settings)
    return LossTerms(-phi * inputs.advantages * inputs.logps, {"vespo/phi_seq_mean": phi})


@register_policy_loss(
    "gmpo",
    Aggregation.SEQUENCE_MEAN,
    ratio_levels=("token",),
    corrects_sampling=True,
    metrics=_CLIP_METRICS[:2],
    verl_name="geo_mean",
)
def gmpo(inputs: LossInputs, settings: LossSettings) -> LossTerms:
    """GMPO (Zhao et al. 2025, verl's `geo_mean`): the geometric mean of the token ratios, clipped in log space.

    Each token's log-ratio x is clipped to [-eps_low, eps_high] on the side the advantage's sign makes pessimistic
    (sgn(A) min(sgn(A) x, sgn(A) clip(x))); the row's loss is -A exp(mean_t of those), one value per row (N, 1).
    `epsilon` / `epsilon_high` are log-space bounds here (the GMPO paper uses 0.4: ratios in [e^-0.4, e^0.4]).
    vLLM's importance weights enter as their geometric mean over the row, as verl's."""
    x, mask, advantages = inputs.log_ratio, inputs.mask, inputs.advantages
    sign = torch.sign(advantages)
    bounded = torch.clamp(x, -settings.epsilon_low, settings.epsilon_high)
    pessimistic = sign * torch.min(sign * x, sign * bounded)
    tokens = mask.sum(-1, keepdim=True).clamp(min=1.0)
    per_row = -advantages * torch.exp((pessimistic * mask).sum(-1, keepdim=True) / tokens)
    if inputs.sampling_ratio is not None:
        per_row = per_row * torch.exp((torch.log(inputs.sampling_ratio + 1e-10) * mask).sum(-1, keepdim=True) / tokens)
    clipped = x != bounded
    low, high = clipped & (advantages < 0), clipped & (advantages > 0)
    return LossTerms(per_row, {"clip_ratio/low_mean": low.float(), "clip_ratio/high_mean": high.float()})


# ------------------------------------------------------------------------------------------------ aggregation
def aggregate(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    aggregation: Aggregation,
    step_tokens: torch.Tensor | None = None,
    max_completion_length: int = 0,
) -> torch.Tensor:
    """One micro-batch's loss from its per-token values ((N, T) or (N, 1), broadcast over the mask), before K.

    STEP_TOKENS divides by `step_tokens`: the optimizer step's loss tokens over all processes, as seen by this
    process's share of the gradient (the caller's `step_token_share`); the others average as `Aggregation` says.
    """
    masked = per_token * mask
    if aggregation is Aggregation.STEP_TOKENS:
        return masked.sum() / step_tokens
    if aggregation is Aggregation.SEQUENCE_MEAN:
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    if aggregation is Aggregation.SEQUENCE_SUM:
        return masked.sum(-1).mean()
    if aggregation is Aggregation.FIXED_LENGTH:
        return masked.sum() / (per_token.size(0) * max_completion_length)
    return masked.sum() / mask.sum().clamp(min=1.0)


def step_token_share(
    num_items_in_batch: torch.Tensor, processes: int, accumulation: int, steps_per_generation: int, training: bool
) -> torch.Tensor:
    """The divisor of STEP_TOKENS on one process: `num_items_in_batch` spans the generation batch, and DDP averages
    processes, so items / P x K / S (in eval, items / P). With the items `batches.trl_items_for_exact_normalizer`
    gives, the optimizer step's loss is its summed token losses over its exact token count."""
    divisor = num_items_in_batch.clamp(min=1.0) / processes
    return divisor * accumulation / steps_per_generation if training else divisor
