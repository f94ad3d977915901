"""DAPOConfig's derived fields: the defaults that depend on the platform or on other fields, set in one place
(`DAPOConfig.__post_init__` calls these before and after GRPOConfig's own)."""

from __future__ import annotations

from typing import Any

import torch
from transformers.utils import is_torch_bf16_gpu_available

from ..utils.transformers_compat import activation_checkpointing_field

# Share of max_completion_length used as the overlong buffer when none is given: 4096 / 20480 in the paper.
DEFAULT_OVERLONG_BUFFER_SHARE = 0.2


def accelerator_available() -> bool:
    """Whether torch sees a GPU-like device (CUDA, ROCm, XPU, MPS, NPU, ...)."""
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None:
        return accelerator.is_available()
    return torch.cuda.is_available()


def derive_platform_defaults(config: Any) -> None:
    """Fields GRPOConfig's own __post_init__ must already see: the entropy alias and CPU-only defaults."""
    if config.gradient_checkpointing is None:  # GRPOConfig's default (on), under the name transformers wants
        name = activation_checkpointing_field()  # gradient_checkpointing itself before the rename
        if getattr(config, name) is None:
            setattr(config, name, True)
    if config.ddp_timeout is None:  # before GRPOConfig's __post_init__; the process group reads it later
        config.ddp_timeout = 7200 if config.use_vllm and config.vllm_mode == "server" else 1800
    if config.entropy_coeff is not None:
        if config.entropy_coef not in (0.0, config.entropy_coeff):
            raise ValueError(
                f"entropy_coeff={config.entropy_coeff} and entropy_coef={config.entropy_coef} disagree: "
                "set only one of them (entropy_coeff is an alias of entropy_coef)."
            )
        config.entropy_coef = config.entropy_coeff
    if not config.use_cpu and not accelerator_available():
        # Without use_cpu, TrainingArguments ignores the process group that `accelerate launch --multi_gpu`
        # created on a CPU-only machine and silently trains each process alone.
        config.use_cpu = True
    if config.bf16 is None and not config.fp16 and (config.use_cpu or not is_torch_bf16_gpu_available()):
        # GRPOConfig turns bf16 on unconditionally, which makes TrainingArguments refuse a CPU-only machine.
        config.bf16 = False


def derive_dapo_fields(config: Any) -> None:
    """Every DAPO field computed from others, in one place: the overlong buffer default and dual-clip's delta."""
    if config.overlong_buffer_len is None and config.max_completion_length:
        config.overlong_buffer_len = max(1, int(config.max_completion_length * DEFAULT_OVERLONG_BUFFER_SHARE))
    if config.clip_ratio_c is not None:
        if config.delta is not None and config.delta != config.clip_ratio_c:
            raise ValueError(
                "clip_ratio_c and delta both bound the importance ratio: set only clip_ratio_c (dual-clip)."
            )
        # With clip_ratio_c > 1 + epsilon_high (checked below), TRL's upper ratio bound `delta` is exactly
        # verl's dual-clip: for A < 0 the loss becomes |A| * min(c, max(r, clip(r))), for A > 0 nothing changes.
        config.delta = config.clip_ratio_c
