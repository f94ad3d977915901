"""The reference model KL in the reward needs when TRL built none (its KL loss is off: `beta` = 0).

GRPOTrainer builds a reference model only for its KL loss. KL in the reward needs one with `beta` = 0 too, so it is
built here after GRPOTrainer's constructor, from TRL's own helpers and in TRL's order: loaded from where the policy
came from with the policy's dtype and attention, dropout off, TRL's fused LM head (log-probs at the training
temperature without full logits, in float32 with `cast_lm_head_to_fp32`), then prepared for DeepSpeed, FSDP or
plain data parallelism. A PEFT policy needs none: its reference is the adapter turned off (`kl_in_reward`). The
user's config is never changed.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from ...moe.architecture import set_zero3_leaf_modules
from ..trl_seam import trl_function

if TYPE_CHECKING:
    from ...config import DAPOConfig

logger = logging.getLogger(__name__)


def needs_own_reference(args: DAPOConfig, ref_model: Any, model: Any) -> bool:
    """KL in the reward is on, TRL built no reference model, and the policy is not a PEFT model."""
    from accelerate.utils import is_peft_model

    return args.kl_in_reward and ref_model is None and not is_peft_model(model)


def build_reference_model(trainer: Any, quantization_config: Any = None) -> Any:
    """A frozen copy of the policy's starting point, prepared as GRPOTrainer prepares its own reference model."""
    args, model, accelerator = trainer.args, trainer.model, trainer.accelerator
    init_kwargs = dict(args.model_init_kwargs or {})
    if quantization_config is not None:
        init_kwargs["quantization_config"] = quantization_config
    if args.distributed_state.distributed_type in ("MULTI_GPU", "DEEPSPEED"):
        init_kwargs["device_map"] = None  # "auto" fails under distributed training
    init_kwargs.setdefault("trust_remote_code", args.trust_remote_code)
    init_kwargs.setdefault("dtype", model.dtype)
    init_kwargs.setdefault("attn_implementation", model.config._attn_implementation)
    model_id = trl_function("get_config_model_id")(model.config)
    reference = trl_function("create_model_from_path")(model_id, **init_kwargs)
    logger.info("KL in the reward: reference model loaded from %s", model_id)
    if args.disable_dropout:
        trl_function("disable_dropout_in_model")(reference)
    reference.requires_grad_(False)
    trl_function("add_fused_lm_head")(
        reference, temperature=trainer.temperature, cast_lm_head_to_fp32=args.cast_lm_head_to_fp32
    )
    if trainer.is_deepspeed_enabled:
        set_zero3_leaf_modules(reference, accelerator)
        return trl_function("prepare_deepspeed")(reference, accelerator)
    if trainer.is_fsdp_enabled:
        return trl_function("prepare_fsdp")(reference, accelerator)
    return accelerator.prepare_model(reference, evaluation_mode=True)
