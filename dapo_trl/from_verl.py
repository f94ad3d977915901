"""`python -m dapo_trl.from_verl SCRIPT --output DIR`: a verl run (script or YAML) as a dapo-trl recipe.

Writes into DIR:

- `recipe.yaml`: for `train_dapo.py --config DIR/recipe.yaml` (DAPOConfig, script and ModelConfig field names);
- `accelerate.yaml`: `trainer.nnodes` x `trainer.n_gpus_per_node` processes, ZeRO-3 or DDP (see `plan_accelerate`);
- `vllm_server.sh`: the vLLM server for the rollout settings, through `scripts/start_vllm_server.sh`;
- `report.md`: every key of the input, mapped (to what), approximated (how), unsupported (why) or not needed
  (verl infrastructure with nothing to translate), the batch / step arithmetic, and the verl defaults applied.

The three parts are separate functions: `read_verl_input` (`dapo_trl.verl_input`: shell resolution, Hydra values),
`translate` (the mapping; simple keys are data in `SIMPLE_RULES` / `NOT_NEEDED_KEYS`, the rest one function per
concern), and `write_outputs`. Exit status: 0 written; 1 a key that changes the training cannot be translated
(only `report.md` is written; `--allow-unsupported` writes everything anyway); 2 the input cannot be read or a
variable cannot be resolved.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import math
import os
import re
import shlex
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .verl_input import VerlInput, VerlInputError, read_verl_input, resolve_interpolations

MAPPED, APPROXIMATED, UNSUPPORTED, NOT_NEEDED = "mapped", "approximated", "unsupported", "not needed"
REPO = Path(__file__).resolve().parent.parent
ACCELERATE_TEMPLATES = REPO / "configs" / "accelerate"
# DDP keeps the whole model, its gradients and AdamW's two moments on every GPU: about 16 bytes per parameter in
# mixed precision, 48 GB at 3B before activations, the reference model and vLLM. From there on shard (ZeRO-3), as
# verl's FSDP always does.
ZERO3_MIN_BILLIONS = 3.0
RETOOL_ANSWER_FORMAT = "\nThe answer format must be: \\boxed{'The final answer goes here.'}"
# Greedy validation (verl's val_kwargs temperature 0 / do_sample False): vLLM samples greedily below 1e-5.
GREEDY_TEMPERATURE = 1e-6

# verl's defaults (verl/trainer/config/ppo_trainer.yaml and its actor/rollout/data parts) for every key the mapping
# reads when the input does not set it.
VERL_DEFAULTS: dict[str, Any] = {
    "data.train_batch_size": 1024,
    "data.gen_batch_size": None,
    "data.max_prompt_length": 512,
    "data.max_response_length": 512,
    "data.filter_overlong_prompts": False,
    "data.truncation": "error",
    "data.prompt_key": "prompt",
    "data.train_files": None,
    "data.val_files": None,
    "actor_rollout_ref.model.path": None,
    "actor_rollout_ref.model.use_remove_padding": True,
    "actor_rollout_ref.model.enable_gradient_checkpointing": True,
    "actor_rollout_ref.model.lora_rank": 0,
    "actor_rollout_ref.model.lora_alpha": 16,
    "actor_rollout_ref.model.target_modules": "all-linear",
    "actor_rollout_ref.actor.strategy": "fsdp",
    "actor_rollout_ref.actor.ppo_mini_batch_size": 256,
    "actor_rollout_ref.actor.ppo_micro_batch_size": None,
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": None,
    "actor_rollout_ref.actor.use_dynamic_bsz": False,
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": 16384,
    "actor_rollout_ref.actor.ppo_epochs": 1,
    "actor_rollout_ref.actor.ulysses_sequence_parallel_size": 1,
    "actor_rollout_ref.actor.clip_ratio": 0.2,
    "actor_rollout_ref.actor.clip_ratio_low": 0.2,
    "actor_rollout_ref.actor.clip_ratio_high": 0.2,
    "actor_rollout_ref.actor.clip_ratio_c": 3.0,
    "actor_rollout_ref.actor.loss_agg_mode": "token-mean",
    "actor_rollout_ref.actor.loss_scale_factor": None,
    "actor_rollout_ref.actor.entropy_coeff": 0.0,
    "actor_rollout_ref.actor.use_kl_loss": False,
    "actor_rollout_ref.actor.kl_loss_coef": 0.001,
    "actor_rollout_ref.actor.kl_loss_type": "low_var_kl",
    "actor_rollout_ref.actor.grad_clip": 1.0,
    "actor_rollout_ref.actor.policy_loss.loss_mode": "vanilla",
    "actor_rollout_ref.actor.optim.lr": 1e-6,
    "actor_rollout_ref.actor.optim.weight_decay": 0.01,
    "actor_rollout_ref.actor.optim.lr_warmup_steps": -1,
    "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio": 0.0,
    "actor_rollout_ref.actor.optim.lr_scheduler_type": "constant",
    "actor_rollout_ref.actor.optim.warmup_style": None,
    "actor_rollout_ref.actor.optim.min_lr_ratio": 0.0,
    "actor_rollout_ref.actor.optim.num_cycles": 0.5,
    "actor_rollout_ref.actor.fsdp_config.param_offload": False,
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload": False,
    "actor_rollout_ref.rollout.name": "vllm",
    "actor_rollout_ref.rollout.n": 1,
    "actor_rollout_ref.rollout.temperature": 1.0,
    "actor_rollout_ref.rollout.top_p": 1.0,
    "actor_rollout_ref.rollout.top_k": -1,
    "actor_rollout_ref.rollout.do_sample": True,
    "actor_rollout_ref.rollout.dtype": "bfloat16",
    "actor_rollout_ref.rollout.tensor_model_parallel_size": 2,
    "actor_rollout_ref.rollout.data_parallel_size": 1,
    "actor_rollout_ref.rollout.gpu_memory_utilization": 0.5,
    "actor_rollout_ref.rollout.max_model_len": None,
    "actor_rollout_ref.rollout.val_kwargs.n": 1,
    "actor_rollout_ref.rollout.val_kwargs.temperature": 0,
    "actor_rollout_ref.rollout.val_kwargs.top_p": 1.0,
    "actor_rollout_ref.rollout.val_kwargs.top_k": -1,
    "actor_rollout_ref.rollout.val_kwargs.do_sample": False,
    "actor_rollout_ref.rollout.multi_turn.enable": False,
    "actor_rollout_ref.rollout.multi_turn.max_assistant_turns": None,
    "actor_rollout_ref.rollout.multi_turn.max_user_turns": None,
    "actor_rollout_ref.rollout.multi_turn.tool_config_path": None,
    "actor_rollout_ref.rollout.multi_turn.max_tool_response_length": 256,
    "actor_rollout_ref.rollout.multi_turn.tool_response_truncate_side": "middle",
    "actor_rollout_ref.rollout.multi_turn.max_parallel_calls": 1,
    "actor_rollout_ref.rollout.multi_turn.format": "hermes",
    "algorithm.adv_estimator": "gae",
    "algorithm.norm_adv_by_std_in_grpo": True,
    "algorithm.use_kl_in_reward": False,
    "algorithm.filter_groups.enable": False,
    "algorithm.filter_groups.metric": None,
    "algorithm.filter_groups.max_num_gen_batches": 0,
    "reward_model.overlong_buffer.enable": False,
    "reward_model.overlong_buffer.len": 0,
    "reward_model.overlong_buffer.penalty_factor": 0.0,
    "custom_reward_function.path": None,
    "custom_reward_function.name": "compute_score",
    "trainer.total_epochs": 30,
    "trainer.total_training_steps": None,
    "trainer.project_name": "verl_examples",
    "trainer.experiment_name": "gsm8k",
    "trainer.logger": ["console", "wandb"],
    "trainer.nnodes": 1,
    "trainer.n_gpus_per_node": 8,
    "trainer.save_freq": -1,
    "trainer.test_freq": -1,
    "trainer.val_before_train": True,
    "trainer.resume_mode": "auto",
    "trainer.default_local_dir": "checkpoints/${trainer.project_name}/${trainer.experiment_name}",
}


def _boolean(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in ("true", "1", "yes")
    return bool(value)


# One-to-one keys: verl key -> (DAPOConfig / script / ModelConfig field, converter, how). A key marked with
# `default=True` is also set from verl's default when the input lacks it (where dapo-trl's own default differs).
@dataclass(frozen=True)
class SimpleRule:
    field: str
    convert: Callable[[Any], Any]
    how: str
    default: bool = False


SIMPLE_RULES: dict[str, SimpleRule] = {
    "actor_rollout_ref.model.use_remove_padding": SimpleRule(
        "padding_free", _boolean, "verl's remove-padding forwards; here padding-free training forwards"
    ),
    "actor_rollout_ref.model.enable_gradient_checkpointing": SimpleRule(
        "activation_checkpointing", _boolean, "recompute activations in the backward pass"
    ),
    "actor_rollout_ref.model.trust_remote_code": SimpleRule("trust_remote_code", _boolean, "same meaning"),
    "actor_rollout_ref.model.use_liger": SimpleRule("use_liger_kernel", _boolean, "Liger kernels (same library)"),
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
    "data.shuffle": SimpleRule("shuffle_dataset", _boolean, "shuffle the training prompts"),
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
    ("*.router_replay.*", "MoE router replay, off"),
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
    ("actor_rollout_ref.rollout.expert_parallel_size", "MoE expert parallelism of the rollout engine"),
    ("actor_rollout_ref.rollout.pipeline_model_parallel_size", "pipeline parallelism of the rollout engine"),
    ("actor_rollout_ref.rollout.enable_rollout_routing_replay", "MoE routing replay, off"),
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
    ("algorithm.rollout_correction.*", "rollout correction off (rollout_is / rollout_rs unset)"),
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

# ---------------------------------------------------------------------------------------------- KL in the reward
# TODO(kl-in-reward): KL in the reward (verl's algorithm.use_kl_in_reward with kl_penalty and kl_ctrl.*) is not
# implemented in dapo-trl yet. When it is, map these keys in `map_kl_in_reward` (the only place that reads them)
# to its DAPOConfig fields and drop the refusal.
KL_IN_REWARD_KEYS = ("algorithm.use_kl_in_reward", "algorithm.kl_penalty", "algorithm.kl_ctrl.*")
KL_IN_REWARD_UNSUPPORTED = "not yet implemented: KL in the reward"


# ---------------------------------------------------------------------------------------------- the translation
@dataclass
class Entry:
    """What became of one verl key."""

    key: str
    value: str
    status: str
    target: str = ""
    how: str = ""
    blocking: bool = False  # unsupported in a way that changes the training: exit 1 unless --allow-unsupported


@dataclass(frozen=True)
class BatchPlan:
    """verl's batch sizes as TRL's layout (see `plan_batches`)."""

    world_size: int
    num_generations: int
    train_batch_size: int
    ppo_mini_batch_size: int
    ppo_epochs: int
    per_device_train_batch_size: int
    gradient_accumulation_steps: int
    steps_per_generation: int
    max_tokens_per_microbatch: int | None
    filter_groups_oversample: int
    notes: tuple[str, ...] = ()
    errors: tuple[str, ...] = ()

    @property
    def updates_per_rollout(self) -> int:
        """Optimizer steps per verl rollout step (one generation batch): K = train / mini x ppo_epochs."""
        return self.steps_per_generation // self.gradient_accumulation_steps * self.ppo_epochs

    @property
    def responses_per_update(self) -> int:
        return self.per_device_train_batch_size * self.world_size * self.gradient_accumulation_steps

    @property
    def responses_per_rollout(self) -> int:
        return self.per_device_train_batch_size * self.world_size * self.steps_per_generation


def _largest_divisor_at_most(number: int, limit: int) -> int:
    return max(d for d in range(1, min(number, max(1, limit)) + 1) if number % d == 0)


def plan_batches(
    *,
    train_batch_size: int,
    num_generations: int,
    ppo_mini_batch_size: int,
    world_size: int,
    ppo_epochs: int = 1,
    micro_batch_per_gpu: int | None = None,
    use_dynamic_bsz: bool = False,
    max_token_len_per_gpu: int | None = None,
    gen_batch_size: int | None = None,
) -> BatchPlan:
    """TRL's batch layout for verl's sizes.

    verl: `train_batch_size` prompts per rollout step, each with n = `rollout.n` responses; `ppo_mini_batch_size`
    prompts (x n responses) per optimizer update; `ppo_micro_batch_size_per_gpu` responses per forward (or, with
    `use_dynamic_bsz`, forwards of at most `ppo_max_token_len_per_gpu` tokens); `ppo_epochs` passes.
    TRL, with W = world size: responses per update = per_device_train_batch_size x W x gradient_accumulation_steps
    = mini x n; responses per rollout step = per_device_train_batch_size x W x steps_per_generation = train x n;
    so steps_per_generation = train / mini x gradient_accumulation_steps, and num_iterations = ppo_epochs.
    Each process takes mini x n / W responses per update: in micro-batches of `ppo_micro_batch_size_per_gpu`
    (gradient accumulation over them), or, with `use_dynamic_bsz`, all at once with
    `max_tokens_per_microbatch = ppo_max_token_len_per_gpu` splitting them into token-bounded forwards.
    """
    notes: list[str] = []
    errors: list[str] = []
    n, world = num_generations, world_size
    mini = ppo_mini_batch_size
    if train_batch_size % mini:
        mini_used = _largest_divisor_at_most(train_batch_size, mini)
        notes.append(
            f"train_batch_size {train_batch_size} is not a multiple of ppo_mini_batch_size {mini} (verl's last "
            f"mini-batch is smaller); used {mini_used} prompts per update, the largest divisor below"
        )
        mini = mini_used
    per_update = mini * n
    if per_update % world:
        errors.append(
            f"responses per update ppo_mini_batch_size x n = {mini} x {n} = {per_update} is not divisible by the "
            f"world size {world} (verl refuses such a layout too)"
        )
        per_process = max(1, round(per_update / world))
    else:
        per_process = per_update // world
    if use_dynamic_bsz:
        micro, accumulation, budget = per_process, 1, max_token_len_per_gpu
    else:
        budget = None
        if micro_batch_per_gpu is None:
            micro = per_process
            notes.append(
                "no ppo_micro_batch_size_per_gpu (verl requires one without use_dynamic_bsz): one forward "
                "of all the process's responses per update"
            )
        else:
            micro = _largest_divisor_at_most(per_process, micro_batch_per_gpu)
            if micro != micro_batch_per_gpu:
                notes.append(
                    f"micro-batch {micro} responses instead of {micro_batch_per_gpu}: each process takes "
                    f"{per_process} responses per update, and the micro-batch must divide them"
                )
        accumulation = per_process // micro
    updates = train_batch_size // mini
    oversample = 1
    if gen_batch_size is not None and gen_batch_size != train_batch_size:
        ratio = gen_batch_size / train_batch_size
        oversample = max(1, math.ceil(ratio))
        if oversample != ratio:
            notes.append(
                f"gen_batch_size / train_batch_size = {gen_batch_size} / {train_batch_size} = {ratio:g} is not an "
                f"integer: each dynamic-sampling round generates {oversample} generation batches"
            )
    return BatchPlan(
        world_size=world,
        num_generations=n,
        train_batch_size=train_batch_size,
        ppo_mini_batch_size=mini,
        ppo_epochs=ppo_epochs,
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=accumulation,
        steps_per_generation=updates * accumulation,
        max_tokens_per_microbatch=budget,
        filter_groups_oversample=oversample,
        notes=tuple(notes),
        errors=tuple(errors),
    )


@dataclass
class VLLMServer:
    """The vLLM server for the rollout settings, as scripts/start_vllm_server.sh and `trl vllm-serve` take it."""

    model: str
    tensor_parallel_size: int
    data_parallel_size: int
    gpu_memory_utilization: float
    max_model_len: int
    dtype: str
    extra_args: list[str] = field(default_factory=list)

    def environment(self) -> dict[str, str]:
        return {
            "MODEL_PATH": self.model,
            "TP": str(self.tensor_parallel_size),
            "DP": str(self.data_parallel_size),
            "GPU_MEMORY_UTILIZATION": f"{self.gpu_memory_utilization:g}",
            "MAX_MODEL_LEN": str(self.max_model_len),
            "DTYPE": self.dtype,
        }

    def script_command(self) -> str:
        assignments = [f"{name}={shlex.quote(value)}" for name, value in self.environment().items()]
        return " ".join([*assignments, "scripts/start_vllm_server.sh", *map(shlex.quote, self.extra_args)])

    def trl_command(self) -> str:
        return (
            f"trl vllm-serve --model {shlex.quote(self.model)} --tensor_parallel_size {self.tensor_parallel_size} "
            f"--data_parallel_size {self.data_parallel_size} --gpu_memory_utilization "
            f"{self.gpu_memory_utilization:g} --max_model_len {self.max_model_len} --dtype {self.dtype}"
        )


class Translation:
    """The recipe, launch files and report entries built from one verl input."""

    def __init__(self, found: VerlInput) -> None:
        self.found = found
        self.recipe: dict[str, Any] = {}
        self.entries: dict[str, Entry] = {}
        self.defaults: list[Entry] = []
        self.notes: list[str] = list(found.notes)
        self.files: dict[str, str | Path] = {}  # extra files for DIR: name -> text, or a Path to copy
        self.accelerate: dict[str, Any] = {}
        self.accelerate_rule = ""
        self.vllm: VLLMServer | None = None
        self.batch: BatchPlan | None = None
        self.step_rows: list[tuple[str, str, str]] = []  # (verl setting, here, formula)

    # ------------------------------------------------------------------------------------------------ reading
    def given(self, key: str) -> bool:
        """The input sets `key` (to a resolved value; Hydra's `???` marks a value left to fill, i.e. unset)."""
        return key in self.found.values and key not in self.found.unresolved and self.found.values[key] != "???"

    def value(self, key: str) -> Any:
        return self.found.values[key] if self.given(key) else VERL_DEFAULTS.get(key)

    def first(self, *keys: str) -> tuple[str, Any]:
        """The first of `keys` the input sets (verl's legacy and new spellings), else the first key's default."""
        for key in keys:
            if self.given(key):
                return key, self.found.values[key]
        return keys[0], VERL_DEFAULTS.get(keys[0])

    # ------------------------------------------------------------------------------------------------ writing
    def set(self, **fields: Any) -> None:
        self.recipe.update(fields)

    def mark(self, key: str, status: str, target: str = "", how: str = "", blocking: bool = False) -> None:
        """Record what became of an input key (the first record of a key stands)."""
        if key in self.found.values and key not in self.entries:
            written = self.found.written.get(key, _show(self.found.values[key]))
            self.entries[key] = Entry(key, written, status, target, how, blocking)

    def mark_all(self, pattern: str, status: str, target: str = "", how: str = "", blocking: bool = False) -> None:
        for key in list(self.found.values):
            if fnmatch.fnmatchcase(key, pattern):
                self.mark(key, status, target, how, blocking)

    def default(self, key: str, status: str, target: str, how: str, blocking: bool = False) -> None:
        """Record a verl default applied because the input does not set `key` (listed in its own report section)."""
        if not self.given(key):
            self.defaults.append(Entry(key, _show(VERL_DEFAULTS.get(key)), status, target, how, blocking))

    def record(self, key: str, status: str, target: str, how: str, blocking: bool = False) -> None:
        """`mark` when the input sets the key, else `default`."""
        if self.given(key):
            self.mark(key, status, target, how, blocking)
        else:
            self.default(key, status, target, how, blocking)

    @property
    def blocking(self) -> list[Entry]:
        return [entry for entry in [*self.entries.values(), *self.defaults] if entry.blocking]


def _show(value: Any) -> str:
    if isinstance(value, str):
        return value
    return json.dumps(value) if isinstance(value, list | dict | bool) or value is None else str(value)


def _field(name: str, value: Any) -> str:
    return f"{name}: {_show(value)}"


# ---------------------------------------------------------------------------------------------- model
def model_size_billions(path: str | None) -> float | None:
    """Parameter count in billions read from a model path's names (`Qwen2.5-32B` -> 32, `...-1.5b-...` -> 1.5)."""
    if not path:
        return None
    sizes = [
        float(number) / (1000.0 if unit.lower() == "m" else 1.0)
        for number, unit in re.findall(r"(?<![A-Za-z0-9.])(\d+(?:\.\d+)?)([bBmM])(?![A-Za-z0-9])", str(path))
    ]
    return max(sizes) if sizes else None


def map_model(t: Translation) -> None:
    key = "actor_rollout_ref.model.path"
    path = t.value(key)
    if path:
        t.set(model_name_or_path=str(path))
        t.mark(key, MAPPED, _field("model_name_or_path", path), "the policy's initial weights")
    else:
        t.notes.append("no actor_rollout_ref.model.path: pass --model_name_or_path")
    t.set(dtype="float32")
    master = str(t.value("actor_rollout_ref.actor.fsdp_config.model_dtype") or "fp32")
    t.mark(
        "actor_rollout_ref.actor.fsdp_config.model_dtype",
        MAPPED if master in ("fp32", "float32") else APPROXIMATED,
        _field("dtype", "float32"),
        "verl keeps fp32 master weights and computes in bf16: weights loaded in float32, accelerate's "
        "mixed_precision bf16",
    )
    rank = int(t.value("actor_rollout_ref.model.lora_rank") or 0)
    if rank > 0:
        alpha = t.value("actor_rollout_ref.model.lora_alpha")
        modules = t.value("actor_rollout_ref.model.target_modules")
        modules = [modules] if isinstance(modules, str) else list(modules)
        t.set(use_peft=True, lora_r=rank, lora_alpha=int(alpha), lora_target_modules=modules)
        t.mark("actor_rollout_ref.model.lora_rank", MAPPED, f"use_peft: true, lora_r: {rank}", "LoRA through PEFT")
        t.mark("actor_rollout_ref.model.lora_alpha", MAPPED, _field("lora_alpha", alpha))
        t.mark("actor_rollout_ref.model.target_modules", MAPPED, _field("lora_target_modules", modules))
    else:
        for name in ("lora_rank", "lora_alpha", "target_modules", "exclude_modules", "lora_adapter_path"):
            t.mark(f"actor_rollout_ref.model.{name}", NOT_NEEDED, how="LoRA is off (lora_rank 0)")
    for name in ("exclude_modules", "lora_adapter_path"):
        t.mark(f"actor_rollout_ref.model.{name}", UNSUPPORTED, how="no counterpart in TRL's ModelConfig")
    template = t.value("actor_rollout_ref.model.custom_chat_template")
    if template:
        t.files["chat_template.jinja"] = str(template)
        t.set(chat_template="chat_template.jinja")
        t.mark(
            "actor_rollout_ref.model.custom_chat_template",
            MAPPED,
            "chat_template: <DIR>/chat_template.jinja",
            "written next to the recipe",
        )
    if t.value("actor_rollout_ref.model.tokenizer_path"):
        t.mark("actor_rollout_ref.model.tokenizer_path", UNSUPPORTED, how="the tokenizer is loaded from the model path")


# ---------------------------------------------------------------------------------------------- data
def dataset_name_for(path: Any) -> tuple[str, str, str]:
    """(--dataset_name value, status, how) for one of verl's data files."""
    text = os.path.expanduser(str(path))
    if "://" in text:
        return text, UNSUPPORTED, "remote file systems are not read: copy the file locally"
    from .data import _PRESET_BY_HUB_ID

    name = Path(text).name
    stem = name.rsplit(".", 1)[0] if Path(text).suffix else name
    if stem.lower().replace("_", "-") == "dapo-math-17k":
        return f"dapo-math-17k:{text}", MAPPED, "a local copy of DAPO-Math-17k: the dapo-math-17k preset's columns"
    hub_id = "/".join(Path(text).parts[-2:]).lower()
    if hub_id in _PRESET_BY_HUB_ID:
        preset = _PRESET_BY_HUB_ID[hub_id]
        return f"{preset}:{text}", MAPPED, f"a local copy of {hub_id}: the {preset} preset's columns"
    return text, MAPPED, "read as a local file (prompt and reward_model.ground_truth columns detected)"


def _as_list(value: Any) -> list[Any]:
    if value is None:
        return []
    return list(value) if isinstance(value, list | tuple) else [value]


def map_data(t: Translation) -> None:
    train = _as_list(t.value("data.train_files"))
    if len(train) == 1:
        name, status, how = dataset_name_for(train[0])
        t.set(dataset_name=name)
        t.mark("data.train_files", status, _field("dataset_name", name), how, blocking=status == UNSUPPORTED)
    elif len(train) > 1:
        t.mark(
            "data.train_files",
            UNSUPPORTED,
            "",
            "several training files: --dataset_name takes one; concatenate them into one parquet file",
            blocking=True,
        )
    else:
        t.notes.append("no data.train_files: pass --dataset_name")
    validation = _as_list(t.value("data.val_files"))
    eval_names = []
    for file in validation:
        name, status, how = dataset_name_for(file)
        eval_names.append(name)
        if status == UNSUPPORTED:
            t.mark("data.val_files", UNSUPPORTED, "", how)
    if eval_names:
        t.set(eval_dataset_name=eval_names)
        t.mark("data.val_files", MAPPED, _field("eval_dataset_name", eval_names), "validation sets (avg@n, pass@k)")
    prompt_key = t.value("data.prompt_key")
    if prompt_key != "prompt":
        t.set(prompt_column=str(prompt_key))
    t.mark(
        "data.prompt_key",
        MAPPED,
        _field("prompt_column", prompt_key) if prompt_key != "prompt" else "prompt_column: auto (prompt)",
        "column holding the prompt",
    )

    # Overlong prompts: verl filters them (filter_overlong_prompts), else applies `truncation` at load time.
    filter_prompts = _boolean(t.value("data.filter_overlong_prompts"))
    truncation = str(t.value("data.truncation"))
    if filter_prompts:
        t.set(overlong_prompt_policy="filter")
        t.record(
            "data.filter_overlong_prompts",
            MAPPED,
            "overlong_prompt_policy: filter",
            "prompts longer than max_prompt_length are dropped (and counted)",
        )
        t.mark("data.truncation", NOT_NEEDED, how="overlong prompts are filtered before truncation could apply")
    elif truncation == "error":
        t.set(overlong_prompt_policy="error")
        t.record("data.truncation", MAPPED, "overlong_prompt_policy: error", "an overlong prompt stops the run")
        t.mark("data.filter_overlong_prompts", MAPPED, "overlong_prompt_policy: error", "no filtering")
    else:
        t.set(overlong_prompt_policy="filter")
        t.mark(
            "data.truncation",
            APPROXIMATED,
            "overlong_prompt_policy: filter",
            f"verl cuts overlong prompts ({truncation}); dapo-trl never truncates a prompt and drops them "
            "instead (counted in the log)",
        )
        t.mark("data.filter_overlong_prompts", APPROXIMATED, "overlong_prompt_policy: filter", "see data.truncation")

    custom_path, custom_name = t.value("data.custom_cls.path"), t.value("data.custom_cls.name")
    if custom_path:
        if str(custom_path).endswith("retool/retool.py") and custom_name == "CustomRLHFDataset":
            t.set(prompt_template="{problem}" + RETOOL_ANSWER_FORMAT)
            how = (
                "ReTool's dataset class appends its \\boxed{} instruction to every problem: here the prompt "
                "template appends it to text problems (the AIME sets); chat-message prompts (DAPO-Math-17k) "
                "keep their own instruction (DAPO's 'Answer:' line), so the ReTool reward, which reads \\boxed{}, "
                "relies on the SFT model boxing its answers as it was taught"
            )
            t.mark("data.custom_cls.path", APPROXIMATED, "prompt_template: '{problem}' + ReTool's boxed format", how)
            t.mark("data.custom_cls.name", APPROXIMATED, "see data.custom_cls.path", "ReTool's CustomRLHFDataset")
        else:
            how = "custom dataset classes do not run here: prepare the data as a parquet file with a prompt column"
            t.mark("data.custom_cls.path", UNSUPPORTED, "", how, blocking=True)
            t.mark("data.custom_cls.name", UNSUPPORTED, "", how, blocking=True)
    for limit in ("data.train_max_samples", "data.val_max_samples"):
        value = t.value(limit)
        if value is not None and int(value) > 0:
            t.mark(limit, UNSUPPORTED, "", "no row limit here: cut the data file to the rows you want")
        else:
            t.mark(limit, NOT_NEEDED, how="-1: every row")
    if t.given("data.seed") and t.value("data.seed") is not None:
        t.set(seed=int(t.value("data.seed")))
        t.mark(
            "data.seed",
            APPROXIMATED,
            _field("seed", t.value("data.seed")),
            "the Trainer's one seed: data order, and also sampling and initialisation",
        )
    else:
        t.mark("data.seed", NOT_NEEDED, how="unset")


# ---------------------------------------------------------------------------------------------- batches and steps
def map_batches(t: Translation) -> BatchPlan:
    actor = "actor_rollout_ref.actor."
    nnodes, gpus = int(t.value("trainer.nnodes")), int(t.value("trainer.n_gpus_per_node"))
    world = nnodes * gpus
    n = int(t.value("actor_rollout_ref.rollout.n"))
    train = int(t.value("data.train_batch_size"))
    mini = int(t.value(actor + "ppo_mini_batch_size"))
    epochs = int(t.value(actor + "ppo_epochs"))
    dynamic = _boolean(t.value(actor + "use_dynamic_bsz"))
    budget = int(t.value(actor + "ppo_max_token_len_per_gpu"))
    sequence_parallel = int(t.value(actor + "ulysses_sequence_parallel_size") or 1)
    micro = t.value(actor + "ppo_micro_batch_size_per_gpu")
    micro_key = actor + "ppo_micro_batch_size_per_gpu"
    if micro is None and t.value(actor + "ppo_micro_batch_size") is not None:  # deprecated global micro-batch
        micro_key = actor + "ppo_micro_batch_size"
        micro = max(1, int(t.value(micro_key)) // max(1, world // sequence_parallel))
    gen_key, gen = t.first("data.gen_batch_size")
    plan = plan_batches(
        train_batch_size=train,
        num_generations=n,
        ppo_mini_batch_size=mini,
        world_size=world,
        ppo_epochs=epochs,
        micro_batch_per_gpu=None if micro is None else int(micro),
        use_dynamic_bsz=dynamic,
        max_token_len_per_gpu=budget,
        gen_batch_size=None if gen is None else int(gen),
    )
    t.batch = plan
    t.set(
        num_generations=n,
        per_device_train_batch_size=plan.per_device_train_batch_size,
        gradient_accumulation_steps=plan.gradient_accumulation_steps,
        steps_per_generation=plan.steps_per_generation,
        num_iterations=epochs,
    )
    if plan.max_tokens_per_microbatch is not None:
        t.set(max_tokens_per_microbatch=plan.max_tokens_per_microbatch)
    layout = (
        f"per_device_train_batch_size: {plan.per_device_train_batch_size}, gradient_accumulation_steps: "
        f"{plan.gradient_accumulation_steps}, steps_per_generation: {plan.steps_per_generation}"
    )
    status = APPROXIMATED if plan.notes else MAPPED
    notes = "; ".join(plan.notes)
    how_rollout = (
        f"responses per rollout step {train} x {n} = {train * n} = {plan.per_device_train_batch_size} x {world} "
        f"processes x {plan.steps_per_generation} steps_per_generation"
    )
    how_update = (
        f"responses per optimizer update {plan.ppo_mini_batch_size} x {n} = {plan.ppo_mini_batch_size * n} = "
        f"{plan.per_device_train_batch_size} x {world} x {plan.gradient_accumulation_steps} accumulation steps"
    )
    blocking = bool(plan.errors)
    t.record("data.train_batch_size", status, layout, how_rollout + (f"; {notes}" if notes else ""), blocking)
    t.record(actor + "ppo_mini_batch_size", status, layout, how_update + "; ".join(["", *plan.errors]), blocking)
    if n >= 2:
        t.record("actor_rollout_ref.rollout.n", MAPPED, _field("num_generations", n), "responses per prompt")
    else:
        t.record(
            "actor_rollout_ref.rollout.n", UNSUPPORTED, "", "GRPO needs at least 2 responses per prompt", blocking=True
        )
    t.record(actor + "ppo_epochs", MAPPED, _field("num_iterations", epochs), "passes over each generation batch")
    t.mark("trainer.nnodes", MAPPED, f"accelerate.yaml num_machines: {nnodes}", f"world size {world}")
    t.mark("trainer.n_gpus_per_node", MAPPED, f"accelerate.yaml num_processes: {world}", f"{nnodes} x {gpus}")
    if dynamic:
        t.mark(
            actor + "use_dynamic_bsz",
            MAPPED,
            _field("max_tokens_per_microbatch", budget),
            "token-bounded forwards: each process's share of an update is split into forwards of at most "
            "ppo_max_token_len_per_gpu real tokens",
        )
        t.mark(
            actor + "ppo_max_token_len_per_gpu",
            MAPPED,
            _field("max_tokens_per_microbatch", budget),
            "real tokens per forward and process"
            + (
                f" (verl's Ulysses groups of {sequence_parallel} GPUs "
                "share a budget of len x sp; here each process has its own)"
                if sequence_parallel > 1
                else ""
            ),
        )
        for key in (actor + "ppo_micro_batch_size_per_gpu", actor + "ppo_micro_batch_size"):
            t.mark(key, NOT_NEEDED, how="use_dynamic_bsz=True sizes forwards by tokens instead")
    else:
        t.mark(actor + "use_dynamic_bsz", MAPPED, "max_tokens_per_microbatch: unset", "fixed-size micro-batches")
        other = actor + ("ppo_micro_batch_size" if micro_key.endswith("_per_gpu") else "ppo_micro_batch_size_per_gpu")
        t.mark(other, NOT_NEEDED, how=f"{micro_key.rsplit('.', 1)[-1]} sets the micro-batch")
        t.mark(
            micro_key,
            status,
            _field("per_device_train_batch_size", plan.per_device_train_batch_size),
            "responses per forward and process" + (f"; {notes}" if notes else ""),
        )
    if sequence_parallel > 1:
        t.mark(
            actor + "ulysses_sequence_parallel_size",
            UNSUPPORTED,
            "",
            "no sequence parallelism here: every process holds whole sequences (the same loss and gradient; "
            "more memory per GPU for long responses: lower max_tokens_per_microbatch if it runs out)",
        )
    else:
        t.mark(actor + "ulysses_sequence_parallel_size", NOT_NEEDED, how="1: no sequence parallelism")
    t.step_rows += [
        ("world size", f"nnodes x n_gpus_per_node = {nnodes} x {gpus}", f"{world} processes"),
        (
            "responses per rollout step",
            f"train_batch_size x n = {train} x {n} = {train * n}",
            f"per_device_train_batch_size x W x steps_per_generation = {plan.per_device_train_batch_size} x {world} x "
            f"{plan.steps_per_generation} = {plan.responses_per_rollout}",
        ),
        (
            "responses per optimizer update",
            f"ppo_mini_batch_size x n = {plan.ppo_mini_batch_size} x {n} = {plan.ppo_mini_batch_size * n}",
            f"per_device_train_batch_size x W x gradient_accumulation_steps = {plan.per_device_train_batch_size} x "
            f"{world} x {plan.gradient_accumulation_steps} = {plan.responses_per_update}",
        ),
        (
            "optimizer steps per rollout step (K)",
            f"train_batch_size / ppo_mini_batch_size x ppo_epochs = {train} / {plan.ppo_mini_batch_size} x {epochs}",
            f"steps_per_generation / gradient_accumulation_steps x num_iterations = {plan.steps_per_generation} / "
            f"{plan.gradient_accumulation_steps} x {epochs} = {plan.updates_per_rollout}",
        ),
    ]
    if plan.per_device_train_batch_size * world % n:
        t.notes.append(
            f"per_device_train_batch_size x world size = {plan.per_device_train_batch_size * world} is not a "
            f"multiple of num_generations {n}: a group may span two micro-batches (allowed: the generation batch "
            "holds whole groups, and advantages are computed before the split)"
        )
    return plan


def _to_updates(t: Translation, rollout_steps: int) -> int:
    return rollout_steps * t.batch.updates_per_rollout


def map_schedule(t: Translation) -> None:
    """Learning-rate schedule and run length; verl counts them in rollout steps, TRL in optimizer steps (x K)."""
    optim = "actor_rollout_ref.actor.optim."
    per_rollout = t.batch.updates_per_rollout
    style_key, style = t.first(optim + "warmup_style")
    scheduler = style if style is not None else t.value(optim + "lr_scheduler_type")
    scheduler_key = style_key if style is not None else optim + "lr_scheduler_type"
    warmup_steps = int(t.value(optim + "lr_warmup_steps"))
    ratio = float(t.value(optim + "lr_warmup_steps_ratio") or 0.0)
    if warmup_steps >= 0:
        warmup: float = warmup_steps * per_rollout
        t.record(
            optim + "lr_warmup_steps",
            APPROXIMATED,
            _field("warmup_steps", warmup),
            f"{warmup_steps} rollout steps x K={per_rollout} optimizer steps; verl raises the LR once per "
            "rollout step (a staircase), TRL every optimizer step (a ramp over the same span)",
        )
        t.mark(optim + "lr_warmup_steps_ratio", NOT_NEEDED, how="lr_warmup_steps is set and wins, as in verl")
        if warmup_steps:
            t.step_rows.append(
                (
                    "LR warm-up",
                    f"lr_warmup_steps = {warmup_steps} rollout steps",
                    f"warmup_steps = {warmup_steps} x {per_rollout} = {int(warmup)}",
                )
            )
    else:
        warmup = ratio
        t.mark(optim + "lr_warmup_steps", NOT_NEEDED, how="-1: the ratio applies")
        t.mark(
            optim + "lr_warmup_steps_ratio",
            MAPPED if ratio == 0 else APPROXIMATED,
            _field("warmup_steps", ratio),
            "a warmup_steps below 1 is a share of the run's steps, so the same share of the run",
        )
    if scheduler == "constant":
        t.set(lr_scheduler_type="constant_with_warmup" if warmup else "constant")
        t.record(
            scheduler_key,
            MAPPED,
            _field("lr_scheduler_type", t.recipe["lr_scheduler_type"]),
            "constant after the warm-up",
        )
        t.mark(optim + "min_lr_ratio", NOT_NEEDED, how="cosine schedule only")
        t.mark(optim + "num_cycles", NOT_NEEDED, how="cosine schedule only")
    elif scheduler == "cosine":
        minimum = float(t.value(optim + "min_lr_ratio") or 0.0)
        cycles = float(t.value(optim + "num_cycles"))
        kwargs: dict[str, float] = {} if cycles == 0.5 else {"num_cycles": cycles}
        if minimum > 0:
            t.set(lr_scheduler_type="cosine_with_min_lr")
            kwargs["min_lr_rate"] = minimum
        else:
            t.set(lr_scheduler_type="cosine")
        if kwargs:
            t.set(lr_scheduler_kwargs=kwargs)
        t.record(
            scheduler_key,
            APPROXIMATED,
            _field("lr_scheduler_type", t.recipe["lr_scheduler_type"]),
            "the same cosine over the run, decayed per optimizer step instead of per rollout step",
        )
        t.mark(optim + "min_lr_ratio", MAPPED, _field("lr_scheduler_kwargs.min_lr_rate", minimum), "LR floor")
        t.mark(optim + "num_cycles", MAPPED, _field("lr_scheduler_kwargs.num_cycles", cycles), "cosine waves")
    else:
        t.record(
            scheduler_key,
            UNSUPPORTED,
            "",
            f"LR schedule {scheduler!r}: verl's FSDP actor has constant and cosine only",
            blocking=True,
        )
    if warmup:
        t.set(warmup_steps=warmup)
    if style is None:
        t.mark(style_key, NOT_NEEDED, how="null: lr_scheduler_type applies")
    betas = t.value(optim + "betas")
    if t.given(optim + "betas") and isinstance(betas, list) and len(betas) == 2:
        t.set(adam_beta1=float(betas[0]), adam_beta2=float(betas[1]))
        t.mark(optim + "betas", MAPPED, f"adam_beta1: {betas[0]}, adam_beta2: {betas[1]}", "AdamW betas")

    total = t.value("trainer.total_training_steps")
    epochs = t.value("trainer.total_epochs")
    if total is not None and int(total) > 0:
        t.set(max_steps=_to_updates(t, int(total)))
        t.mark(
            "trainer.total_training_steps",
            MAPPED,
            _field("max_steps", t.recipe["max_steps"]),
            f"{total} rollout steps x K={per_rollout}",
        )
        t.mark("trainer.total_epochs", NOT_NEEDED, how="total_training_steps is set and wins, as in verl")
        t.step_rows.append(
            (
                "run length",
                f"total_training_steps = {total} rollout steps",
                f"max_steps = {total} x {per_rollout} = {t.recipe['max_steps']}",
            )
        )
    else:
        t.set(num_train_epochs=float(epochs))
        dedup = ""
        if str(t.recipe.get("dataset_name", "")).startswith("dapo-math-17k"):
            dedup = (
                " verl reads the data file as it is (the hub copy of DAPO-Math-17k repeats every problem about 100 "
                "times), dapo-trl drops repeated prompts, so one verl epoch there is about 100 epochs here."
            )
        t.record(
            "trainer.total_epochs",
            APPROXIMATED,
            _field("num_train_epochs", epochs),
            "passes over the training prompts, counted by the Trainer in optimizer steps; with dynamic "
            "sampling verl's epoch also counts the prompts drawn for extra rounds, which here come from a "
            "separate stream." + dedup + " Set --max_steps (rollout steps x K) for the length you want.",
        )
        t.mark("trainer.total_training_steps", NOT_NEEDED, how="unset: total_epochs sets the length")


def map_loss(t: Translation) -> None:
    actor = "actor_rollout_ref.actor."
    # Clip-higher: verl's vanilla loss takes clip_ratio_low/high (defaults 0.2, not null), clip_ratio only as
    # their fallback when one of them is null.
    ratio = float(t.value(actor + "clip_ratio"))
    low_value, high_value = t.value(actor + "clip_ratio_low"), t.value(actor + "clip_ratio_high")
    low = ratio if low_value is None else float(low_value)
    high = ratio if high_value is None else float(high_value)
    t.set(epsilon=low, epsilon_high=high)
    t.record(actor + "clip_ratio_low", MAPPED, _field("epsilon", low), "lower clip 1 - epsilon")
    t.record(
        actor + "clip_ratio_high",
        MAPPED,
        _field("epsilon_high", high),
        "upper clip 1 + epsilon_high (clip-higher); verl's default 0.2 differs from dapo-trl's 0.28",
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
    t.set(clip_ratio_c=c)
    t.record(
        actor + "clip_ratio_c",
        MAPPED,
        _field("clip_ratio_c", c),
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
            "the mini-batch's sequences when micro-batches hold equal row counts, and sequences "
            "with no loss token are not left out of the mean",
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
    if mode in losses:
        loss_type, status, how = losses[mode]
        t.set(loss_type=loss_type)
        t.record(actor + "loss_agg_mode", status, _field("loss_type", loss_type), how)
    else:
        t.set(loss_type="dapo")
        t.mark(actor + "loss_agg_mode", UNSUPPORTED, "", f"unknown aggregation {mode!r}", blocking=True)
    t.mark(
        actor + "loss_scale_factor",
        NOT_NEEDED if mode != "seq-mean-token-sum-norm" else APPROXIMATED,
        how="used by seq-mean-token-sum-norm only; see loss_agg_mode",
    )

    loss_mode = str(t.value(actor + "policy_loss.loss_mode"))
    if loss_mode == "vanilla":
        t.mark(actor + "policy_loss.loss_mode", MAPPED, "(PPO clip with dual-clip)", "verl's vanilla PPO loss")
    else:
        t.record(
            actor + "policy_loss.loss_mode",
            UNSUPPORTED,
            "",
            f"policy loss {loss_mode!r}: only verl's vanilla clipped loss is translated",
            blocking=True,
        )

    # KL loss (in the policy loss): TRL's beta uses the k3 estimator, verl's low_var_kl.
    use_kl = _boolean(t.value(actor + "use_kl_loss"))
    coefficient = float(t.value(actor + "kl_loss_coef"))
    kind = str(t.value(actor + "kl_loss_type"))
    if not use_kl:
        t.set(beta=0.0)
        t.record(actor + "use_kl_loss", MAPPED, "beta: 0.0", "no KL loss")
        t.mark(actor + "kl_loss_coef", NOT_NEEDED, how="use_kl_loss is off")
        t.mark(actor + "kl_loss_type", NOT_NEEDED, how="use_kl_loss is off")
    elif kind in ("low_var_kl", "k3"):
        t.set(beta=coefficient)
        t.mark(actor + "use_kl_loss", MAPPED, _field("beta", coefficient), "KL to the reference model in the loss")
        t.record(actor + "kl_loss_coef", MAPPED, _field("beta", coefficient), "KL coefficient")
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
    normalise = _boolean(t.value("algorithm.norm_adv_by_std_in_grpo"))
    t.set(scale_rewards="group" if normalise else "none")
    t.mark(
        "algorithm.norm_adv_by_std_in_grpo",
        MAPPED,
        _field("scale_rewards", t.recipe["scale_rewards"]),
        "divide by the group's std (verl's epsilon 1e-6, TRL's 1e-4)" if normalise else "Dr.GRPO: no std",
    )
    if _boolean(t.value("algorithm.use_pf_ppo")):
        t.mark("algorithm.use_pf_ppo", UNSUPPORTED, "", "policy-filtered PPO has no counterpart", blocking=True)
    else:
        t.mark("algorithm.use_pf_ppo", NOT_NEEDED, how="off")
    for key in ("algorithm.rollout_correction.rollout_is", "algorithm.rollout_correction.rollout_rs"):
        if t.value(key) is not None:
            t.mark(key, UNSUPPORTED, "", "verl's rollout correction is not translated", blocking=True)


def map_kl_in_reward(t: Translation) -> None:
    """KL in the reward: not implemented yet (see KL_IN_REWARD_KEYS' TODO); refused when the input turns it on."""
    if _boolean(t.value("algorithm.use_kl_in_reward")):
        for pattern in KL_IN_REWARD_KEYS:
            t.mark_all(pattern, UNSUPPORTED, "", KL_IN_REWARD_UNSUPPORTED, blocking=True)
        return
    t.mark("algorithm.use_kl_in_reward", MAPPED, "(no KL in the reward)", "off, as in dapo-trl")
    for pattern in KL_IN_REWARD_KEYS[1:]:
        t.mark_all(pattern, NOT_NEEDED, how=f"read only with use_kl_in_reward=True ({KL_IN_REWARD_UNSUPPORTED})")


def map_dynamic_sampling(t: Translation) -> None:
    enabled = _boolean(t.value("algorithm.filter_groups.enable"))
    t.set(filter_groups_enable=enabled)
    t.record(
        "algorithm.filter_groups.enable",
        MAPPED,
        _field("filter_groups_enable", enabled),
        "dynamic sampling"
        + ("" if t.given("algorithm.filter_groups.enable") else " (verl's default is off, dapo-trl's on)"),
    )
    gen_key = "data.gen_batch_size"
    oversample = t.batch.filter_groups_oversample
    if not enabled:
        for key in ("algorithm.filter_groups.metric", "algorithm.filter_groups.max_num_gen_batches"):
            t.mark(key, NOT_NEEDED, how="dynamic sampling is off")
        if t.given(gen_key) and oversample != 1:
            t.mark(
                gen_key,
                APPROXIMATED,
                "",
                "without dynamic sampling verl's DAPO trainer trains on the whole "
                "generation batch; here a rollout step is train_batch_size prompts",
            )
        else:
            t.mark(gen_key, NOT_NEEDED, how="dynamic sampling is off")
        return
    rounds = int(t.value("algorithm.filter_groups.max_num_gen_batches") or 0)
    rounds = max(rounds, 0)
    t.set(max_filter_gen_batches=rounds, filter_groups_oversample=oversample, filter_groups_on_exhausted="error")
    t.record(
        "algorithm.filter_groups.max_num_gen_batches",
        MAPPED,
        f"max_filter_gen_batches: {rounds}, filter_groups_on_exhausted: error",
        "most generation rounds per step (0 = unlimited); when they run out verl stops with an error, and so "
        "does this recipe (filter_groups_on_exhausted: fill trains on what was kept instead)",
    )
    metric = t.value("algorithm.filter_groups.metric")
    if metric == "acc":
        t.mark(
            "algorithm.filter_groups.metric",
            MAPPED,
            "accuracy_reward_name: (first reward)",
            "groups are kept when the accuracy reward has a spread",
        )
    else:
        t.record(
            "algorithm.filter_groups.metric",
            APPROXIMATED,
            "accuracy_reward_name: (first reward)",
            f"verl filters on {metric!r}; dapo-trl filters on the first reward function's raw value (before "
            "the overlong penalty)",
        )
    if t.given(gen_key):
        status = APPROXIMATED if any("gen_batch_size" in note for note in t.batch.notes) else MAPPED
        t.mark(
            gen_key,
            status,
            _field("filter_groups_oversample", oversample),
            f"each dynamic-sampling round generates gen_batch_size / train_batch_size = {oversample} generation "
            "batches of prompts",
        )
        t.step_rows.append(
            (
                "prompts per dynamic-sampling round",
                f"gen_batch_size = {t.value(gen_key)}",
                f"filter_groups_oversample x train_batch_size = {oversample} x {t.batch.train_batch_size}",
            )
        )


def map_reward(t: Translation) -> None:
    enable_key, enable = t.first(
        "reward_model.overlong_buffer.enable", "reward.reward_kwargs.overlong_buffer_cfg.enable"
    )
    length_key, length = t.first("reward_model.overlong_buffer.len", "reward.reward_kwargs.overlong_buffer_cfg.len")
    factor_key, factor = t.first(
        "reward_model.overlong_buffer.penalty_factor", "reward.reward_kwargs.overlong_buffer_cfg.penalty_factor"
    )
    if _boolean(enable):
        t.set(apply_overlong_penalty=True, overlong_buffer_len=int(length), overlong_penalty_factor=float(factor))
        t.mark(enable_key, MAPPED, "apply_overlong_penalty: true", "DAPO's soft overlong punishment (Eq. 13)")
        t.mark(length_key, MAPPED, _field("overlong_buffer_len", length), "L_cache")
        t.mark(factor_key, MAPPED, _field("overlong_penalty_factor", factor), "penalty scale")
    else:
        t.set(apply_overlong_penalty=False)
        t.record(
            enable_key,
            MAPPED,
            "apply_overlong_penalty: false",
            "no overlong penalty (verl's default; dapo-trl's default is on)",
        )
        for key in (length_key, factor_key):
            t.mark(key, NOT_NEEDED, how="the overlong penalty is off")
    for pattern in ("reward_model.overlong_buffer.log", "reward.reward_kwargs.overlong_buffer_cfg.log"):
        t.mark(pattern, NOT_NEEDED, how="the penalty is always logged (rewards/overlong_penalty/*)")
    t.mark("reward.reward_kwargs.max_resp_len", NOT_NEEDED, how="L_max is max_completion_length")
    for key in ("reward_model.reward_manager", "reward.reward_manager.name"):
        t.mark(key, NOT_NEEDED, how="verl's reward manager; the DAPO manager's overlong penalty is mapped above")
    if _boolean(t.value("reward_model.enable")):
        t.mark(
            "reward_model.enable",
            UNSUPPORTED,
            "",
            "model-based rewards are not translated: pass the reward as --reward_funcs",
            blocking=True,
        )

    path, name = t.value("custom_reward_function.path"), t.value("custom_reward_function.name")
    if path and str(path).endswith("retool/retool.py") and name == "compute_score":
        t.set(reward_funcs=["retool"])
        how = (
            "ReTool's compute_score (DAPO's strict-box scorer with the tool-turn rule for wrong answers) is "
            "dapo-trl's retool reward; it scores the model's own text only, verl's the whole response including "
            "tool output"
        )
        t.mark("custom_reward_function.path", APPROXIMATED, "reward_funcs: [retool]", how)
        t.mark("custom_reward_function.name", APPROXIMATED, "reward_funcs: [retool]", how)
    elif path:
        reference = f"{path}:{name}"
        t.set(reward_funcs=[reference])
        how = (
            "imported by train_dapo.py from that file (relative to where it runs) and called once per response "
            "with verl's arguments; if the file imports verl, verl must be installed"
        )
        t.mark("custom_reward_function.path", MAPPED, _field("reward_funcs", [reference]), how)
        t.mark("custom_reward_function.name", MAPPED, _field("reward_funcs", [reference]), how)
    else:
        t.set(reward_funcs=["dapo_math"])
        t.record(
            "custom_reward_function.path",
            APPROXIMATED,
            "reward_funcs: [dapo_math]",
            "verl picks its scorer by data_source: math_dapo and aime* use DAPO's 'Answer:' scorer, which "
            "is dapo_math here; other data sources (gsm8k, MATH, code) have other scorers in verl",
        )
        t.mark("custom_reward_function.name", NOT_NEEDED, how="no custom reward file")
    t.mark_all("custom_reward_function.reward_kwargs.*", UNSUPPORTED, "", "extra reward arguments are not passed")


def map_rollout(t: Translation) -> None:
    rollout = "actor_rollout_ref.rollout."
    engine = str(t.value(rollout + "name"))
    if engine in ("vllm", "sglang"):
        t.set(use_vllm=True, vllm_mode="server", vllm_importance_sampling_correction=False)
        t.record(
            rollout + "name",
            MAPPED if engine == "vllm" else APPROXIMATED,
            "use_vllm: true, vllm_mode: server",
            "generation on a vLLM server (vllm_server.sh)" + ("" if engine == "vllm" else "; verl used SGLang"),
        )
        t.default(
            "algorithm.rollout_correction.rollout_is",
            MAPPED,
            "vllm_importance_sampling_correction: false",
            "verl applies no rollout importance correction unless algorithm.rollout_correction says so "
            "(TRL's default is on)",
        )
    else:
        t.set(use_vllm=False)
        t.mark(rollout + "name", MAPPED, "use_vllm: false", "generation with transformers")
    temperature = float(t.value(rollout + "temperature"))
    top_p = float(t.value(rollout + "top_p"))
    top_k = int(t.value(rollout + "top_k"))
    t.set(temperature=temperature, top_p=top_p, top_k=max(top_k, 0))
    t.mark(rollout + "temperature", MAPPED, _field("temperature", temperature), "sampling temperature")
    t.mark(rollout + "top_p", MAPPED, _field("top_p", top_p), "nucleus sampling")
    t.mark(rollout + "top_k", MAPPED, _field("top_k", max(top_k, 0)), "-1 (verl) = 0 (TRL): no top-k")
    if _boolean(t.value(rollout + "do_sample")):
        t.mark(rollout + "do_sample", MAPPED, "(sampling)", "sampled rollouts")
    else:
        t.mark(
            rollout + "do_sample", UNSUPPORTED, "", "greedy training rollouts make every group constant", blocking=True
        )
    if _boolean(t.value(rollout + "ignore_eos")):
        t.mark(rollout + "ignore_eos", UNSUPPORTED, "", "generation past EOS is not supported", blocking=True)
    else:
        t.mark(rollout + "ignore_eos", NOT_NEEDED, how="off")

    # Validation sampling. verl's vLLM/SGLang rollouts (its agent loop) sample with val_kwargs' temperature and
    # ignore val_kwargs.do_sample; its transformers rollout decodes greedily when do_sample is off.
    val = rollout + "val_kwargs."
    sampled = _boolean(t.value(val + "do_sample")) or engine in ("vllm", "sglang")
    greedy = not sampled or float(t.value(val + "temperature")) == 0
    val_temperature = GREEDY_TEMPERATURE if greedy else float(t.value(val + "temperature"))
    val_top_p = float(t.value(val + "top_p"))
    samples = int(t.value(val + "n"))
    t.set(eval_num_samples=samples, eval_temperature=val_temperature, eval_top_p=val_top_p)
    greedy_how = (
        "greedy validation (verl: temperature 0, or do_sample off with the transformers rollout): eval_temperature "
        "1e-6, which vLLM samples greedily and transformers nearly so"
    )
    t.record(val + "n", MAPPED, _field("eval_num_samples", samples), "responses per validation prompt (avg@n)")
    t.record(
        val + "temperature",
        APPROXIMATED if greedy else MAPPED,
        _field("eval_temperature", val_temperature),
        greedy_how if greedy else "validation temperature",
    )
    t.record(val + "top_p", MAPPED, _field("eval_top_p", val_top_p), "validation nucleus sampling")
    if engine in ("vllm", "sglang"):
        t.mark(
            val + "do_sample", NOT_NEEDED, how="verl's vLLM/SGLang rollout ignores it: val_kwargs.temperature decides"
        )
    else:
        t.mark(
            val + "do_sample",
            APPROXIMATED if greedy else MAPPED,
            "see val_kwargs.temperature",
            greedy_how if greedy else "sampled validation",
        )
    val_top_k = int(t.value(val + "top_k"))
    t.mark(
        val + "top_k",
        NOT_NEEDED if val_top_k <= 0 else UNSUPPORTED,
        "",
        "-1: no top-k" if val_top_k <= 0 else "validation top-k is not configurable",
    )

    # vLLM server.
    tp = int(t.value(rollout + "tensor_model_parallel_size"))
    dp = int(t.value(rollout + "data_parallel_size"))
    memory = float(t.value(rollout + "gpu_memory_utilization"))
    explicit_length = t.value(rollout + "max_model_len")
    length = (
        int(explicit_length)
        if explicit_length
        else int(t.recipe["max_prompt_length"]) + int(t.recipe["max_completion_length"])
    )
    extra: list[str] = []
    flags = {
        "max_num_batched_tokens": "--max-num-batched-tokens",
        "max_num_seqs": "--max-num-seqs",
    }
    for name, flag in flags.items():
        if t.given(rollout + name):
            extra += [flag, str(t.value(rollout + name))]
            t.mark(rollout + name, MAPPED, f"vllm_server.sh {flag} {t.value(rollout + name)}", "vLLM engine setting")
    switches = {"enable_chunked_prefill": "chunked-prefill", "enable_prefix_caching": "prefix-caching"}
    for name, flag in switches.items():
        if t.given(rollout + name):
            on = _boolean(t.value(rollout + name))
            extra.append(f"--{'' if on else 'no-'}enable-{flag}")
            t.mark(rollout + name, MAPPED, f"vllm_server.sh {extra[-1]}", "vLLM engine setting")
    if _boolean(t.value(rollout + "enforce_eager")):
        extra.append("--enforce-eager")
        t.mark(rollout + "enforce_eager", MAPPED, "vllm_server.sh --enforce-eager", "vLLM engine setting")
    else:
        t.mark(rollout + "enforce_eager", NOT_NEEDED, how="off")
    for key in [k for k in t.found.values if k.startswith(rollout + "engine_kwargs.vllm.")]:
        flag = "--" + key.rsplit(".", 1)[-1].replace("_", "-")
        value = t.found.values[key]
        extra += [flag] if value is True else [flag, _show(value)]
        t.mark(key, APPROXIMATED, f"vllm_server.sh {flag}", "passed to vllm serve under the same name")
    model = str(t.recipe.get("model_name_or_path", "MODEL_PATH"))
    t.vllm = VLLMServer(model, tp, dp, memory, length, str(t.value(rollout + "dtype")), extra)
    if engine in ("vllm", "sglang"):
        t.record(rollout + "tensor_model_parallel_size", MAPPED, f"vllm_server.sh TP={tp}", "tensor parallel size")
        t.record(
            rollout + "gpu_memory_utilization",
            MAPPED,
            f"vllm_server.sh GPU_MEMORY_UTILIZATION={memory:g}",
            "KV-cache share of the server's GPUs",
        )
        t.mark(rollout + "data_parallel_size", MAPPED, f"vllm_server.sh DP={dp}", "engine replicas")
        t.mark(rollout + "max_model_len", MAPPED, f"vllm_server.sh MAX_MODEL_LEN={length}", "context length")
        t.mark(rollout + "dtype", MAPPED, f"vllm_server.sh DTYPE={t.value(rollout + 'dtype')}", "rollout dtype")
    else:
        for name in (
            "tensor_model_parallel_size",
            "gpu_memory_utilization",
            "data_parallel_size",
            "max_model_len",
            "dtype",
        ):
            t.mark(rollout + name, NOT_NEEDED, how=f"no vLLM: verl's {engine} rollout generates with transformers")
    _map_multi_turn(t)


def _map_multi_turn(t: Translation) -> None:
    turns = "actor_rollout_ref.rollout.multi_turn."
    config_path = t.value(turns + "tool_config_path")
    enabled = _boolean(t.value(turns + "enable"))
    if not config_path:
        t.mark_all(turns + "*", NOT_NEEDED, how="no tools (multi_turn.tool_config_path unset)")
        return
    t.set(tool_config=str(config_path), chat_template="qwen2_5")
    located = _locate(str(config_path), t.found.source)
    how = "verl's tool YAML, read by train_dapo.py --tool_config (implies --tools code_interpreter)"
    if located is not None:
        from .tools.verl_config import ToolConfigError, load_verl_tool_config

        try:
            settings = load_verl_tool_config(located, world_size=t.batch.world_size)
        except ToolConfigError as error:
            t.mark(turns + "tool_config_path", UNSUPPORTED, "", str(error), blocking=True)
        else:
            t.files["tool_config.yaml"] = located
            t.set(tool_config="tool_config.yaml")
            how += f"; copied into the output ({'; '.join(settings.notes)})"
    else:
        how += f"; {config_path} was not found here: put verl's file at that path (relative to where you run)"
    t.mark(turns + "tool_config_path", MAPPED, "tool_config: <that YAML>", how)
    t.mark(
        turns + "enable",
        MAPPED if enabled else APPROXIMATED,
        "(tools on)",
        "multi-turn tool calling" if enabled else "verl's multi_turn.enable is off but a tool config is set",
    )
    fmt = str(t.value(turns + "format"))
    t.record(
        turns + "format",
        MAPPED if fmt == "hermes" else APPROXIMATED,
        "chat_template: qwen2_5",
        "Hermes tool calls (<tool_call>...</tool_call>) through Qwen2.5's template; drop chat_template to keep "
        "a model's own template if it renders tool calls",
    )
    assistant = t.value(turns + "max_assistant_turns")
    user = t.value(turns + "max_user_turns")
    limits = [int(assistant) - 1] if assistant else []
    limits += [int(user)] if user else []
    rounds = max(min(limits), 0) if limits else None
    t.set(max_tool_calling_iterations=rounds)
    t.record(
        turns + "max_assistant_turns",
        MAPPED,
        _field("max_tool_calling_iterations", rounds),
        "tool rounds = assistant turns - 1 (the last turn answers)" if assistant else "null: no limit",
    )
    t.mark(
        turns + "max_user_turns",
        MAPPED,
        _field("max_tool_calling_iterations", rounds),
        "tool replies are verl's user turns: the tighter of the two limits",
    )
    chars = int(t.value(turns + "max_tool_response_length"))
    t.set(tool_max_output_chars=max(chars, 64))
    t.record(
        turns + "max_tool_response_length",
        MAPPED if chars >= 64 else APPROXIMATED,
        _field("tool_max_output_chars", max(chars, 64)),
        "characters of a tool reply the model reads",
    )
    side = str(t.value(turns + "tool_response_truncate_side"))
    t.mark(
        turns + "tool_response_truncate_side",
        MAPPED if side == "middle" else APPROXIMATED,
        "(head and tail kept)",
        "long replies lose their middle" + ("" if side == "middle" else f"; verl cut the {side} side"),
    )
    parallel = int(t.value(turns + "max_parallel_calls"))
    t.record(
        turns + "max_parallel_calls",
        APPROXIMATED,
        "(every call of a turn runs)",
        f"verl runs at most {parallel} tool call(s) per turn; TRL runs every call the turn makes",
    )
    if t.value(turns + "interaction_config_path"):
        t.mark(
            turns + "interaction_config_path",
            UNSUPPORTED,
            "",
            "verl interactions (simulated users) are not supported",
            blocking=True,
        )


def _locate(path: str, source: str) -> Path | None:
    """A relative path of the verl run found from here or from the input's folder (and its parents)."""
    candidate = Path(os.path.expanduser(path))
    if candidate.is_absolute():
        return candidate if candidate.is_file() else None
    bases = [Path.cwd(), *Path(source).resolve().parents]
    for base in bases:
        if (base / candidate).is_file():
            return base / candidate
    return None


def map_trainer(t: Translation) -> None:
    per_rollout = t.batch.updates_per_rollout
    loggers = [str(name) for name in _as_list(t.value("trainer.logger"))]
    known = {
        "wandb": "wandb",
        "tensorboard": "tensorboard",
        "mlflow": "mlflow",
        "swanlab": "swanlab",
        "trackio": "trackio",
    }
    report_to = [known[name] for name in loggers if name in known] or ["none"]
    t.set(report_to=report_to if len(report_to) > 1 else report_to[0])
    others = [name for name in loggers if name not in known and name != "console"]
    t.record(
        "trainer.logger",
        APPROXIMATED if others else MAPPED,
        _field("report_to", report_to),
        "console logging is the Trainer's own" + (f"; {others} have no counterpart" if others else ""),
    )
    project = t.value("trainer.project_name")
    experiment = t.value("trainer.experiment_name")
    t.set(run_name=str(experiment), project=str(project))
    t.record("trainer.experiment_name", MAPPED, _field("run_name", experiment), "the run's name in the loggers")
    t.record(
        "trainer.project_name",
        APPROXIMATED,
        _field("project", project),
        "TrainingArguments' project is used by Trackio; for wandb export WANDB_PROJECT as well",
    )
    output_dir = str(t.value("trainer.default_local_dir"))
    output_dir = output_dir.replace("${trainer.project_name}", str(project)).replace(
        "${trainer.experiment_name}", str(experiment)
    )
    t.set(output_dir=output_dir)
    t.record("trainer.default_local_dir", MAPPED, _field("output_dir", output_dir), "checkpoints and the model")

    save = int(t.value("trainer.save_freq") or -1)
    if save > 0:
        t.set(save_strategy="steps", save_steps=save * per_rollout)
        t.mark(
            "trainer.save_freq",
            MAPPED,
            f"save_strategy: steps, save_steps: {save * per_rollout}",
            f"every {save} rollout steps x K={per_rollout} optimizer steps",
        )
        t.step_rows.append(
            (
                "checkpoint every",
                f"save_freq = {save} rollout steps",
                f"save_steps = {save} x {per_rollout} = {save * per_rollout}",
            )
        )
    else:
        t.set(save_strategy="no")
        t.record(
            "trainer.save_freq",
            MAPPED,
            "save_strategy: 'no'",
            "no intermediate checkpoints (train_dapo.py still saves the final model)",
        )
    has_eval = "eval_dataset_name" in t.recipe
    test = int(t.value("trainer.test_freq") or -1)
    if test > 0 and has_eval:
        t.set(eval_strategy="steps", eval_steps=test * per_rollout)
        t.mark(
            "trainer.test_freq",
            APPROXIMATED,
            f"eval_strategy: steps, eval_steps: {test * per_rollout}",
            f"every {test} rollout steps x K={per_rollout}; verl also validates after the last step, the "
            "Trainer only on multiples of eval_steps",
        )
        t.step_rows.append(
            (
                "validation every",
                f"test_freq = {test} rollout steps",
                f"eval_steps = {test} x {per_rollout} = {test * per_rollout}",
            )
        )
    else:
        t.set(eval_strategy="no")
        t.mark(
            "trainer.test_freq",
            MAPPED if test <= 0 else APPROXIMATED,
            "eval_strategy: 'no'",
            "no periodic validation" + ("" if test <= 0 else " (no data.val_files to validate on)"),
        )
    before = _boolean(t.value("trainer.val_before_train")) and has_eval
    t.set(val_before_train=before)
    t.record(
        "trainer.val_before_train",
        MAPPED,
        _field("val_before_train", before),
        "validate once before the first step" + ("" if has_eval else " (no validation set: off)"),
    )
    if has_eval:
        # TRL's eval batch must hold whole groups: per_device_eval_batch_size x processes divisible by
        # num_generations. A multiple of num_generations (at least TRL's 8) holds for any number of processes.
        groups = t.batch.num_generations
        t.set(per_device_eval_batch_size=groups * math.ceil(8 / groups))
        t.notes.append(
            f"per_device_eval_batch_size {t.recipe['per_device_eval_batch_size']}: TRL's eval batches must hold "
            f"whole groups of num_generations={groups} on any number of processes"
        )
    t.set(logging_steps=per_rollout)
    t.step_rows.append(("metrics logged every", "rollout step", f"logging_steps = K = {per_rollout}"))
    mode = str(t.value("trainer.resume_mode"))
    if mode == "disable":
        t.mark("trainer.resume_mode", MAPPED, "(no resume)", "start from scratch")
    else:
        t.mark(
            "trainer.resume_mode",
            APPROXIMATED,
            "(resume by hand)",
            f"verl resumes {mode} from its own checkpoints; here pass --resume_from_checkpoint "
            "OUTPUT_DIR/checkpoint-N (dapo-trl checkpoints; verl's cannot be loaded)",
        )
    if t.value("trainer.resume_from_path"):
        t.mark(
            "trainer.resume_from_path",
            UNSUPPORTED,
            "",
            "verl checkpoints cannot be loaded: merge it to a "
            "Hugging Face model with verl's model merger and pass it as model_name_or_path",
        )
    generations = int(t.value("trainer.log_val_generations") or 0)
    if generations > 0:
        t.set(eval_samples_to_log=generations)
        t.mark(
            "trainer.log_val_generations",
            APPROXIMATED,
            _field("eval_samples_to_log", generations),
            "validation responses of that many prompts are written to output_dir/eval_samples/*.jsonl "
            "(verl sends them to the logger)",
        )
    if _boolean(t.value("trainer.val_only")):
        t.mark(
            "trainer.val_only", UNSUPPORTED, "", "validation-only runs: use python -m dapo_trl.evaluate", blocking=True
        )
    for key in ("trainer.rollout_data_dir", "trainer.validation_data_dir", "trainer.default_hdfs_dir"):
        if t.value(key):
            t.mark(
                key,
                UNSUPPORTED,
                "",
                "no dumps of rollouts to a folder or HDFS copies here (validation samples "
                "go to output_dir/eval_samples)",
            )


def plan_accelerate(t: Translation) -> None:
    """ZeRO-3 (with CPU offload) when verl offloads, ZeRO-3 for models of ZERO3_MIN_BILLIONS or more (or of unknown
    size: verl's FSDP shards always), else DDP; from configs/accelerate/*.yaml."""
    offload_param = _boolean(t.value("actor_rollout_ref.actor.fsdp_config.param_offload"))
    offload_optimizer = _boolean(t.value("actor_rollout_ref.actor.fsdp_config.optimizer_offload"))
    nnodes, world = int(t.value("trainer.nnodes")), t.batch.world_size
    size = model_size_billions(t.recipe.get("model_name_or_path"))
    if offload_param or offload_optimizer:
        template = "zero3_offload_1node_8gpu.yaml"
        offloaded = " and ".join(
            name for name, on in (("param_offload", offload_param), ("optimizer_offload", offload_optimizer)) if on
        )
        rule = f"ZeRO-3 with CPU offload: the script sets fsdp_config.{offloaded}"
        if not (offload_param and offload_optimizer):
            rule += " (the DeepSpeed config offloads both parameters and optimizer state)"
    elif size is None:
        template = "zero3_1node_8gpu.yaml"
        rule = "ZeRO-3: the model's size is not in its path, so it is sharded as verl's FSDP shards it"
    elif size >= ZERO3_MIN_BILLIONS:
        template = "zero3_1node_8gpu.yaml"
        rule = f"ZeRO-3: {size:g}B parameters (from the model path) >= {ZERO3_MIN_BILLIONS:g}B"
    else:
        template = "single_gpu.yaml"
        rule = f"DDP: {size:g}B parameters (from the model path) < {ZERO3_MIN_BILLIONS:g}B fit on every GPU"
    config = yaml.safe_load((ACCELERATE_TEMPLATES / template).read_text(encoding="utf-8"))
    if template == "single_gpu.yaml" and world > 1:
        config["distributed_type"] = "MULTI_GPU"
    config["num_machines"] = nnodes
    config["num_processes"] = world
    t.accelerate = config
    t.accelerate_rule = f"{rule} (template configs/accelerate/{template})"
    for key in (
        "actor_rollout_ref.actor.fsdp_config.param_offload",
        "actor_rollout_ref.actor.fsdp_config.optimizer_offload",
    ):
        t.mark(key, MAPPED, f"accelerate.yaml distributed_type: {config['distributed_type']}", rule)
    t.mark(
        "actor_rollout_ref.actor.strategy",
        MAPPED,
        f"accelerate.yaml distributed_type: {config['distributed_type']}",
        rule,
    )


def apply_simple_rules(t: Translation) -> None:
    for key, rule in SIMPLE_RULES.items():
        if t.given(key) and t.value(key) is None:
            t.mark(key, NOT_NEEDED, how="null: the Trainer's default")
        elif t.given(key):
            value = rule.convert(t.value(key))
            t.set(**{rule.field: value})
            t.mark(key, MAPPED, _field(rule.field, value), rule.how)
        elif rule.default and key in VERL_DEFAULTS:
            value = rule.convert(VERL_DEFAULTS[key])
            t.set(**{rule.field: value})
            t.default(key, MAPPED, _field(rule.field, value), rule.how)


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
    map_trainer(t)
    plan_accelerate(t)
    mark_remaining(t)
    return t


# ---------------------------------------------------------------------------------------------- writing
RECIPE_SECTIONS: list[tuple[str, tuple[str, ...]]] = [
    (
        "Model and data",
        (
            "model_name_or_path",
            "dtype",
            "use_peft",
            "lora_r",
            "lora_alpha",
            "lora_target_modules",
            "trust_remote_code",
            "use_liger_kernel",
            "dataset_name",
            "eval_dataset_name",
            "prompt_column",
            "prompt_template",
            "chat_template",
            "chat_template_kwargs",
            "max_prompt_length",
            "overlong_prompt_policy",
            "max_completion_length",
            "shuffle_dataset",
            "dataloader_num_workers",
            "seed",
        ),
    ),
    (
        "Batch layout (see report.md: responses per update and per rollout step equal verl's)",
        (
            "num_generations",
            "per_device_train_batch_size",
            "gradient_accumulation_steps",
            "steps_per_generation",
            "num_iterations",
            "max_tokens_per_microbatch",
            "per_device_eval_batch_size",
        ),
    ),
    (
        "DAPO / PPO loss",
        ("loss_type", "epsilon", "epsilon_high", "clip_ratio_c", "beta", "entropy_coeff", "scale_rewards"),
    ),
    (
        "Reward and dynamic sampling",
        (
            "reward_funcs",
            "apply_overlong_penalty",
            "overlong_buffer_len",
            "overlong_penalty_factor",
            "filter_groups_enable",
            "max_filter_gen_batches",
            "filter_groups_oversample",
            "filter_groups_on_exhausted",
        ),
    ),
    (
        "Optimizer and schedule (steps are optimizer steps: verl's rollout steps x K)",
        (
            "learning_rate",
            "weight_decay",
            "max_grad_norm",
            "lr_scheduler_type",
            "lr_scheduler_kwargs",
            "warmup_steps",
            "num_train_epochs",
            "max_steps",
        ),
    ),
    (
        "Generation",
        (
            "use_vllm",
            "vllm_mode",
            "vllm_importance_sampling_correction",
            "temperature",
            "top_p",
            "top_k",
            "padding_free",
            "activation_checkpointing",
        ),
    ),
    ("Tools", ("tool_config", "max_tool_calling_iterations", "tool_max_output_chars")),
    (
        "Validation",
        (
            "eval_strategy",
            "eval_steps",
            "val_before_train",
            "eval_num_samples",
            "eval_temperature",
            "eval_top_p",
            "eval_samples_to_log",
        ),
    ),
    (
        "Output and logging",
        (
            "output_dir",
            "run_name",
            "project",
            "report_to",
            "logging_steps",
            "save_strategy",
            "save_steps",
            "save_total_limit",
        ),
    ),
]


def recipe_yaml(t: Translation) -> str:
    """The recipe as commented YAML sections; every field once."""
    lines = [
        f"# dapo-trl recipe translated from the verl run {t.found.source} by `python -m dapo_trl.from_verl`.",
        "# Train:  accelerate launch --config_file <DIR>/accelerate.yaml train_dapo.py --config <DIR>/recipe.yaml",
        "# What each verl key became, and why: report.md next to this file.",
    ]
    placed: set[str] = set()
    sections = [*RECIPE_SECTIONS, ("Other", tuple(t.recipe))]
    for title, names in sections:
        fields = {name: t.recipe[name] for name in names if name in t.recipe and name not in placed}
        if not fields:
            continue
        placed.update(fields)
        lines += ["", f"# {title}"]
        for name, value in fields.items():
            lines.append(yaml.safe_dump({name: value}, sort_keys=False, width=1000).rstrip())
    return "\n".join(lines) + "\n"


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def report_markdown(t: Translation, out_dir: Path | None) -> str:
    here = str(out_dir) if out_dir is not None else "DIR"
    counts = {status: 0 for status in (MAPPED, APPROXIMATED, UNSUPPORTED, NOT_NEEDED)}
    for entry in t.entries.values():
        counts[entry.status] += 1
    found = t.found
    lines = [
        "# verl -> dapo-trl translation report",
        "",
        f"Input: `{found.source}` ({found.kind}" + (f", command `{found.command}`" if found.command else "") + ")",
        "",
        f"{len(t.entries)} keys: {counts[MAPPED]} mapped, {counts[APPROXIMATED]} approximated, "
        f"{counts[UNSUPPORTED]} unsupported, {counts[NOT_NEEDED]} not needed (verl infrastructure). "
        f"{len(t.defaults)} verl defaults applied for keys the input does not set.",
        "",
    ]
    if t.blocking:
        lines += ["## Blocking: these change the training and cannot be translated", ""]
        lines += [f"- `{entry.key}` = `{_cell(entry.value)}`: {entry.how}" for entry in t.blocking]
        lines += [
            "",
            "The translator exits with status 1 (only this report is written) unless --allow-unsupported.",
            "",
        ]
    lines += [
        "## How to run",
        "",
        "From the dapo-trl checkout (accelerate.yaml names configs/deepspeed/*.json relative to it):",
        "",
        "```bash",
    ]
    launch = f"accelerate launch --config_file {here}/accelerate.yaml train_dapo.py --config {here}/recipe.yaml"
    if t.recipe.get("use_vllm") and t.vllm:
        lines += [f"{here}/vllm_server.sh    # = {t.vllm.script_command()}", launch + " --vllm_server_host HOST"]
    else:
        lines.append(launch)
    lines += [
        "```",
        "",
        f"Launch: {t.accelerate_rule}; {t.accelerate.get('num_machines')} machine(s), "
        f"{t.accelerate.get('num_processes')} processes. With several machines run the launch on each with "
        "`--machine_rank R --main_process_ip HOST0 --main_process_port PORT` (as run_dapo.sh does).",
        "",
    ]
    if t.vllm and t.recipe.get("use_vllm"):
        lines += [
            f"vLLM: the same server with TRL's launcher: `{t.vllm.trl_command()}` (without the extra engine flags). "
            "verl generates on the training GPUs (one engine per tensor-parallel group, "
            f"{t.batch.world_size // max(1, t.vllm.tensor_parallel_size)} here); a server needs GPUs of its own, "
            "and DP replicas give it that throughput. To generate on the training GPUs instead, as verl does: "
            f"`--vllm_mode colocate --vllm_tensor_parallel_size {t.vllm.tensor_parallel_size} "
            f"--vllm_gpu_memory_utilization {t.vllm.gpu_memory_utilization:g}`.",
            "",
        ]
    lines += [
        "## Batch and step arithmetic",
        "",
        "verl counts save_freq, test_freq, warm-up and total_training_steps in rollout steps (one per "
        "generation batch); TRL counts optimizer steps, K per rollout step.",
        "",
        "| quantity | verl | dapo-trl |",
        "|---|---|---|",
    ]
    lines += [f"| {_cell(a)} | {_cell(b)} | {_cell(c)} |" for a, b, c in t.step_rows]
    lines.append("")
    sections = [
        (UNSUPPORTED, "Unsupported", "why"),
        (APPROXIMATED, "Approximated", "how"),
        (MAPPED, "Mapped", "how"),
        (NOT_NEEDED, "Not needed (nothing to translate)", "why"),
    ]
    for status, title, column in sections:
        entries = [entry for entry in t.entries.values() if entry.status == status]
        if not entries:
            continue
        lines += [f"## {title}", "", f"| key | value | becomes | {column} |", "|---|---|---|---|"]
        for entry in entries:
            flag = " **(blocking)**" if entry.blocking else ""
            lines.append(
                f"| `{_cell(entry.key)}` | `{_cell(entry.value)}` | {_cell(entry.target)} | {_cell(entry.how)}{flag} |"
            )
        lines.append("")
    if t.defaults:
        lines += [
            "## verl defaults applied (keys the input does not set)",
            "",
            "| key | verl default | becomes | how |",
            "|---|---|---|---|",
        ]
        for entry in t.defaults:
            flag = " **(blocking)**" if entry.blocking else ""
            lines.append(
                f"| `{entry.key}` | `{_cell(entry.value)}` | {_cell(entry.target)} | {_cell(entry.how)}{flag} |"
            )
        lines.append("")
    if t.notes:
        lines += ["## Notes", ""] + [f"- {note}" for note in t.notes] + [""]
    return "\n".join(lines) + "\n"


def vllm_script(t: Translation) -> str:
    environment = " ".join(f"{name}={shlex.quote(value)}" for name, value in t.vllm.environment().items())
    extra = " ".join(shlex.quote(arg) for arg in t.vllm.extra_args)
    return (
        "#!/usr/bin/env bash\n"
        f"# vLLM server for the recipe translated from {t.found.source}; run it from the dapo-trl checkout.\n"
        "# Then train with --vllm_server_host THIS_HOST (see report.md). Extra arguments go to vllm serve.\n"
        "set -euo pipefail\n"
        f'exec env {environment} scripts/start_vllm_server.sh {extra + " " if extra else ""}"$@"\n'
    )


def write_outputs(t: Translation, out_dir: Path, *, report_only: bool = False) -> list[Path]:
    """Write report.md, and unless `report_only` the recipe, accelerate config, vLLM script and extra files."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = [out_dir / "report.md"]
    written[0].write_text(report_markdown(t, out_dir), encoding="utf-8")
    if report_only:  # no recipe: remove one a previous translation left here, so none is used by mistake
        for name in ("recipe.yaml", "accelerate.yaml", "vllm_server.sh"):
            (out_dir / name).unlink(missing_ok=True)
        return written
    recipe = dict(t.recipe)
    for name, content in t.files.items():
        target = out_dir / name
        if isinstance(content, Path):
            shutil.copyfile(content, target)
        else:
            target.write_text(content, encoding="utf-8")
        written.append(target)
        for key in ("tool_config", "chat_template"):
            if recipe.get(key) == name:
                recipe[key] = str(target.resolve())  # the recipe may be used from another folder
    t.recipe = recipe
    (out_dir / "recipe.yaml").write_text(recipe_yaml(t), encoding="utf-8")
    header = (
        f"# accelerate launch --config_file {out_dir / 'accelerate.yaml'} train_dapo.py --config "
        f"{out_dir / 'recipe.yaml'}\n# {t.accelerate_rule}. Run from the dapo-trl checkout.\n"
    )
    (out_dir / "accelerate.yaml").write_text(header + yaml.safe_dump(t.accelerate, sort_keys=False), "utf-8")
    script = out_dir / "vllm_server.sh"
    script.write_text(vllm_script(t), encoding="utf-8")
    script.chmod(0o755)
    written += [out_dir / "recipe.yaml", out_dir / "accelerate.yaml", script]
    return written


# ---------------------------------------------------------------------------------------------- command line
def parse_arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m dapo_trl.from_verl",
        description="Translate a verl run script (python3 -m verl.trainer.main_ppo key=value ...) or verl YAML "
        "config into a dapo-trl recipe: DIR/recipe.yaml (train_dapo.py --config), DIR/accelerate.yaml, "
        "DIR/vllm_server.sh and DIR/report.md (what became of every key).",
    )
    parser.add_argument("source", help="verl run script (shell) or verl YAML config (.yaml/.yml)")
    parser.add_argument("overrides", nargs="*", help="extra key=value overrides, appended as the script's $@ would be")
    parser.add_argument("--output", "-o", required=True, help="folder to write the recipe and the report into")
    parser.add_argument(
        "--env", action="append", default=[], metavar="NAME=VALUE", help="a variable for the script (repeatable)"
    )
    parser.add_argument(
        "--ignore-environment",
        action="store_true",
        help="resolve the script's variables from its own assignments and --env only, not this shell's environment",
    )
    parser.add_argument(
        "--allow-unsupported",
        action="store_true",
        help="write the recipe even when a key that changes the training (e.g. KL in the reward) cannot be "
        "translated, and exit 0",
    )
    return parser.parse_intermixed_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_arguments(argv)
    environment: dict[str, str] = {} if args.ignore_environment else dict(os.environ)
    for item in args.env:
        name, sep, value = item.partition("=")
        if not sep or not name:
            print(f"error: --env {item!r}: expected NAME=VALUE", file=sys.stderr)
            return 2
        environment[name] = value
    try:
        found = read_verl_input(args.source, environment, args.overrides)
    except VerlInputError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    t = translate(found)
    out_dir = Path(args.output)
    unresolved = {key: found.unresolved[key] for key in found.unresolved}
    if unresolved and not args.allow_unsupported:
        write_outputs(t, out_dir, report_only=True)
        print("error: variables the script does not set and the environment does not have:", file=sys.stderr)
        for key, variables in unresolved.items():
            print(f"  {key}: {', '.join(variables)}", file=sys.stderr)
        print(
            "set them with --env NAME=VALUE (or export them), or pass --allow-unsupported to skip those keys; "
            f"see {out_dir / 'report.md'}",
            file=sys.stderr,
        )
        return 2
    blocking = t.blocking
    if blocking and not args.allow_unsupported:
        write_outputs(t, out_dir, report_only=True)
        print("error: these keys change the training and cannot be translated:", file=sys.stderr)
        for entry in blocking:
            print(f"  {entry.key} = {entry.value}: {entry.how}", file=sys.stderr)
        print(f"see {out_dir / 'report.md'}; --allow-unsupported writes the recipe anyway", file=sys.stderr)
        return 1
    written = write_outputs(t, out_dir)
    counts = {
        status: sum(e.status == status for e in t.entries.values())
        for status in (MAPPED, APPROXIMATED, UNSUPPORTED, NOT_NEEDED)
    }
    print(f"translated {len(t.entries)} keys from {found.source}: " + ", ".join(f"{n} {s}" for s, n in counts.items()))
    for path in written:
        print(f"  {path}")
    for entry in blocking:
        print(f"warning: not translated ({entry.key}): {entry.how}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
