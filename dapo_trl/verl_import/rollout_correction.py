"""verl's rollout correction (`algorithm.rollout_correction.*`): its importance weight, its rejection, bypass mode.

verl 0.6.1-0.7 name the rejection levels `token`, `sequence`, `geometric` with `rollout_rs_threshold` (an upper ratio
bound, which verl requires: its helper raises without one) and `rollout_rs_threshold_lower` (default 1 / upper), and
veto responses with `rollout_token_veto_threshold`. Later verl names the same ratio tests `token_k1`, `seq_sum_k1`,
`seq_mean_k1`, bounding -log(pi_old / pi_rollout) by the logs of `rollout_rs_threshold` = "lower_upper" (a number u:
"1/u_u"); that is pi_old / pi_rollout in [1 / upper, 1 / lower]. Both become `rollout_rejection`; the importance
weight (`rollout_is`) becomes TRL's `vllm_importance_sampling_*`; `bypass_mode` becomes `old_logprobs_source: engine`.
"""

from __future__ import annotations

from typing import Any

from .translation import APPROXIMATED, MAPPED, NOT_NEEDED, UNSUPPORTED, Translation, as_boolean, recipe_line

PREFIX = "algorithm.rollout_correction."  # verl's defaults for its keys: translation.VERL_DEFAULTS
IMPORTANCE_MODES = {"token": "token_truncate", "sequence": "sequence_truncate"}  # verl's rollout_is -> TRL's mode
RATIO_LEVELS = ("token", "sequence", "geometric")  # verl 0.6.1-0.7's rollout_rs: bounds on pi_old / pi_rollout
K1_LEVELS = {"token_k1": "token", "seq_sum_k1": "sequence", "seq_mean_k1": "geometric"}  # later verl: bounds on 1/r
DIVERGENCE_OPTIONS = ("token_k2", "token_k3", "seq_sum_k2", "seq_sum_k3", "seq_mean_k2", "seq_mean_k3")
DIVERGENCE_OPTIONS += ("seq_max_k2", "seq_max_k3")
DENOMINATOR = (
    "a rejected token's loss is multiplied by 0 but stays in the token denominator, where verl drops it from the "
    "loss mask: the same direction, the loss scaled by the kept share (1 - sampling/rollout_rejected_fraction)"
)


def map_rollout_correction(t: Translation) -> None:
    """After `map_rollout` (which sets use_vllm and turns TRL's importance weight off unless mapped here)."""
    level, rejection = t.value(PREFIX + "rollout_is"), t.value(PREFIX + "rollout_rs")
    bypass = as_boolean(t.value(PREFIX + "bypass_mode"))
    if level is None and rejection is None and not bypass:
        t.mark_all(PREFIX + "*", NOT_NEEDED, how="rollout correction off (rollout_is, rollout_rs unset, no bypass)")
        return
    if not t.recipe.get("use_vllm"):
        why = (
            "rollout correction compares the trainer's log-probs with the rollout engine's sampling log-probs, which "
            f"verl's {t.value('actor_rollout_ref.rollout.name')} rollout (transformers' generate here) does not "
            "return: use rollout.name=vllm"
        )
        on = {"rollout_is": level is not None, "rollout_rs": rejection is not None, "bypass_mode": bypass}
        for name in [name for name, set_on in on.items() if set_on]:
            t.mark(PREFIX + name, UNSUPPORTED, "", why, blocking=True)
        t.mark_all(PREFIX + "*", NOT_NEEDED, how="see rollout_is / rollout_rs / bypass_mode")
        return
    _map_bypass(t, bypass)
    _map_importance_weight(t, level, bypass)
    _map_rejection(t, rejection, bypass)
    t.mark_all(PREFIX + "*", UNSUPPORTED, "", "not recognised by the translator: check whether it matters for your run")


def _map_bypass(t: Translation, bypass: bool) -> None:
    loss_key, legacy_key = PREFIX + "loss_type", PREFIX + "use_policy_gradient"
    if not bypass:
        t.mark(PREFIX + "bypass_mode", NOT_NEEDED, "old_logprobs_source: trainer", "decoupled mode: pi_old scored")
        t.mark(loss_key, NOT_NEEDED, how="read in bypass mode only")
        t.mark(legacy_key, NOT_NEEDED, how="read in bypass mode only")
        return
    t.set(old_logprobs_source="engine")
    t.mark(
        PREFIX + "bypass_mode",
        MAPPED,
        "old_logprobs_source: engine",
        "pi_old is the engine's sampling log-probs (no scoring forward): the clipped ratio is pi_theta / pi_rollout",
    )
    reinforce = str(t.value(loss_key)) == "reinforce" or as_boolean(t.value(legacy_key))
    if not reinforce and str(t.value(loss_key)) == "ppo_clip":
        t.record(loss_key, MAPPED, recipe_line("loss_type", t.recipe.get("loss_type")), "bypass mode's clipped loss")
        t.mark(legacy_key, NOT_NEEDED, how="off: the clipped loss")
        return
    why = (
        "verl's bypass REINFORCE loss (-sg(w) A log pi, no clip) is not translated; its loss_type=ppo_clip (the "
        "clipped loss) is. dapo-trl's cispo (-sg(min(r, epsilon_high)) A log pi) is its token-level truncated form"
        if reinforce
        else f"unknown bypass loss_type {t.value(loss_key)!r}: verl has ppo_clip and reinforce"
    )
    for key in (loss_key, legacy_key):
        if t.given(key):
            t.mark(key, UNSUPPORTED, "", why, blocking=True)


def _map_importance_weight(t: Translation, level: Any, bypass: bool) -> None:
    key, threshold_key = PREFIX + "rollout_is", PREFIX + "rollout_is_threshold"
    normalise_key = PREFIX + "rollout_is_batch_normalize"
    threshold = float(t.value(threshold_key))
    if level is None or bypass:
        why = (
            "verl's bypass PPO-clip applies no importance weight (the ratio pi_theta / pi_rollout holds it): "
            "rollout_is only sets verl's metrics"
            if level is not None
            else "no importance weight"
        )
        t.set(vllm_importance_sampling_correction=False)
        t.mark(key, NOT_NEEDED, "vllm_importance_sampling_correction: false", why)
        t.mark(threshold_key, NOT_NEEDED, how="no importance weight")
        t.mark(normalise_key, NOT_NEEDED, how="no importance weight")
        return
    if str(level) not in IMPORTANCE_MODES:
        t.mark(key, UNSUPPORTED, "", f"rollout_is={level!r}: verl has token and sequence", blocking=True)
        return
    mode = IMPORTANCE_MODES[str(level)]
    t.set(
        vllm_importance_sampling_correction=True,
        vllm_importance_sampling_mode=mode,
        vllm_importance_sampling_clip_max=threshold,
        vllm_importance_sampling_clip_min=None,
    )
    t.mark(
        key,
        MAPPED,
        f"vllm_importance_sampling_correction: true, vllm_importance_sampling_mode: {mode}",
        "TRL's truncated importance weight min(w, C) times the loss, w = pi_old / pi_rollout "
        + ("per token" if mode.startswith("token") else "per response (the product of its token ratios)")
        + ", no lower bound, as verl's",
    )
    t.record(
        threshold_key,
        MAPPED,
        recipe_line("vllm_importance_sampling_clip_max", threshold),
        "the weight's cap C",
    )
    if as_boolean(t.value(normalise_key)):
        why = "rescaling the weights to mean 1 over the batch has no counterpart in TRL's importance weight"
        t.mark(normalise_key, UNSUPPORTED, "", why, blocking=True)
    else:
        t.mark(normalise_key, NOT_NEEDED, how="off")


def _map_rejection(t: Translation, rejection: Any, bypass: bool) -> None:
    key, threshold_key = PREFIX + "rollout_rs", PREFIX + "rollout_rs_threshold"
    lower_key, veto_key = PREFIX + "rollout_rs_threshold_lower", PREFIX + "rollout_token_veto_threshold"
    veto = t.value(veto_key)
    if veto is not None:
        why = (
            "verl 0.7's veto (drop a whole response holding a token with pi_old / pi_rollout below it) is not "
            "translated; rollout_rejection: token with rollout_rejection_lower drops such tokens alone"
        )
        t.mark(veto_key, UNSUPPORTED, "", why, blocking=True)
    if rejection is None:
        for name in (threshold_key, lower_key):
            t.mark(name, NOT_NEEDED, how="no rejection (rollout_rs unset)")
        return
    options = list(dict.fromkeys(part.strip() for part in str(rejection).split(",") if part.strip()))
    refused = _refusal(options)
    if refused:
        t.mark(key, UNSUPPORTED, "", refused, blocking=True)
        t.mark(threshold_key, UNSUPPORTED, "", "see rollout_rs", blocking=True)
        t.mark(lower_key, UNSUPPORTED, "", "see rollout_rs", blocking=True)
        return
    (option,) = options
    bounds = _bounds(t, option)
    if isinstance(bounds, str):
        t.mark(key, UNSUPPORTED, "", bounds, blocking=True)
        t.mark(threshold_key, UNSUPPORTED, "", bounds, blocking=True)
        return
    lower, upper, how = bounds
    level = K1_LEVELS.get(option, option)
    t.set(rollout_rejection=level, rollout_rejection_lower=lower, rollout_rejection_upper=upper)
    tested = {
        "token": "each token's pi_old / pi_rollout",
        "sequence": "the response's ratio prod_t pi_old / pi_rollout (whole response)",
        "geometric": "the geometric mean exp(mean_t log(pi_old / pi_rollout)) (whole response)",
    }[level]
    where = "; in bypass mode pi_theta / pi_rollout at each update, as verl's" if bypass else ""
    t.mark(
        key,
        APPROXIMATED,
        recipe_line("rollout_rejection", level),
        f"rejects what leaves [lower, upper]: {tested}{where}; {DENOMINATOR}",
    )
    t.mark(threshold_key, MAPPED, f"rollout_rejection_lower: {lower}, rollout_rejection_upper: {upper}", how)
    if option in RATIO_LEVELS:
        t.mark(lower_key, MAPPED, recipe_line("rollout_rejection_lower", lower), "the lower ratio bound")
    else:
        t.mark(lower_key, NOT_NEEDED, how=f"{option} reads its lower bound from rollout_rs_threshold ('lower_upper')")


def _refusal(options: list[str]) -> str:
    """Why verl's rollout_rs options cannot be translated ('' when they can)."""
    if len(options) != 1:
        return (
            f"rollout_rs={','.join(options)!r}: several rejection criteria at once; dapo-trl applies one "
            "(rollout_rejection: token, sequence or geometric)"
        )
    option = options[0]
    if option in RATIO_LEVELS or option in K1_LEVELS:
        return ""
    if option in DIVERGENCE_OPTIONS:
        return (
            f"rollout_rs={option!r}: a bound on a divergence estimate (k2 = (log r)^2 / 2, k3 = r - 1 - log r) is not "
            "translated; the ratio bands are (token_k1, seq_sum_k1, seq_mean_k1; verl 0.7's token, sequence, geometric)"
        )
    return f"rollout_rs={option!r}: unknown option; verl has {', '.join([*RATIO_LEVELS, *K1_LEVELS])} and k2/k3 bounds"


def _bounds(t: Translation, option: str) -> tuple[float, float, str] | str:
    """(lower, upper, how) on pi_old / pi_rollout from verl's thresholds, or why they cannot be read."""
    spec = t.value(PREFIX + "rollout_rs_threshold")
    if spec is None:
        return (
            f"rollout_rs={option!r} without rollout_rs_threshold: verl stops ('rollout_rs_threshold must be provided "
            "for rejection sampling'); set it (verl's presets: 2.0 for token and sequence, 1.001 for geometric)"
        )
    text = str(spec).strip()
    try:
        if option in RATIO_LEVELS:  # verl 0.6.1-0.7: a number, the upper bound on pi_old / pi_rollout
            upper = float(text)
            lower_value = t.value(PREFIX + "rollout_rs_threshold_lower")
            lower = 1.0 / upper if lower_value is None else float(lower_value)
            how = "the ratio band" + ("" if lower_value is not None else " (lower: verl's default 1 / upper)")
        else:  # later verl: "lower_upper" bounds on pi_rollout / pi_old, or one number u for [1/u, u]
            low_text, _, high_text = text.rpartition("_") if "_" in text else ("", "", text)
            high = float(high_text)
            low = 1.0 / high if not low_text else float(low_text)
            lower, upper = 1.0 / high, 1.0 / low
            how = (
                f"verl bounds -log(pi_old / pi_rollout) by [log {low:g}, log {high:g}]: pi_old / pi_rollout in "
                f"[1/{high:g}, 1/{low:g}]"
            )
    except (ValueError, ZeroDivisionError):
        return f"rollout_rs_threshold={text!r} is not a positive number or 'lower_upper' pair of them"
    if not 0.0 < lower <= upper:
        return f"rollout_rs_threshold={text!r}: the ratio band [{lower:g}, {upper:g}] is empty or not positive"
    return lower, upper, how
