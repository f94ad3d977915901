"""pi_old without a scoring forward: the proximal policy from the engine's log-probs, and the weight it implies.

Decoupled PPO (Hilton et al. 2022, "Batch size-invariance for policy optimization"; AReaL, arXiv 2505.24298, Eq. 5)
trains, per token,

    w * min(r * A, clip(r, 1 - eps_low, 1 + eps_high) * A),   r = pi_theta / pi_prox,   w = pi_prox / pi_behave,

where pi_behave sampled the token and pi_prox is the policy the trust region is centred on (DAPO's pi_old: the
weights when the batch was scored). TRL and DAPOTrainer get log pi_prox from a no-grad forward of every row. Two
sources need none (`DAPOConfig.old_logprobs_source`):

- `engine` (verl's rollout-correction bypass mode): pi_prox := pi_behave, the engine's own log-probs; then w = 1 and
  the clip alone bounds the step away from the sampler.
- `interpolated` (AReaL's `prox_logp_method=loglinear`): with v the weights version of each policy, counted here in
  optimizer steps,

      alpha = (v_prox - v_behave) / (v_theta - v_behave)   (0 where v_theta == v_behave),
      log pi_prox ~= log pi_behave + alpha * (log pi_theta - log pi_behave)   (pi_theta without gradient).

  A token sampled by the weights it is scored with (lag v_prox - v_behave = 0) gets pi_behave; at the first update
  after scoring (v_theta == v_prox) a stale token gets pi_theta, exactly the weights a forward would have used.

Shapes: N rows, T completion tokens; `lag` is (N, T) optimizer steps from the token's sampler to pi_prox, `since`
(N, 1) optimizer steps from pi_prox to the weights being trained.
"""

from __future__ import annotations

import torch

IMPORTANCE_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")  # TRL's names


def interpolation_weight(lag: torch.Tensor, since: torch.Tensor) -> torch.Tensor:
    """AReaL's alpha per token: lag / (lag + since), where lag = v_prox - v_behave >= 0 and since = v_theta - v_prox
    >= 0; 0 where both are 0 (the token's sampler is the weights being trained)."""
    lag, since = lag.float().clamp(min=0.0), since.float().clamp(min=0.0)
    total = lag + since
    return torch.where(total > 0, lag / total.clamp(min=1e-12), torch.zeros_like(total))


def proximal_log_probs(behaviour: torch.Tensor, current: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """log pi_prox ~= log pi_behave + alpha (log pi_theta - log pi_behave), with no gradient through pi_theta."""
    return behaviour + weight * (current.detach() - behaviour)


def importance_weight(
    log_ratio: torch.Tensor, mask: torch.Tensor, mode: str, clip_min: float | None, clip_max: float | None
) -> torch.Tensor:
    """The weight w = pi_prox / pi_behave per token (N, T) or per sequence (N, 1), as TRL's
    `vllm_importance_sampling_mode` shapes it: `token_*` per token, `sequence_*` exp of the row's summed log-ratio;
    `*_truncate` clamps w to [clip_min, clip_max], `*_mask` zeroes it outside. `log_ratio` is log pi_prox - log
    pi_behave; tokens off `mask` (and NaN: the engine sent no log-prob) count as 0."""
    if mode not in IMPORTANCE_MODES:
        raise ValueError(f"vllm_importance_sampling_mode={mode!r}: choose one of {', '.join(IMPORTANCE_MODES)}.")
    log_ratio = torch.nan_to_num(log_ratio * mask, nan=0.0)
    if mode.startswith("sequence"):
        log_ratio = log_ratio.sum(dim=-1, keepdim=True)
    weight = torch.exp(log_ratio)
    if mode.endswith("truncate"):
        return torch.clamp(weight, min=clip_min, max=clip_max)
    low = -float("inf") if clip_min is None else clip_min
    high = float("inf") if clip_max is None else clip_max
    return weight.masked_fill((weight < low) | (weight > high), 0.0)
