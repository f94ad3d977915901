"""The sections of docs/config.md (`reference`): each DAPOConfig field's place on the page, by concern. A new
field must be placed here: the page is not written while one is in no group (`reference.placement_problems`).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Group:
    """One section of the page: its title, a sentence on where to read more, and the fields it documents in order."""

    title: str
    intro: str
    fields: tuple[str, ...]
    trl_fields: str = ""  # "script" or "model": also name the TRL dataclass's fields that belong to this concern


GROUPS: tuple[Group, ...] = (
    Group(
        "The DAPO objective",
        "The clipped token-level loss. Its main knobs are TRL's GRPOConfig fields `loss_type`, `epsilon`, "
        "`epsilon_high`, `beta`, `entropy_coef` and `mask_truncated_completions`; every loss, its formula and its verl "
        "name: [losses.md](losses.md).",
        ("clip_ratio_c", "entropy_coeff", "old_logprobs_source"),
    ),
    Group(
        "KL in the reward",
        "verl's `algorithm.use_kl_in_reward` (not part of DAPO): the response's KL to the reference model subtracted "
        "from its reward before the group advantage. Independent of TRL's `beta` (KL in the loss).",
        (
            "kl_in_reward",
            "kl_in_reward_coef",
            "kl_in_reward_estimator",
            "kl_in_reward_controller",
            "kl_in_reward_target",
            "kl_in_reward_horizon",
        ),
    ),
    Group(
        "Dynamic sampling",
        "Groups whose accuracy has no spread are dropped and the batch is refilled from fresh prompts: "
        "[dynamic-sampling.md](dynamic-sampling.md).",
        (
            "filter_groups_enable",
            "max_filter_gen_batches",
            "filter_groups_oversample",
            "filter_groups_on_exhausted",
            "filter_groups_carry_surplus",
            "prompt_triage",
            "prompt_triage_target_zero_variance",
            "prompt_triage_exploration_floor",
            "prompt_triage_min_agreement",
            "filter_groups_atol",
            "filter_groups_shuffle_buffer_size",
            "accuracy_reward_name",
        ),
    ),
    Group(
        "Overlong prompts and responses",
        "Prompt length (TRL 1.16 dropped `max_prompt_length`) and the soft overlong punishment of the paper's Eq. 13; "
        "the response length itself is TRL's `max_completion_length`, overlong filtering TRL's "
        "`mask_truncated_completions`.",
        (
            "max_prompt_length",
            "overlong_prompt_policy",
            "apply_overlong_penalty",
            "overlong_buffer_len",
            "overlong_penalty_factor",
        ),
    ),
    Group(
        "Rollout on vLLM",
        "How a vLLM server gets the new weights and how long it may stall. The fields that choose vLLM and its mode "
        "(`use_vllm`, `vllm_mode`, `vllm_server_host`, ...) are TRL's: "
        "[scaling-out.md](scaling-out.md#vllm-server-mode-and-weight-sync).",
        ("vllm_weight_sync", "vllm_weight_sync_dir", "vllm_weight_sync_server_dir", "vllm_request_timeout"),
    ),
    Group(
        "Rollout correction",
        "The trainer/engine mismatch (verl's `algorithm.rollout_correction`): the truncated importance weight is TRL's "
        "(`vllm_importance_sampling_correction`, `vllm_importance_sampling_mode`, `vllm_importance_sampling_clip_max`, "
        "`vllm_importance_sampling_clip_min`), the rejection DAPO-TRL's: [losses.md](losses.md#rollout-correction).",
        ("rollout_rejection", "rollout_rejection_upper", "rollout_rejection_lower"),
    ),
    Group(
        "Streaming rollout and staleness",
        "Dynamic sampling group by group on vLLM, and generation overlapped with training: [rollout.md](rollout.md).",
        (
            "rollout_streaming",
            "rollout_max_staleness",
            "rollout_in_flight_weight_updates",
            "rollout_in_flight_kv_cache",
            "rollout_max_in_flight_groups",
            "rollout_lookahead_rounds",
        ),
    ),
    Group(
        "Batching and long context",
        "Padding-free forwards, token budgets and Ulysses sequence parallelism for long responses: "
        "[long-context.md](long-context.md).",
        ("padding_free", "max_tokens_per_microbatch", "sequence_parallel_size"),
    ),
    Group(
        "Mixture-of-experts policies",
        "TRL's `router_aux_loss_coef` weighs the router's auxiliary loss; routing replay is DAPO-TRL's: "
        "[moe.md](moe.md).",
        ("routing_replay",),
    ),
    Group(
        "Fault handling and checkpoints",
        "Preemption and a vLLM server that goes away; saving and resuming are TrainingArguments' fields (`save_steps`, "
        "`resume_from_checkpoint`, which also takes `latest`): [reliability.md](reliability.md).",
        ("preemption_signals", "preemption_grace_seconds", "vllm_server_recovery_timeout"),
    ),
    Group(
        "Validation",
        "avg@n and pass@k per data source, every `eval_steps` (TrainingArguments' `eval_strategy` / `eval_steps`): "
        "[validation.md](validation.md).",
        (
            "eval_dataset_name",
            "eval_num_samples",
            "eval_temperature",
            "eval_top_p",
            "eval_max_new_tokens",
            "eval_samples_to_log",
            "val_before_train",
        ),
    ),
    Group(
        "Logging and charts",
        "Where metrics go is TrainingArguments' `report_to` (DAPO's default: tensorboard), how often its "
        "`logging_steps`; every metric and chart: [metrics.md](metrics.md).",
        ("plot",),
    ),
    Group(
        "Data",
        "The training set and how its rows become prompts: [data.md](data.md).",
        ("dataset_name", "prompt_column", "answer_column", "prompt_template", "skip_malformed_rows")
        + ("dataset_test_split", "dataset_streaming", "ignore_bias_buffers"),  # refused when set
        trl_fields="script",
    ),
    Group(
        "Rewards",
        "Built-in scorers, verl-style and your own rewards, an LLM judge: [rewards.md](rewards.md).",
        ("reward_funcs", "judge_base_url", "judge_model", "judge_max_concurrency"),
    ),
    Group(
        "Tools",
        "ReTool's code interpreter and where its code runs; TRL's `max_tool_calling_iterations` bounds the rounds: "
        "[tools.md](tools.md).",
        (
            "tools",
            "tool_config",
            "sandbox",
            "sandbox_url",
            "sandbox_timeout",
            "sandbox_memory_mb",
            "sandbox_max_concurrency",
            "sandbox_rate_limit",
            "sandbox_require_isolation",
            "tool_max_output_chars",
        ),
    ),
    Group(
        "Model, tokenizer and LoRA",
        "The model and its LoRA adapter are TRL's ModelConfig flags; LoRA end to end: [lora.md](lora.md).",
        ("chat_template", "lora_exclude_modules"),
        trl_fields="model",
    ),
)
