"""The one seam to TRL: every private name of TRL (and of the transformers / accelerate internals GRPOTrainer hands
us) that dapo-trl relies on, checked against what is installed when a DAPOTrainer is built.

TRL does not promise its private surface. If an upgrade renames `_generate`, an override of it is simply never
called again and the run trains without tool metrics, or without the overlong penalty, and nobody notices. So every
such name is listed here once, with what we use it for, and `check_trl_classes` (before GRPOTrainer's constructor)
and `check_trainer_attributes` (after it) fail with one message naming each missing name and the supported TRL
range. The rest of the package reaches these names only through this module: the helpers below (`generate`,
`metrics`, `shuffle_and_split`, ...) and `trl_function`. DAPOTrainer's overrides of the methods in
`OVERRIDDEN_METHODS` call `super()` as usual, but one: `_compute_loss`, which DAPOTrainer replaces with the loss
table's (`training.step.policy_loss`), so the loss a reader finds in `dapo_trl.algorithm.losses` is the one that trains.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

SUPPORTED_TRL = ">=1.16,<1.17"


@dataclass(frozen=True)
class PrivateName:
    """A name outside TRL's documented API: where it lives, and what dapo-trl uses it for."""

    owner: str  # a module path, or a class path followed by ":" and the attribute (see `_resolve_owner`)
    name: str
    use: str

    @property
    def qualified(self) -> str:
        return f"{self.owner.replace(':', '.')}.{self.name}"


_GRPO = "trl.trainer.grpo_trainer:GRPOTrainer"
_VLLM = "trl.generation.vllm_generation:VLLMGeneration"

# GRPOTrainer (and Trainer) methods DAPOTrainer overrides: a renamed one would silently stop being called.
OVERRIDDEN_METHODS = (
    PrivateName(_GRPO, "_compute_loss", "replaced: the loss of the table in dapo_trl.algorithm.losses trains"),
    PrivateName(_GRPO, "_calculate_rewards", "appends the built-in reward columns (overlong penalty, KL in reward)"),
    PrivateName(_GRPO, "_get_dataloader", "gives every process the whole prompt stream (WholeStream)"),
    PrivateName(_GRPO, "_prepare_inputs", "hands each micro-step its planned micro-batch and exact denominator"),
    PrivateName(_GRPO, "_generate_and_score_completions", "dynamic sampling: one call per round"),
    PrivateName(_GRPO, "_get_per_token_logps_and_entropies", "padding-free forwards; the log-ratio clamp"),
    PrivateName(_GRPO, "_generate", "tool metrics; the batch KL in the reward and the shaping columns read"),
    PrivateName(_GRPO, "_generate_single_turn", "prefetches tool executions turn by turn"),
    PrivateName(_GRPO, "_save_checkpoint", "saves the sampler and KL-controller state beside TRL's"),
    PrivateName(_GRPO, "_load_optimizer_and_scheduler", "restores that state on resume"),
)
# Methods called, not overridden.
CALLED_METHODS = (
    PrivateName(_GRPO, "_log_metric", "reward columns log through TRL's reward-function metric hook"),
    PrivateName(_GRPO, "_tokenize_prompts", "streaming rollout: prompt token ids for the engine, as TRL makes them"),
    PrivateName(_GRPO, "get_high_entropy_mask", "the loss's top_entropy_quantile mask, TRL's own"),
    PrivateName(_GRPO, "get_off_policy_mask", "the loss's off_policy_mask_threshold sequence mask, TRL's own"),
)
# Instance attributes every GRPOTrainer has once built, read (r) or written (w) by dapo-trl.
INSTANCE_ATTRIBUTES = (
    PrivateName(_GRPO, "_metrics", "r/w: our per-step metrics join TRL's log; validation swaps the eval ones"),
    PrivateName(_GRPO, "_tokenizer", "r: pad token, decoding"),
    PrivateName(_GRPO, "_step", "rw: the micro-step counter TRL's training_step advances (restored on resume)"),
    PrivateName(_GRPO, "_standalone_tools", "r: validation builds per-rollout tool tables from them"),
    PrivateName(_GRPO, "ref_model", "r/w: the reference of KL in the reward (built here when TRL builds none)"),
    PrivateName(_GRPO, "reward_weights", "w: the shaping columns' weights, while one batch is scored"),
    PrivateName(_GRPO, "reward_funcs", "w: the shaping columns, while one batch is scored"),
    PrivateName(_GRPO, "reward_func_names", "w: the shaping columns' names, while one batch is scored"),
    PrivateName(_GRPO, "reward_processing_classes", "w: None per shaping column, while one batch is scored"),
    PrivateName(_GRPO, "num_generations_eval", "w: validation samples eval_num_samples per prompt"),
    PrivateName(_GRPO, "max_completion_length", "w: validation's eval_max_new_tokens (the tool loop's budget)"),
    PrivateName(_GRPO, "_last_world_entropy", "r/w: the adaptive entropy controller's state, which TRL checkpoints"),
    PrivateName(_GRPO, "entropy_coef", "r/w: the entropy bonus coefficient (adaptive: moved each step)"),
    PrivateName(_GRPO, "aux_loss_enabled", "r: a mixture-of-experts router's auxiliary loss is added"),
    PrivateName(_GRPO, "router_aux_loss_coef", "r: its coefficient (the architecture's, unless set)"),
    PrivateName(_GRPO, "top_entropy_quantile", "r: the high-entropy token mask of the loss"),
)
# Instance attributes of a GRPOTrainer built with use_vllm.
VLLM_INSTANCE_ATTRIBUTES = (
    PrivateName(_GRPO, "_last_loaded_step", "w: streaming rollout loads the engine's weights itself (not TRL's sync)"),
)
# Written per batch by TRL's `_generate_and_score_completions`; validation sets them before calling `_generate`.
PER_BATCH_ATTRIBUTES = (
    PrivateName(_GRPO, "_sync_tool_dicts", "r/w: validation's per-rollout tool tables; preemption wraps their tools"),
    PrivateName(_GRPO, "_async_tool_dicts", "r/w: validation's per-rollout tool tables; preemption wraps their tools"),
)
# Transformers' Trainer internals (GRPOTrainer's base) and accelerate's: backpropagating part of a micro-batch.
TRAINER_INTERNALS = (
    PrivateName("transformers:Trainer", "_get_output_dir", "the checkpoint folder"),
    PrivateName("accelerate.state:GradientState", "_set_sync_gradients", "a backward pass without gradient sync"),
)
# Module-level functions and classes.
MODULE_NAMES = (
    PrivateName("trl.trainer.utils", "split_tensor_dict", "TRL's split of a generation batch into micro-batches"),
    PrivateName("trl.trainer.utils", "shuffle_sequence_dict", "TRL's shuffle of a generation batch"),
    PrivateName("trl.trainer.utils", "split_pixel_values_by_grid", "the same for image batches"),
    PrivateName("trl.trainer.utils", "unsplit_pixel_values_by_grid", "the same for image batches"),
    PrivateName("trl.trainer.utils", "pad", "padding KL in the reward's rows as TRL does"),
    PrivateName("trl.trainer.utils", "use_adapter", "a PEFT model's reference: the adapter off, or TRL's 'ref'"),
    PrivateName("trl.trainer.utils", "create_model_from_path", "the reference model, loaded as TRL loads it"),
    PrivateName("trl.trainer.utils", "get_config_model_id", "where the policy was loaded from"),
    PrivateName("trl.trainer.utils", "disable_dropout_in_model", "the reference model, as TRL prepares it"),
    PrivateName("trl.trainer.utils", "add_fused_lm_head", "the reference's log-probs without full logits"),
    PrivateName("trl.models", "prepare_deepspeed", "the reference model under DeepSpeed"),
    PrivateName("trl.models", "prepare_fsdp", "the reference model under FSDP"),
    PrivateName("trl.trainer.grpo_trainer", "VLLMGeneration", "swapped for our vLLM backend while GRPOTrainer builds"),
    PrivateName("trl.trainer.grpo_trainer", "gather", "the processes agree before the rewards' gather (preemption)"),
)
# TRL's vLLM backend, which `vllm_backends` subclasses.
VLLM_BACKEND_METHODS = (
    PrivateName(_VLLM, "_init_vllm", "server timeouts, no NCCL group for shared-storage sync, CPU colocate dtype"),
    PrivateName(_VLLM, "sync_weights", "shared-storage and CPU-colocate weight sync"),
    PrivateName(_VLLM, "_iter_named_params", "TRL's gathered, PEFT-merged, vLLM-named parameters"),
)

# Present only with vLLM installed: checked when a run uses vLLM.
WITH_VLLM = (
    PrivateName("trl.generation.vllm_generation", "LLM", "vLLM-CPU colocate: the engine built with the model's dtype"),
)

CLASS_NAMES = OVERRIDDEN_METHODS + CALLED_METHODS + TRAINER_INTERNALS + MODULE_NAMES + VLLM_BACKEND_METHODS


class TRLVersionError(ImportError):
    """The installed TRL lacks a private name dapo-trl relies on."""


def _resolve_owner(owner: str) -> Any:
    module_name, _, class_name = owner.partition(":")
    module = importlib.import_module(module_name)
    return getattr(module, class_name) if class_name else module


def _missing(names: tuple[PrivateName, ...], owner_of: Callable[[PrivateName], Any]) -> list[PrivateName]:
    missing = []
    for entry in names:
        try:
            found = hasattr(owner_of(entry), entry.name)
        except (ImportError, AttributeError):
            found = False
        if not found:
            missing.append(entry)
    return missing


def _raise_if_missing(missing: list[PrivateName]) -> None:
    if not missing:
        return
    import trl

    lines = "\n".join(f"  - {entry.qualified} (used to: {entry.use})" for entry in missing)
    raise TRLVersionError(
        f"dapo-trl supports trl{SUPPORTED_TRL}; the installed trl {trl.__version__} lacks what dapo-trl relies on:\n"
        f"{lines}\nInstall a supported TRL: pip install 'trl{SUPPORTED_TRL}'."
    )


def check_trl_classes(names: tuple[PrivateName, ...] = CLASS_NAMES) -> None:
    """TRL's classes and modules have every method and name dapo-trl uses, or TRLVersionError names what is missing."""
    _raise_if_missing(_missing(names, lambda entry: _resolve_owner(entry.owner)))


def check_trainer_attributes(trainer: Any, names: tuple[PrivateName, ...] = INSTANCE_ATTRIBUTES) -> None:
    """A built GRPOTrainer has every instance attribute dapo-trl reads or writes, or TRLVersionError says which."""
    _raise_if_missing(_missing(names, lambda entry: trainer))


def trl_function(name: str) -> Any:
    """A module-level TRL function or class from `MODULE_NAMES`, by name (imported when first needed)."""
    for entry in MODULE_NAMES:
        if entry.name == name:
            return getattr(_resolve_owner(entry.owner), name)
    raise KeyError(f"{name!r} is not a TRL name listed in dapo_trl.training.trl_seam.MODULE_NAMES")


def trl_vllm_generation() -> type:
    """TRL's vLLM generation backend class (`trl.generation.vllm_generation.VLLMGeneration`)."""
    return _resolve_owner(_VLLM)


# ------------------------------------------------------------------------------------------- GRPOTrainer state
class GenerationOutput(NamedTuple):
    """What TRL 1.16's `GRPOTrainer._generate` returns, by name (a tuple, so TRL's own callers unpack it as before)."""

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    tool_mask: list[list[int]] | None
    completions: list[Any]
    logprobs: Any
    extra_fields: dict[str, Any]
    images: Any
    tool_images: Any

    @classmethod
    def of(cls, output: tuple) -> GenerationOutput:
        if len(output) != len(cls._fields):
            raise TRLVersionError(
                f"GRPOTrainer._generate returned {len(output)} values, dapo-trl expects {len(cls._fields)} "
                f"({', '.join(cls._fields)}): install trl{SUPPORTED_TRL}."
            )
        return cls(*output)


def generate(trainer: Any, prompts: list[Any]) -> GenerationOutput:
    """The trainer's own generation (`_generate`: transformers, vLLM or a rollout_func, then TRL's tool loop)."""
    return GenerationOutput.of(trainer._generate(prompts))


def metrics(trainer: Any, mode: str) -> dict[str, list[float]]:
    """TRL's pending metrics of `mode` ("train" / "eval"): values appended here are averaged into TRL's next log."""
    return trainer._metrics[mode]


def swap_metrics(trainer: Any, mode: str, replacement: dict[str, list[float]]) -> dict[str, list[float]]:
    """Put `replacement` in place of TRL's pending `mode` metrics; return what was there."""
    previous, trainer._metrics[mode] = trainer._metrics[mode], replacement
    return previous


def reward_metric_logger(trainer: Any) -> Callable[[str, float], None]:
    """TRL's `log_metric` hook of reward functions (averaged into the next log)."""
    return trainer._log_metric


def tokenizer(trainer: Any) -> Any:
    """The tokenizer TRL pads and decodes with (the processor's, for a multimodal model)."""
    return trainer._tokenizer


def tokenize_prompts(trainer: Any, prompts: list[Any]) -> list[list[int]]:
    """Prompt token ids exactly as TRL's generation makes them (chat template, tools, template kwargs)."""
    prompt_ids, _, _ = trainer._tokenize_prompts(prompts)
    return [list(ids) for ids in prompt_ids]


def vllm_backend(trainer: Any) -> Any:
    """GRPOTrainer's vLLM generation backend (`vllm_generation`, built with use_vllm: ours from `vllm_backends`)."""
    return trainer.vllm_generation


def set_weights_loaded(trainer: Any, loaded: bool) -> None:
    """Tell TRL whether its vLLM engine holds the weights its next generation must use (this step's): if not, it
    syncs them first. Streaming rollout loads the engine's weights itself, by version."""
    trainer._last_loaded_step = trainer.state.global_step if loaded else -1


def last_world_entropy(trainer: Any) -> float:
    """The adaptive entropy controller's last measured mean entropy (TRL saves and restores it with checkpoints)."""
    return trainer._last_world_entropy


def set_last_world_entropy(trainer: Any, entropy: float) -> None:
    trainer._last_world_entropy = entropy


# The multimodal inputs TRL's loss forward passes on from a micro-batch (`_get_per_token_logps_and_entropies`).
MULTIMODAL_INPUTS = (
    "pixel_values",
    "image_grid_thw",
    "num_images",
    "pixel_attention_mask",
    "spatial_shapes",
    "num_tiles",
    "image_sizes",
    "token_type_ids",
    "mm_token_type_ids",
    "image_position_ids",
)


def micro_step(trainer: Any) -> int:
    """TRL's micro-step counter (advanced by `training_step`, one per micro-batch)."""
    return trainer._step


def set_micro_step(trainer: Any, step: int) -> None:
    """Continue TRL's micro-step count where a checkpoint left it (TRL starts it at 0 on every run), so that a
    resume in the middle of a generation batch keeps its generation boundaries."""
    trainer._step = step


def checkpoint_folder(trainer: Any, trial: Any) -> str:
    import os

    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

    return os.path.join(trainer._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{trainer.state.global_step}")


def set_rollout_tools(trainer: Any, num_rollouts: int) -> None:
    """The per-rollout tool tables TRL's tool loop reads, built from the standalone tools (the same for every
    rollout), as `_generate_and_score_completions` builds them for a training batch."""
    tools = trainer._standalone_tools
    sync_tools = {tool.__name__: tool for tool in tools if not inspect.iscoroutinefunction(tool)}
    async_tools = {tool.__name__: tool for tool in tools if inspect.iscoroutinefunction(tool)}
    trainer._sync_tool_dicts = [sync_tools] * num_rollouts
    trainer._async_tool_dicts = [async_tools] * num_rollouts


def wrap_tool_tables(trainer: Any, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Replace every tool in the per-rollout tables TRL's tool loop calls from by `wrap(tool)`: the standalone tools
    and each rollout's environment methods (`environment_factory`), which TRL binds and tables anew every batch."""
    for tables in (getattr(trainer, "_sync_tool_dicts", None), getattr(trainer, "_async_tool_dicts", None)):
        for table in tables or ():
            for name, tool in table.items():
                table[name] = wrap(tool)


def per_token_log_probs(trainer: Any, model: Any, input_ids: Any, attention_mask: Any, logits_to_keep: int) -> Any:
    """Per-token log-probs of the sampled tokens through the trainer's own forward (padding-free when on)."""
    log_probs, _, _ = trainer._get_per_token_logps_and_entropies(
        model, input_ids, attention_mask, logits_to_keep, batch_size=trainer.args.per_device_train_batch_size
    )
    return log_probs


# What TRL's `_generate_and_score_completions` logs from pi_old and the engine's log-probs, once per scoring pass.
ENGINE_MISMATCH_METRICS = (
    "sampling/sampling_logp_difference/mean",
    "sampling/sampling_logp_difference/max",
    "sampling/importance_sampling_ratio/min",
    "sampling/importance_sampling_ratio/mean",
    "sampling/importance_sampling_ratio/max",
)


def scores_old_log_probs(trainer: Any) -> bool:
    """Whether TRL's `_generate_and_score_completions` runs the policy's no-grad forward for pi_old (its first no-grad
    forward of the pass, before the reference's): generation misaligned with optimizer steps, or vLLM's importance
    correction on (TRL 1.16's rule)."""
    generate_every = trainer.args.steps_per_generation * trainer.num_iterations
    misaligned = trainer.args.gradient_accumulation_steps % generate_every != 0
    return misaligned or bool(trainer.use_vllm and trainer.vllm_importance_sampling_correction)


def shuffle_and_split(generation_batch: dict[str, Any], parts: int) -> list[dict[str, Any]]:
    """A generated, scored batch shuffled and split into `parts` micro-batches, as TRL's `_prepare_inputs` does."""
    batch = trl_function("split_pixel_values_by_grid")(generation_batch)
    batch = trl_function("shuffle_sequence_dict")(batch)
    unsplit = trl_function("unsplit_pixel_values_by_grid")
    return [unsplit(part) for part in trl_function("split_tensor_dict")(batch, parts)]


@contextlib.contextmanager
def _module_attribute(module_name: str, name: str, value: Any) -> Iterator[Any]:
    """Within the block, TRL module `module_name`'s global `name` is `value` (restored on exit); yields the original.
    TRL's code looks such names up in its module's globals when it runs, so this is where one can be replaced."""
    module = importlib.import_module(module_name)
    original = getattr(module, name)
    setattr(module, name, value)
    try:
        yield original
    finally:
        setattr(module, name, original)


@contextlib.contextmanager
def vllm_engine_factory(factory: Callable[..., Any]) -> Iterator[Any]:
    """TRL's colocate backend builds its in-process engine through `factory` (called with TRL's arguments) within
    the block; yields vLLM's own `LLM` class for the factory to call."""
    with _module_attribute("trl.generation.vllm_generation", "LLM", factory) as original:
        yield original


@contextlib.contextmanager
def before_reward_gather(before: Callable[[], None]) -> Iterator[None]:
    """Within the block, TRL's gather (the end of `_calculate_rewards`: the rewards of every process's rows) calls
    `before()` first: the user's reward functions are done there, and every process agrees whether to go on."""
    original = trl_function("gather")

    def gather(tensor: Any) -> Any:
        before()
        return original(tensor)

    with _module_attribute("trl.trainer.grpo_trainer", "gather", gather):
        yield


@contextlib.contextmanager
def vllm_backend_class(backend_class: type) -> Iterator[None]:
    """GRPOTrainer's constructor builds `backend_class` instead of TRL's `VLLMGeneration` (restored on exit): it
    looks the class up in its module's globals, so this is where TRL's backend can be replaced without copying
    GRPOTrainer's constructor arguments."""
    with _module_attribute("trl.trainer.grpo_trainer", "VLLMGeneration", backend_class):
        yield
