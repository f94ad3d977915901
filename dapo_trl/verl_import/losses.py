"""The policy loss: clipping, loss aggregation, the KL loss, the advantage; and KL in the reward."""

from __future__ import annotations

from .translation import APPROXIMATED, MAPPED, NOT_NEEDED, UNSUPPORTED, Translation, as_boolean, recipe_line

KL_IN_REWARD_KEYS = ("algorithm.use_kl_in_reward", "algorithm.kl_penalty", "algorithm.kl_ctrl.*")
# verl's kl_penalty names dapo-trl's kl_in_reward_estimator accepts ('+' variants differ in gradient only).
KL_IN_REWARD_ESTIMATORS = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")


# verl loss modes that fix their own aggregation (verl ignores loss_agg_mode for them): dapo-trl's loss_type, and why.
# The loss types are the rows of dapo_trl.algorithm.losses whose verl_name is the mode (checked in test_from_verl.py;
# not imported here, so that translating a script needs no torch).
OWN_LOSS_MODES = {
    "geo_mean": ("gmpo", "verl's geo_mean averages its per-sequence losses over the sequences, whatever loss_agg_mode"),
    "sapo": ("sapo", "verl's SAPO always aggregates seq-mean-token-mean, as dapo-trl's sapo does"),
}
LOSS_MODE_NOTES = {
    "geo_mean": "GMPO: the geometric mean of the token ratios, each token's log-ratio clipped to [-clip_ratio_low, "
    "clip_ratio_high] (epsilon / epsilon_high are log-space bounds for gmpo); equal to verl's to 1e-6 in "
    "tests/test_losses.py",
    "sapo": "SAPO: the soft gate sigmoid(tau (r - 1)) 4 / tau instead of the clip (tau_pos / tau_neg below)",
}


def map_loss(t: Translation) -> None:
    actor = "actor_rollout_ref.actor."
    # Clip-higher: verl's vanilla loss takes clip_ratio_low/high (defaults 0.2, not null), clip_ratio only as
    # their fallback when one of them is null.
    ratio = float(t.value(actor + "clip_ratio"))
    low_value, high_value = t.value(actor + "clip_ratio_low"), t.value(actor + "clip_ratio_high")
    low = ratio if low_value is None else float(low_value)
    high = ratio if high_value is None else float(high_value)
    t.set(epsilon=low, epsilon_high=high)
    loss_mode = str(t.value(actor + "policy_loss.loss_mode"))
    log_space = loss_mode == "geo_mean"  # GMPO clips log-ratios
    t.record(
        actor + "clip_ratio_low",
        MAPPED,
        recipe_line("epsilon", low),
        "lower clip of the log-ratio, -epsilon (gmpo)" if log_space else "lower clip 1 - epsilon",
    )
    t.record(
        actor + "clip_ratio_high",
        MAPPED,
        recipe_line("epsilon_high", high),
        "upper clip of the log-ratio, epsilon_high (gmpo)"
        if log_space
        else "upper clip 1 + epsilon_high (clip-higher); verl's default 0.2 differs from dapo-trl's 0.28",
    )
    used = low_value is None or high_value is None
    t.mark(
        actor + "clip_ratio",
        MAPPED if used else NOT_NEEDED,
        "epsilon / epsilon_high" if used else "",
        "fallback for a null clip_ratio_low/high"
        if used
        else "verl reads clip_ratio only when clip_ratio_low or clip_ratio_high is null (their defaults are 0.2)",
    )
    c = float(t.value(actor + "clip_ratio_c"))
    if loss_mode in OWN_LOSS_MODES or loss_mode == "gspo":  # verl's dual-clip belongs to its vanilla loss only
        t.set(clip_ratio_c=None)
        t.record(actor + "clip_ratio_c", NOT_NEEDED, "clip_ratio_c: null", f"verl's {loss_mode} loss does not read it")
    else:
        t.set(clip_ratio_c=c)
        t.record(
            actor + "clip_ratio_c",
            MAPPED,
            recipe_line("clip_ratio_c", c),
            "dual-clip for negative advantages; verl always applies it (default 3.0)",
        )

    mode = str(t.value(actor + "loss_agg_mode"))
    losses = {
        "token-mean": ("dapo", MAPPED, "token-level loss over the whole optimizer step (exact denominator)"),
        "seq-mean-token-mean": (
            "grpo",
            APPROXIMATED,
            "TRL's grpo: per-sequence token mean, averaged over "
            "sequences per micro-batch then over accumulation steps; equal to verl's mean over "
            "the mini-batch's sequences (micro-batches hold equal row counts, and token-budget "
            "passes weigh their share of the rows), except that sequences with no loss token are "
            "not left out of the mean",
        ),
        "seq-mean-token-sum": (
            "dr_grpo",
            APPROXIMATED,
            "TRL's dr_grpo: per-sequence token sum divided by "
            "max_completion_length, averaged over sequences: verl's seq-mean-token-sum divided "
            "by the constant max_completion_length (the same direction; gradient clipping and "
            "the effective learning rate see the smaller scale)",
        ),
        "seq-mean-token-sum-norm": (
            "dr_grpo",
            APPROXIMATED,
            "TRL's dr_grpo: token sum / (sequences x "
            "max_completion_length); verl divides the token sum by loss_scale_factor "
            "(default the response length) only: the same direction, scaled by a "
            "constant",
        ),
    }
    if loss_mode in OWN_LOSS_MODES:  # the loss mode fixes the aggregation: verl ignores loss_agg_mode
        loss_type, how = OWN_LOSS_MODES[loss_mode]
        t.set(loss_type=loss_type)
        t.record(actor + "loss_agg_mode", NOT_NEEDED, recipe_line("loss_type", loss_type), how)
    elif mode in losses:
        loss_type, status, how = losses[mode]
        t.set(loss_type=loss_type)
        t.record(actor + "loss_agg_mode", status, recipe_line("loss_type", loss_type), how)
    else:
        t.set(loss_type="dapo")
        t.mark(actor + "loss_agg_mode", UNSUPPORTED, "", f"unknown aggregation {mode!r}", blocking=True)
    t.mark(
        actor + "loss_scale_factor",
        NOT_NEEDED if mode != "seq-mean-token-sum-norm" else APPROXIMATED,
        how="used by seq-mean-token-sum-norm only; see loss_agg_mode",
    )

    if loss_mode == "vanilla":
        t.mark(actor + "policy_loss.loss_mode", MAPPED, "(PPO clip with dual-clip)", "verl's vanilla PPO loss")
    elif loss_mode in OWN_LOSS_MODES:
        loss_type = OWN_LOSS_MODES[loss_mode][0]
        t.mark(actor + "policy_loss.loss_mode", MAPPED, recipe_line("loss_type", loss_type), LOSS_MODE_NOTES[loss_mode])
        if loss_mode == "sapo":
            for key, field in (("tau_pos", "sapo_temperature_pos"), ("tau_neg", "sapo_temperature_neg")):
                value = float(t.value(actor + key))
                t.set(**{field: value})
                t.record(actor + key, MAPPED, recipe_line(field, value), "SAPO's gate temperature")
    elif loss_mode == "gspo":
        t.set(importance_sampling_level="sequence")
        t.mark(
            actor + "policy_loss.loss_mode",
            APPROXIMATED,
            "importance_sampling_level: sequence",
            "GSPO: the clipped ratio is the sequence's mean token log-ratio, exponentiated (TRL's sequence-level "
            "importance sampling: the loss and gradient of verl's GSPO-token with one advantage per sequence); "
            f"aggregated as loss_agg_mode says ({mode}); verl caps the sequence log-ratio at 10, dapo-trl caps each "
            "token's log-ratio at 20",
        )
    else:
        t.record(
            actor + "policy_loss.loss_mode",
            UNSUPPORTED,
            "",
            f"policy loss {loss_mode!r}: verl's vanilla, gspo, geo_mean and sapo losses are translated "
            "(dapo-trl's loss table: docs/losses.md)",
            blocking=True,
        )

    # KL loss (in the policy loss): TRL's beta uses the k3 estimator, verl's low_var_kl.
    use_kl = as_boolean(t.value(actor + "use_kl_loss"))
    coefficient = float(t.value(actor + "kl_loss_coef"))
    kind = str(t.value(actor + "kl_loss_type"))
    if not use_kl:
        t.set(beta=0.0)
        t.record(actor + "use_kl_loss", MAPPED, "beta: 0.0", "no KL loss")
        t.mark(actor + "kl_loss_coef", NOT_NEEDED, how="use_kl_loss is off")
        t.mark(actor + "kl_loss_type", NOT_NEEDED, how="use_kl_loss is off")
    elif kind in ("low_var_kl", "k3"):
        t.set(beta=coefficient)
        t.mark(actor + "use_kl_loss", MAPPED, recipe_line("beta", coefficient), "KL to the reference model in the loss")
        t.record(actor + "kl_loss_coef", MAPPED, recipe_line("beta", coefficient), "KL coefficient")
        t.record(
            actor + "kl_loss_type",
            APPROXIMATED,
            "(TRL's k3 estimator)",
            "k3 = low_var_kl; verl clamps each token's estimate to [-10, 10], TRL does not",
        )
    else:
        t.set(beta=coefficient)
        why = f"kl_loss_type={kind!r}: TRL's beta uses the k3 (low_var_kl) estimator only; " + (
            "the '+' variants take the k2 gradient (straight-through)"
            if kind.endswith("+")
            else "k1 (kl), abs, k2 (mse) and full have no counterpart"
        )
        t.record(actor + "kl_loss_type", UNSUPPORTED, "", why, blocking=True)
        t.mark(actor + "use_kl_loss", UNSUPPORTED, "", "see kl_loss_type", blocking=True)
        t.mark(actor + "kl_loss_coef", UNSUPPORTED, "", "see kl_loss_type", blocking=True)

    estimator = str(t.value("algorithm.adv_estimator"))
    if estimator == "grpo":
        t.mark("algorithm.adv_estimator", MAPPED, "(TRL's group-relative advantage)", "GRPO advantage")
    else:
        t.record(
            "algorithm.adv_estimator",
            UNSUPPORTED,
            "",
            f"advantage estimator {estimator!r}: only grpo (group-relative, no critic) has a counterpart",
            blocking=True,
        )
    normalise = as_boolean(t.value("algorithm.norm_adv_by_std_in_grpo"))
    t.set(scale_rewards="group" if normalise else "none")
    t.mark(
        "algorithm.norm_adv_by_std_in_grpo",
        MAPPED,
        recipe_line("scale_rewards", t.recipe["scale_rewards"]),
        "divide by the group's std (verl's epsilon 1e-6, TRL's 1e-4)" if normalise else "Dr.GRPO: no std",
    )
    if as_boolean(t.value("algorithm.use_pf_ppo")):
        t.mark("algorithm.use_pf_ppo", UNSUPPORTED, "", "policy-filtered PPO has no counterpart", blocking=True)
    else:
        t.mark("algorithm.use_pf_ppo", NOT_NEEDED, how="off")


def map_kl_in_reward(t: Translation) -> None:
    """KL in the reward: verl's use_kl_in_reward, kl_penalty and kl_ctrl.* -> DAPOConfig's kl_in_reward_* fields.

    The adaptive controller steps once per generation batch with its response count, as verl's steps once per
    rollout batch (train_batch_size x n responses; with dynamic sampling, once per gen_batch_size x n round); the batch
    translation keeps those sizes, so horizon and target carry over unchanged.
    """
    if not as_boolean(t.value("algorithm.use_kl_in_reward")):
        t.set(kl_in_reward=False)
        t.mark("algorithm.use_kl_in_reward", MAPPED, "kl_in_reward: false", "no KL in the reward")
        for pattern in KL_IN_REWARD_KEYS[1:]:
            t.mark_all(pattern, NOT_NEEDED, how="read only with use_kl_in_reward=True")
        return
    t.set(kl_in_reward=True)
    t.mark("algorithm.use_kl_in_reward", MAPPED, "kl_in_reward: true", "reward - beta x summed KL to the reference")
    estimator = str(t.value("algorithm.kl_penalty"))
    if estimator.rstrip("+") in KL_IN_REWARD_ESTIMATORS:
        t.set(kl_in_reward_estimator=estimator.rstrip("+"))
        status, how = MAPPED, "per-token KL estimate"
        if estimator.endswith("+"):  # verl's kl_penalty_forward does not know the '+' names: its run would stop
            status, how = (
                APPROXIMATED,
                (
                    "the '+' (straight-through) variant differs from its base in the gradient only, and the reward "
                    "carries none; verl itself raises NotImplementedError for it in the reward"
                ),
            )
        t.record("algorithm.kl_penalty", status, recipe_line("kl_in_reward_estimator", estimator.rstrip("+")), how)
    else:
        why = f"kl_penalty={estimator!r}: " + (
            "'full' needs every vocabulary log-prob (verl raises NotImplementedError too)"
            if estimator == "full"
            else f"unknown estimator; choose one of {', '.join(KL_IN_REWARD_ESTIMATORS)}"
        )
        t.record("algorithm.kl_penalty", UNSUPPORTED, "", why, blocking=True)
    coefficient = float(t.value("algorithm.kl_ctrl.kl_coef"))
    t.set(kl_in_reward_coef=coefficient)
    t.record("algorithm.kl_ctrl.kl_coef", MAPPED, recipe_line("kl_in_reward_coef", coefficient), "beta (start value)")
    kind = str(t.value("algorithm.kl_ctrl.type"))
    adaptive_keys = ("algorithm.kl_ctrl.target_kl", "algorithm.kl_ctrl.horizon")
    if kind not in ("fixed", "adaptive"):
        t.record("algorithm.kl_ctrl.type", UNSUPPORTED, "", f"unknown KL controller {kind!r}", blocking=True)
        return
    t.set(kl_in_reward_controller=kind)
    t.record("algorithm.kl_ctrl.type", MAPPED, recipe_line("kl_in_reward_controller", kind), f"{kind} beta")
    if kind == "fixed":
        for key in adaptive_keys:
            t.record(key, NOT_NEEDED, "", "read by the adaptive controller only")
        return
    target, horizon = float(t.value(adaptive_keys[0])), int(t.value(adaptive_keys[1]))
    t.set(kl_in_reward_target=target, kl_in_reward_horizon=horizon)
    t.record(adaptive_keys[0], MAPPED, recipe_line("kl_in_reward_target", target), "target mean per-token KL")
    t.record(adaptive_keys[1], MAPPED, recipe_line("kl_in_reward_horizon", horizon), "horizon in responses")
