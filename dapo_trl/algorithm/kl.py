"""KL(pi || pi_ref) estimators from sampled tokens and the adaptive KL controller, as pure functions: the KL
penalty in the reward and the KL loss term use the same estimators."""

from __future__ import annotations

import torch

# verl's KL estimators for the reward penalty (core_algos.kl_penalty_forward), by name and alias. The '+' variants
# (k3+ ...) differ from these in their gradient only, and the reward penalty carries none: callers strip the '+'.
KL_ESTIMATORS = {"kl": "k1", "k1": "k1", "abs": "abs", "mse": "k2", "k2": "k2", "low_var_kl": "k3", "k3": "k3"}
# verl's k3 clamps: the log-ratio to [-20, 20] before exp, the estimate to [-10, 10].
K3_LOG_RATIO_BOUND, K3_ESTIMATE_BOUND = 20.0, 10.0


def kl_penalty_per_token(logps: torch.Tensor, ref_logps: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from the sampled tokens' log-probs (Schulman, "Approximating KL").

    With log r = log pi_ref - log pi: k1 ("kl") = -log r; "abs" = |log r|; k2 ("mse") = (log r)^2 / 2;
    k3 ("low_var_kl") = r - log r - 1, with verl's clamps (log r to [-20, 20], the estimate to [-10, 10]).

    Args:
        logps, ref_logps: (N, T) log-probabilities of the sampled tokens under the policy and the reference.
    Returns:
        (N, T) estimates (padding positions are whatever the inputs hold there: mask them).
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {estimator!r}: choose one of {sorted(KL_ESTIMATORS)}")
    kind, log_ratio = KL_ESTIMATORS[estimator], ref_logps - logps
    if kind == "k1":
        return -log_ratio
    if kind == "abs":
        return log_ratio.abs()
    if kind == "k2":
        return 0.5 * log_ratio.square()
    log_ratio = log_ratio.clamp(-K3_LOG_RATIO_BOUND, K3_LOG_RATIO_BOUND)
    return (log_ratio.exp() - log_ratio - 1).clamp(-K3_ESTIMATE_BOUND, K3_ESTIMATE_BOUND)


def adaptive_kl_coef(coef: float, current_kl: float, target_kl: float, horizon: int, num_responses: int) -> float:
    """The next KL coefficient of the adaptive controller (Ziegler et al. 2019, as verl's AdaptiveKLController).

    beta <- beta * (1 + clip(KL / KL_target - 1, -0.2, 0.2) * n / horizon), with n the responses the KL was measured
    on: the coefficient grows while the measured KL is above target and shrinks below it, by at most 20% per horizon.
    """
    error = min(max(current_kl / target_kl - 1.0, -0.2), 0.2)
    return coef * (1.0 + error * num_responses / horizon)
