"""DAPOConfig's checks, one function per feature: each raises ValueError naming the field and the fix.

`DAPOConfig.__post_init__` runs `check_all` after GRPOConfig's own post-init and the derived fields.
"""

from __future__ import annotations

from typing import Any

from ..algorithm import KL_ESTIMATORS, POLICY_LOSSES, REJECTION_LEVELS, policy_loss, rejection_bounds

DAPOConfig = Any  # `dapo_trl.config.DAPOConfig`, which imports this module (so not imported back)
OLD_LOGPROBS_SOURCES = ("trainer", "engine", "interpolated")  # where the loss's pi_old comes from


def check_all(config: DAPOConfig) -> None:
    """Every check, in the order the fields depend on each other."""
    check_lengths(config)
    check_overlong_penalty(config)
    check_loss(config)
    check_old_logprobs(config)
    check_kl_in_reward(config)
    check_padding_free(config)
    check_dynamic_sampling(config)
    check_validation(config)
    check_vllm(config)
    check_rollout_rejection(config)
    check_rollout(config)
    check_routing_replay(config)
    check_preemption(config)
    check_recovery(config)


def check_lengths(config: DAPOConfig) -> None:
    if config.temperature <= 0.0:
        raise ValueError(f"temperature={config.temperature} must be > 0 (DAPO samples at 1.0).")
    if config.max_completion_length is None or config.max_completion_length < 1:
        raise ValueError(f"max_completion_length={config.max_completion_length} must be a positive integer.")
    if config.max_prompt_length is not None and config.max_prompt_length < 1:
        raise ValueError(f"max_prompt_length={config.max_prompt_length} must be a positive integer or None.")
    if config.overlong_prompt_policy not in ("filter", "error"):
        raise ValueError(f"overlong_prompt_policy={config.overlong_prompt_policy!r} must be 'filter' or 'error'.")


def check_overlong_penalty(config: DAPOConfig) -> None:
    if not config.apply_overlong_penalty:
        return
    if not 0 < config.overlong_buffer_len <= config.max_completion_length:
        raise ValueError(
            f"overlong_buffer_len={config.overlong_buffer_len} must be in [1, max_completion_length="
            f"{config.max_completion_length}]: lower it or raise max_completion_length "
            "(the paper uses 4096 with 20480), or pass --apply_overlong_penalty false."
        )
    if config.overlong_penalty_factor < 0.0:
        raise ValueError(
            f"overlong_penalty_factor={config.overlong_penalty_factor} must be >= 0 (DAPO: 1.0); "
            "a negative factor would reward long answers."
        )


def check_loss(config: DAPOConfig) -> None:
    """The loss type, its ratio level and its clipping, as the loss table (`algorithm.losses`) describes them."""
    loss = policy_loss(config.loss_type)
    level = config.importance_sampling_level
    if level not in ("token", "sequence"):
        raise ValueError(f"importance_sampling_level={level!r} must be 'token' or 'sequence' (GSPO's).")
    if level not in loss.ratio_levels:
        raise ValueError(
            f"loss_type={loss.name!r} builds its own sequence weight from the token ratios: set "
            "importance_sampling_level: token (the default)."
        )
    if not 0.0 <= config.epsilon < 1.0:
        raise ValueError(f"epsilon={config.epsilon} must be in [0, 1) (DAPO: 0.2).")
    if config.epsilon_high is not None and config.epsilon_high < 0.0:
        raise ValueError(f"epsilon_high={config.epsilon_high} must be >= 0 (DAPO: 0.28).")
    if config.clip_ratio_c is None:
        return
    if not loss.dual_clip:
        clipped = sorted(name for name, row in POLICY_LOSSES.items() if row.dual_clip)
        raise ValueError(
            f"clip_ratio_c (dual-clip) needs a loss_type with a clipped ratio {clipped}, got {config.loss_type!r}: "
            "unset clip_ratio_c."
        )
    upper = 1.0 + (config.epsilon_high if config.epsilon_high is not None else config.epsilon)
    if config.clip_ratio_c <= upper:
        raise ValueError(
            f"clip_ratio_c={config.clip_ratio_c} must be > 1 + epsilon_high = {upper} "
            "(verl default 3.0, its DAPO and ReTool recipes 10.0)."
        )


def check_old_logprobs(config: DAPOConfig) -> None:
    """pi_old from the engine needs an engine that sends its sampling log-probs (`algorithm.proximal`)."""
    source = config.old_logprobs_source
    if source not in OLD_LOGPROBS_SOURCES:
        raise ValueError(
            f"old_logprobs_source={source!r}: choose one of {', '.join(OLD_LOGPROBS_SOURCES)} ('trainer' is TRL's "
            "scoring forward)."
        )
    if source != "trainer":
        what = f"old_logprobs_source={source!r} takes pi_old from the engine's sampling log-probs"
        check_engine_log_probs(config, what, "keep old_logprobs_source: trainer")


def check_engine_log_probs(config: DAPOConfig, what: str, otherwise: str) -> None:
    """A setting that reads the engine's sampling log-probs (`what` it does with them) needs an engine that sends
    them: vLLM, or a streaming engine; transformers' generate sends none."""
    if not (config.use_vllm or config.rollout_streaming):
        raise ValueError(
            f"{what}, and transformers' generate sends none: pass --use_vllm true (or --rollout_streaming true with "
            f"your own engine), or {otherwise}."
        )


def check_kl_in_reward(config: DAPOConfig) -> None:
    if not config.kl_in_reward:
        return
    if config.kl_in_reward_estimator.rstrip("+") not in KL_ESTIMATORS:
        raise ValueError(
            f"kl_in_reward_estimator={config.kl_in_reward_estimator!r} must be one of {sorted(KL_ESTIMATORS)} "
            "(verl's 'full' needs every vocabulary log-prob, which verl does not implement either)."
        )
    if config.multi_objective_aggregation == "normalize_then_sum":
        raise ValueError(
            "kl_in_reward with multi_objective_aggregation='normalize_then_sum' would standardise the KL column "
            "within each group, so kl_in_reward_coef (and the adaptive target) would lose their meaning: use "
            "'sum_then_normalize' (TRL's default; verl subtracts the KL before its group normalisation)."
        )
    if config.kl_in_reward_coef < 0:
        raise ValueError(f"kl_in_reward_coef={config.kl_in_reward_coef} must be >= 0 (verl's default 0.001).")
    if config.sync_ref_model and config.beta == 0.0:
        raise ValueError("sync_ref_model with kl_in_reward needs beta > 0 (TRL syncs only its KL loss' reference).")
    if config.kl_in_reward_controller not in ("fixed", "adaptive"):
        raise ValueError(f"kl_in_reward_controller={config.kl_in_reward_controller!r} must be 'fixed' or 'adaptive'.")
    if config.kl_in_reward_target <= 0 or config.kl_in_reward_horizon < 1:
        raise ValueError(
            f"kl_in_reward_target={config.kl_in_reward_target} must be > 0 and kl_in_reward_horizon="
            f"{config.kl_in_reward_horizon} >= 1 (verl's defaults 0.1 and 10000)."
        )


def check_padding_free(config: DAPOConfig) -> None:
    if config.max_tokens_per_microbatch is not None and config.max_tokens_per_microbatch < 1:
        raise ValueError(
            f"max_tokens_per_microbatch={config.max_tokens_per_microbatch} must be a positive token count or None."
        )
    if config.max_tokens_per_microbatch is not None and not config.padding_free:
        raise ValueError("max_tokens_per_microbatch needs padding_free=true (it splits rows by real tokens).")
    if not isinstance(config.sequence_parallel_size, int) or config.sequence_parallel_size < 1:
        raise ValueError(f"sequence_parallel_size={config.sequence_parallel_size} must be an integer >= 1 (1 = off).")
    if config.sequence_parallel_size > 1 and not config.padding_free:
        raise ValueError(
            "sequence_parallel_size > 1 needs padding_free=true: sequence parallelism shards each forward's "
            "packed sequence of real tokens (remove --padding_free false)."
        )
    if config.sequence_parallel_size > 1 and config.use_liger_kernel:
        raise ValueError(
            "sequence_parallel_size > 1 does not run with use_liger_kernel: Liger's GRPO loss runs its own "
            "forward, which sequence parallelism cannot shard (set use_liger_kernel=false)."
        )


def check_dynamic_sampling(config: DAPOConfig) -> None:
    if config.max_filter_gen_batches < 0:
        raise ValueError(f"max_filter_gen_batches={config.max_filter_gen_batches} must be >= 0 (0 = unlimited).")
    if config.filter_groups_oversample < 1:
        raise ValueError(f"filter_groups_oversample={config.filter_groups_oversample} must be an integer >= 1.")
    if config.filter_groups_on_exhausted not in ("fill", "error"):
        raise ValueError(f"filter_groups_on_exhausted={config.filter_groups_on_exhausted!r} must be 'fill' or 'error'.")
    if config.filter_groups_atol < 0:
        raise ValueError(f"filter_groups_atol={config.filter_groups_atol} must be >= 0.")
    if config.filter_groups_shuffle_buffer_size < 1:
        size = config.filter_groups_shuffle_buffer_size
        raise ValueError(f"filter_groups_shuffle_buffer_size={size} must be >= 1 (rows held to shuffle a stream).")
    check_prompt_triage(config)


def check_prompt_triage(config: DAPOConfig) -> None:
    if not config.prompt_triage:
        return
    if not config.filter_groups_enable:
        raise ValueError(
            "prompt_triage=true skips prompts whose groups dynamic sampling would drop: it needs "
            "filter_groups_enable=true (or set prompt_triage=false)."
        )
    if not 0 < config.prompt_triage_target_zero_variance < 1:
        target = config.prompt_triage_target_zero_variance
        raise ValueError(f"prompt_triage_target_zero_variance={target} must be in (0, 1) (a share of groups).")
    if not 0 < config.prompt_triage_exploration_floor <= 1:
        floor = config.prompt_triage_exploration_floor
        raise ValueError(f"prompt_triage_exploration_floor={floor} must be in (0, 1] (a probability).")
    if not 0 <= config.prompt_triage_min_agreement <= 1:
        agreement = config.prompt_triage_min_agreement
        raise ValueError(
            f"prompt_triage_min_agreement={agreement} must be in [0, 1] (a share of streaks that lasted; 0 acts on "
            "every streak, as GRESO)."
        )


def check_validation(config: DAPOConfig) -> None:
    if config.eval_num_samples < 1:
        raise ValueError(f"eval_num_samples={config.eval_num_samples} must be >= 1.")
    if config.eval_temperature <= 0 or not 0 < config.eval_top_p <= 1:
        raise ValueError(
            f"eval_temperature={config.eval_temperature} must be > 0 and eval_top_p={config.eval_top_p} in (0, 1]."
        )


def check_rollout_rejection(config: DAPOConfig) -> None:
    """verl's rollout rejection (`algorithm.rollout_correction`): a level, a band containing positive ratios, and an
    engine that sends its sampling log-probs."""
    level, lower, upper = config.rollout_rejection, config.rollout_rejection_lower, config.rollout_rejection_upper
    if level is None:
        if lower is not None or upper is not None:
            raise ValueError(
                "rollout_rejection_lower / rollout_rejection_upper are set but rollout_rejection is None: set "
                f"rollout_rejection to one of {', '.join(REJECTION_LEVELS)}, or unset the bounds."
            )
        return
    if level not in REJECTION_LEVELS:
        raise ValueError(f"rollout_rejection={level!r}: choose one of {', '.join(REJECTION_LEVELS)}, or None (off).")
    if upper is None:
        raise ValueError(
            f"rollout_rejection={level!r} needs rollout_rejection_upper, the largest ratio pi_old / pi_rollout kept "
            "(verl requires its rollout_rs_threshold too; its presets use 2.0 for token and sequence, 1.001 for "
            "geometric)."
        )
    if upper <= 0.0 or not 0.0 < rejection_bounds(upper, lower)[0] <= upper:
        raise ValueError(
            f"rollout_rejection_lower={lower} and rollout_rejection_upper={upper} must satisfy 0 < lower <= upper "
            "(ratios pi_old / pi_rollout; lower unset is 1 / upper, so upper must then be >= 1)."
        )
    what = f"rollout_rejection={level!r} compares the trainer's log-probs with the engine's sampling log-probs"
    check_engine_log_probs(config, what, "unset rollout_rejection")


def check_vllm(config: DAPOConfig) -> None:
    if config.vllm_weight_sync not in ("nccl", "shared_storage"):
        raise ValueError(f"vllm_weight_sync={config.vllm_weight_sync!r} must be 'nccl' or 'shared_storage'.")
    if config.vllm_weight_sync == "shared_storage" and not (config.use_vllm and config.vllm_mode == "server"):
        raise ValueError(
            "vllm_weight_sync='shared_storage' syncs a separate vLLM server: also pass --use_vllm true "
            "--vllm_mode server (colocate mode shares the weights in memory)."
        )
    if config.vllm_request_timeout <= 0:
        raise ValueError(f"vllm_request_timeout={config.vllm_request_timeout} must be > 0 seconds.")


def check_rollout(config: DAPOConfig) -> None:
    if config.rollout_max_staleness < 0:
        raise ValueError(f"rollout_max_staleness={config.rollout_max_staleness} must be >= 0 (0 = synchronous).")
    if config.rollout_max_in_flight_groups is not None and config.rollout_max_in_flight_groups < 1:
        raise ValueError(f"rollout_max_in_flight_groups={config.rollout_max_in_flight_groups} must be >= 1 or None.")
    if config.rollout_lookahead_rounds < 0:
        raise ValueError(f"rollout_lookahead_rounds={config.rollout_lookahead_rounds} must be >= 0.")
    if not config.rollout_streaming:
        if config.rollout_in_flight_weight_updates:
            raise ValueError(
                "rollout_in_flight_weight_updates=true updates the weights under the streaming rollout's requests: "
                "also pass --rollout_streaming true --rollout_max_staleness 1 (with a vLLM server)."
            )
        if config.rollout_max_staleness > 0:
            raise ValueError(
                "rollout_max_staleness > 0 overlaps streamed generation with training: also pass "
                "--rollout_streaming true (with a vLLM server)."
            )
        return
    if config.use_vllm and config.vllm_mode == "colocate":
        if config.rollout_max_staleness > 0:
            raise ValueError(
                "rollout_max_staleness > 0 generates while the trainer trains, which needs the engine on devices "
                "of its own: use a vLLM server (--vllm_mode server), or rollout_max_staleness 0 with colocate."
            )
        if config.vllm_enable_sleep_mode:
            raise ValueError(
                "rollout_streaming with colocated vLLM keeps the engine awake while a batch streams: turn "
                "--vllm_enable_sleep_mode off, or stream from a vLLM server (--vllm_mode server)."
            )
        if config.vllm_tensor_parallel_size > 1:
            raise ValueError(
                "rollout_streaming with colocated vLLM drives one engine per process, and a tensor-parallel "
                "engine spans processes: use --vllm_tensor_parallel_size 1, or a vLLM server (--vllm_mode server)."
            )
    if config.kl_in_reward and config.kl_in_reward_controller == "adaptive":
        raise ValueError(
            "rollout_streaming scores each round in parts as they finish, and the adaptive KL controller would "
            "update once per part: use kl_in_reward_controller='fixed' with streaming."
        )
    if config.rollout_in_flight_kv_cache not in ("recompute", "keep"):
        raise ValueError(
            f"rollout_in_flight_kv_cache={config.rollout_in_flight_kv_cache!r} must be 'recompute' or 'keep'."
        )
    if config.rollout_in_flight_weight_updates and config.rollout_max_staleness < 1:
        raise ValueError(
            "rollout_in_flight_weight_updates=true loads a version while the previous one's requests run, which only "
            "happens when generation overlaps training: pass --rollout_max_staleness 1 (or more)."
        )
    if config.rollout_max_staleness > 0:
        if (
            config.use_vllm
            and config.vllm_weight_sync != "shared_storage"
            and not config.rollout_in_flight_weight_updates
        ):
            raise ValueError(
                "rollout_max_staleness > 0 over NCCL needs --rollout_in_flight_weight_updates true (the current "
                "weights are sent under the running requests: NCCL only pushes the current ones); or use "
                "--vllm_weight_sync shared_storage (the server loads the weights of k versions ago, which the "
                "trainer writes to vllm_weight_sync_dir/v<version>)."
            )
        if config.rollout_in_flight_weight_updates and not (config.use_vllm and config.vllm_mode == "server"):
            raise ValueError(
                "rollout_in_flight_weight_updates=true pauses a vLLM server with its requests kept while it loads a "
                "version: pass --use_vllm true --vllm_mode server."
            )
        if config.use_vllm and not config.vllm_importance_sampling_correction:
            raise ValueError(
                "rollout_max_staleness > 0 trains rows sampled by weights k versions old: it needs "
                "--vllm_importance_sampling_correction true (the truncated weight pi_proximal / pi_behaviour; "
                "--vllm_importance_sampling_mode token_truncate is AReaL's decoupled objective)."
            )


def check_routing_replay(config: DAPOConfig) -> None:
    """Routing replay needs each sampled token's routing from the engine, and forwards that can carry it."""
    if not config.routing_replay:
        return
    if not config.rollout_streaming:
        raise ValueError(
            "routing_replay=true needs rollout_streaming=true: the streaming rollout's engine returns each token's "
            "routed experts (vLLM: serve with --enable-return-routed-experts), TRL's generation does not."
        )
    if not config.padding_free:
        raise ValueError("routing_replay=true needs padding_free=true: the replayed routing rides the packed forwards.")
    if config.sequence_parallel_size > 1:
        raise ValueError(
            "routing_replay=true does not run with sequence_parallel_size > 1 yet: set sequence_parallel_size=1, or "
            "routing_replay=false (the router's auxiliary loss does run sharded)."
        )


def check_recovery(config: DAPOConfig) -> None:
    if config.vllm_server_recovery_timeout < 0:
        raise ValueError(
            f"vllm_server_recovery_timeout={config.vllm_server_recovery_timeout} must be >= 0 (0 = fail at once "
            "when the vLLM server goes away)."
        )


def check_preemption(config: DAPOConfig) -> None:
    from ..training.faults.preemption import parse_signals

    parse_signals(config.preemption_signals)  # names the field on a bad signal name
    if config.preemption_grace_seconds <= 0:
        raise ValueError(
            f"preemption_grace_seconds={config.preemption_grace_seconds} must be > 0 (seconds between a preemption "
            "signal and the exit); to ignore preemption, set --preemption_signals ''."
        )
