"""Where a mixture-of-experts policy keeps its routers and expert blocks, read from what transformers marks.

transformers names every MoE family's router in `_can_record_outputs["router_logits"]` (the module whose output
`output_router_logits` records); the block that holds a router and its experts is the router's parent. Nothing here
is per-architecture: a policy is a mixture of experts when its class records router logits and has such modules.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger(__name__)

LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass(frozen=True)
class Router:
    """One router: the module, its decoder layer's index, and the block (router + experts) it belongs to."""

    module: torch.nn.Module
    layer: int
    block: torch.nn.Module


@dataclass(frozen=True)
class Routing:
    """A policy's routing geometry: `layers` decoder layers (vLLM indexes routed experts by decoder layer, dense
    layers included), `top_k` experts per token out of `num_experts`."""

    layers: int
    top_k: int
    num_experts: int

    @property
    def dtype(self) -> torch.dtype:
        """The smallest integer type that holds an expert index + 1 (0 means "not recorded"): uint8 up to 254
        experts (Qwen3-MoE's 128, DeepSeek-V3's 256 take int16)."""
        return torch.uint8 if self.num_experts < 255 else torch.int16

    @property
    def bytes_per_token(self) -> int:
        return self.layers * self.top_k * torch.empty((), dtype=self.dtype).element_size()


def unwrapped(model: Any) -> torch.nn.Module:
    """The transformers model under a PEFT or DeepSpeed wrapper."""
    while True:
        inner = getattr(model, "module", None) or (model.get_base_model() if hasattr(model, "get_base_model") else None)
        if inner is None or inner is model:
            return model
        model = inner


def recorded_class(model_class: type, output: str) -> type | None:
    """The module class a transformers model class records `output` from (`_can_record_outputs`: "router_logits",
    "attentions", ...), or None."""
    recorder = (getattr(model_class, "_can_record_outputs", None) or {}).get(output)
    return recorder if recorder is None or isinstance(recorder, type) else getattr(recorder, "target_class", None)


def router_class(model: Any) -> type | None:
    """The router module class transformers records router logits from, or None for a dense model."""
    return recorded_class(type(unwrapped(model)), "router_logits")


def routers(model: Any) -> list[Router]:
    """Every router of `model` in layer order (empty for a dense model)."""
    cls = router_class(model)
    if cls is None:
        return []
    found, parents = [], {}
    for name, module in unwrapped(model).named_modules():
        for child in module.children():
            parents[id(child)] = module
        if isinstance(module, cls):
            match = LAYER_INDEX.search(name)
            if match is None:
                raise ValueError(f"router {name!r} ({cls.__name__}) is not under a 'layers.N.' module")
            block = parents[id(module)]
            while type(block).__module__.startswith("peft.") and id(block) in parents:  # a LoRA layer wrapping it
                block = parents[id(block)]
            found.append(Router(module, int(match.group(1)), block))
    return sorted(found, key=lambda router: router.layer)


def is_moe(model: Any) -> bool:
    return bool(routers(model))


def is_moe_checkpoint(model: Any, args: Any) -> bool:
    """Whether `model` (a model, or a checkpoint path / hub id as trainers take it) is a mixture of experts, read
    from its class's marks without loading weights."""
    if not isinstance(model, str):
        return is_moe(model)
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(model, trust_remote_code=getattr(args, "trust_remote_code", False))
        cls = AutoModelForCausalLM._model_mapping[type(config)]
    except (OSError, KeyError, ValueError):
        return False  # loading it will say what is wrong
    return recorded_class(cls, "router_logits") is not None


def moe_block_classes(model: Any) -> list[type]:
    """The classes of the blocks that hold a router and its experts (what ZeRO-3 must gather as one unit)."""
    return sorted({type(router.block) for router in routers(model)}, key=lambda cls: cls.__name__)


def routing_geometry(model: Any) -> Routing:
    """Layers, experts per token and experts of `model`'s routing (`model` must be a mixture of experts)."""
    config = unwrapped(model).config
    config = getattr(config, "get_text_config", lambda: config)()
    num_experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    top_k = getattr(config, "num_experts_per_tok", None)
    if not num_experts or not top_k:
        raise ValueError(f"{type(config).__name__} names no num_experts / num_experts_per_tok")
    return Routing(config.num_hidden_layers, int(top_k), int(num_experts))


def set_zero3_leaf_modules(model: Any, accelerator: Any) -> list[str]:
    """Under ZeRO-3, make every MoE block of `model` one unit (a DeepSpeed leaf module): ZeRO-3 gathers parameters
    module by module as they run, and processes that route their tokens to different experts would gather different
    modules and wait for each other forever. Set on the module instances before DeepSpeed wraps the model (Accelerate
    does the same for the class names in its `transformer_moe_cls_names`, which users rarely know to set). Returns
    the block classes' names (empty when not ZeRO-3 or not a mixture of experts)."""
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    classes = moe_block_classes(model)
    if plugin is None or plugin.zero_stage != 3 or not classes:
        return []
    from deepspeed.utils import set_z3_leaf_modules

    set_z3_leaf_modules(unwrapped(model), classes)
    names = [cls.__name__ for cls in classes]
    logger.info("ZeRO-3: mixture-of-experts blocks %s are gathered as one unit (leaf modules)", ", ".join(names))
    return names
