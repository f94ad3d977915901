"""DAPO's math as pure tensor functions: no trainer state, each one testable against the paper's formula.

- `losses`: every policy loss the trainer trains, and the table of their traits (`POLICY_LOSSES`).
- `batches`: dynamic sampling's group filter, batch assembly, the exact step denominator.
- `overlong`: the soft overlong punishment (paper Eq. 13).
- `kl`: KL estimators (the KL in the reward and the KL loss term) and the adaptive KL controller.
- `rollout_correction`: the rollout rejection (verl's `rollout_rs`): tokens or responses whose pi_old / pi_rollout
  ratio leaves a band.
"""

from .batches import assemble_batch, concat_padded, group_keep_mask, trl_items_for_exact_normalizer
from .kl import KL_ESTIMATORS, adaptive_kl_coef, kl_penalty_per_token
from .losses import (
    LOG_RATIO_BOUND,
    POLICY_LOSSES,
    Aggregation,
    LossInputs,
    LossSettings,
    LossTerms,
    PolicyLoss,
    aggregate,
    clamped_log_ratio,
    policy_loss,
    ratio_log,
    register_policy_loss,
)
from .overlong import soft_overlong_penalty
from .rollout_correction import REJECTION_LEVELS, rejection_bounds, rejection_mask, rejection_statistic

__all__ = [
    "KL_ESTIMATORS",
    "LOG_RATIO_BOUND",
    "POLICY_LOSSES",
    "REJECTION_LEVELS",
    "Aggregation",
    "LossInputs",
    "LossSettings",
    "LossTerms",
    "PolicyLoss",
    "adaptive_kl_coef",
    "aggregate",
    "assemble_batch",
    "clamped_log_ratio",
    "concat_padded",
    "group_keep_mask",
    "kl_penalty_per_token",
    "policy_loss",
    "ratio_log",
    "register_policy_loss",
    "rejection_bounds",
    "rejection_mask",
    "rejection_statistic",
    "soft_overlong_penalty",
    "trl_items_for_exact_normalizer",
]
