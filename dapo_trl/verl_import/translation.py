"""The record of one translation (`Translation`: the recipe being built and what became of every key, `Entry`),
the statuses a key can get, and verl's defaults for the keys the mapping reads.
"""

from __future__ import annotations

import fnmatch
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .hydra import VerlInput
from .plans import BatchPlan, VLLMServer

MAPPED, APPROXIMATED, UNSUPPORTED, NOT_NEEDED = "mapped", "approximated", "unsupported", "not needed"


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
    "actor_rollout_ref.model.exclude_modules": None,
    "actor_rollout_ref.model.lora_adapter_path": None,
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
    "actor_rollout_ref.actor.tau_pos": 1.0,
    "actor_rollout_ref.actor.tau_neg": 1.05,
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
    "actor_rollout_ref.actor.router_replay.mode": "disabled",
    "actor_rollout_ref.model.override_config.router_aux_loss_coef": None,
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
    "actor_rollout_ref.rollout.enable_rollout_routing_replay": False,
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
    "algorithm.kl_penalty": "kl",
    "algorithm.kl_ctrl.type": "fixed",
    "algorithm.kl_ctrl.kl_coef": 0.001,
    "algorithm.kl_ctrl.horizon": 10000,
    "algorithm.kl_ctrl.target_kl": 0.1,
    "algorithm.rollout_correction.rollout_is": None,  # verl/trainer/config/algorithm/rollout_correction.yaml
    "algorithm.rollout_correction.rollout_is_threshold": 2.0,
    "algorithm.rollout_correction.rollout_is_batch_normalize": False,
    "algorithm.rollout_correction.rollout_rs": None,
    "algorithm.rollout_correction.rollout_rs_threshold": None,
    "algorithm.rollout_correction.rollout_rs_threshold_lower": None,  # verl 0.6.1-0.7
    "algorithm.rollout_correction.rollout_token_veto_threshold": None,  # verl 0.6.1-0.7
    "algorithm.rollout_correction.bypass_mode": False,
    "algorithm.rollout_correction.loss_type": "ppo_clip",  # verl 0.7 and later
    "algorithm.rollout_correction.use_policy_gradient": False,  # verl 0.6.1's loss_type=reinforce
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


def as_boolean(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in ("true", "1", "yes")
    return bool(value)


def as_list(value: Any) -> list[Any]:
    if value is None:
        return []
    return list(value) if isinstance(value, list | tuple) else [value]


@dataclass
class Entry:
    """What became of one verl key."""

    key: str
    value: str
    status: str
    target: str = ""
    how: str = ""
    blocking: bool = False  # unsupported in a way that changes the training: exit 1 unless --allow-unsupported


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
            written = self.found.written.get(key, show_value(self.found.values[key]))
            self.entries[key] = Entry(key, written, status, target, how, blocking)

    def mark_all(self, pattern: str, status: str, target: str = "", how: str = "", blocking: bool = False) -> None:
        for key in list(self.found.values):
            if fnmatch.fnmatchcase(key, pattern):
                self.mark(key, status, target, how, blocking)

    def default(self, key: str, status: str, target: str, how: str, blocking: bool = False) -> None:
        """Record a verl default applied because the input does not set `key` (listed in its own report section)."""
        if not self.given(key):
            self.defaults.append(Entry(key, show_value(VERL_DEFAULTS.get(key)), status, target, how, blocking))

    def record(self, key: str, status: str, target: str, how: str, blocking: bool = False) -> None:
        """`mark` when the input sets the key, else `default`."""
        if self.given(key):
            self.mark(key, status, target, how, blocking)
        else:
            self.default(key, status, target, how, blocking)

    @property
    def blocking(self) -> list[Entry]:
        return [entry for entry in [*self.entries.values(), *self.defaults] if entry.blocking]


def show_value(value: Any) -> str:
    if isinstance(value, str):
        return value
    return json.dumps(value) if isinstance(value, list | dict | bool) or value is None else str(value)


def recipe_line(name: str, value: Any) -> str:
    return f"{name}: {show_value(value)}"
