"""Helpers shared by the benchmark scripts (run as `python benchmarks/<name>.py`, so this is importable)."""

from __future__ import annotations

import logging
import warnings
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

# Random-init Qwen2 models of real dimensions (each with the built-in tiny tokenizer); "tiny" is the built-in model.
MODELS = {
    "qwen2.5-0.5b": {
        "hidden_size": 896,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "intermediate_size": 4864,
        "vocab_size": 151936,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": True,
    },
    "qwen2.5-1.5b": {
        "hidden_size": 1536,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "intermediate_size": 8960,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
    },
    "qwen2.5-7b": {
        "hidden_size": 3584,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "intermediate_size": 18944,
        "vocab_size": 152064,
        "tie_word_embeddings": False,
    },
    # Small enough for CPU, large enough that activations dominate a long row's memory.
    "cpu-mid": {
        "hidden_size": 512,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "intermediate_size": 1408,
        "vocab_size": 8192,
        "tie_word_embeddings": False,
    },
}


def package_version(package: str) -> str:
    """Installed version of a package, or '?' (printed in each benchmark's header for reproducibility)."""
    try:
        return version(package)
    except PackageNotFoundError:
        return "?"


def quiet() -> None:
    """Silence warnings, progress bars and per-step log printing, so the tables are what is printed."""
    import transformers

    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    for name in ("trl", "dapo_trl", "datasets", "accelerate", "transformers"):
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        import datasets

        datasets.disable_progress_bars()
        datasets.logging.set_verbosity_error()
    except ImportError:
        pass


def peak_memory_mb(device: str) -> float:
    """Peak memory of this process: `torch.cuda.max_memory_allocated` on CUDA, peak RSS on CPU."""
    import resource

    import torch

    if device == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def build_model(kind: str, work: Path, dtype: str) -> tuple[str, Any]:
    """(model path, tokenizer): the built-in tiny model, or a config of `MODELS` (random weights, seed 0, built once
    per dtype under `work`) with the tiny tokenizer."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from dapo_trl.builtin_models import build_tiny_model

    tiny = build_tiny_model(work / "tiny")
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    if kind == "tiny":
        return str(tiny), tokenizer
    path = work / f"{kind}-{dtype}"
    if not (path / "config.json").exists():
        torch_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
        dimensions = {"max_position_embeddings": 131072, "rope_theta": 1e6, **MODELS[kind]}
        config = Qwen2Config(**dimensions, dtype=torch_dtype)
        config.pad_token_id, config.eos_token_id = tokenizer.pad_token_id, tokenizer.eos_token_id
        torch.manual_seed(0)
        Qwen2ForCausalLM(config).to(torch_dtype).save_pretrained(path)
        tokenizer.save_pretrained(path)
    return str(path), tokenizer


class ForwardProbe:
    """Which path each model forward and attention call of this process took, counted without device syncs.

    Forwards (a pre-hook on the model): `packed` when fed position ids without an attention mask (how DAPOTrainer's
    padding-free forwards call the model, `training/step/forwards.py`), else `padded`. Attention calls (the model's
    attention function in transformers' `ALL_ATTENTION_FUNCTIONS`, wrapped while the probe is open): the mask each
    got, `no mask` (causal), `padding mask` (flash attention: rows unpadded by it), `dense mask` (sdpa / eager: a
    padding or packed block-diagonal mask) or the mask's type (`BlockMask`: flex attention). Flash attention kernels
    (`modeling_flash_attention_utils`'s lazily imported functions, wrapped): `flash varlen` (flash_attn_varlen_func:
    packed sequences from position ids, or rows unpadded by a mask) against `flash dense` (flash_attn_func: one
    unpacked sequence per row). Activation checkpointing's recomputation counts its attention calls again.
    """

    def __init__(self, attn_implementation: str):
        self.implementation = attn_implementation
        self.forwards: dict[str, int] = {"packed": 0, "padded": 0}
        self.attention: dict[str, int] = {}
        self.kernels: dict[str, int] = {}
        self._undo: list[Any] = []

    def _count(self, table: dict[str, int], key: str) -> None:
        table[key] = table.get(key, 0) + 1

    def watch(self, model: Any) -> None:
        """Count `model`'s forwards (until `close`)."""

        def classify(module: Any, args: tuple, kwargs: dict) -> None:
            packed = kwargs.get("position_ids") is not None and kwargs.get("attention_mask") is None
            self._count(self.forwards, "packed" if packed else "padded")

        self._undo.append(model.register_forward_pre_hook(classify, with_kwargs=True).remove)

    def open(self) -> ForwardProbe:
        import torch
        from transformers import modeling_flash_attention_utils as flash
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        interface = ALL_ATTENTION_FUNCTIONS
        if self.implementation in interface:  # eager is each model's own function, not in the registry
            original = interface[self.implementation]
            local = self.implementation in interface._local_mapping

            def attention(module, query, key, value, attention_mask, *args, **kwargs):
                if attention_mask is None:
                    kind = "no mask"
                elif isinstance(attention_mask, torch.Tensor):  # (rows, width): flash unpads rows by it
                    kind = "padding mask" if attention_mask.dim() == 2 else "dense mask"
                else:
                    kind = type(attention_mask).__name__
                self._count(self.attention, kind)
                return original(module, query, key, value, attention_mask, *args, **kwargs)

            def restore() -> None:
                if local:
                    interface[self.implementation] = original
                else:
                    del interface[self.implementation]  # the local override only: the global function stays

            interface[self.implementation] = attention
            self._undo.append(restore)
        lazy_import = flash.lazy_import_flash_attention

        def counted(function: Any, name: str) -> Any:
            if function is None:
                return None

            def call(*args: Any, **kwargs: Any) -> Any:
                self._count(self.kernels, name)
                return function(*args, **kwargs)

            return call

        def probed_import(*args: Any, **kwargs: Any) -> Any:
            (dense, varlen, *rest), processing = lazy_import(*args, **kwargs)
            return (counted(dense, "flash dense"), counted(varlen, "flash varlen"), *rest), processing

        flash.lazy_import_flash_attention = probed_import
        self._undo.append(lambda: setattr(flash, "lazy_import_flash_attention", lazy_import))
        return self

    def close(self) -> None:
        while self._undo:
            self._undo.pop()()

    def summary(self) -> dict[str, Any]:
        return {
            "attn_implementation": self.implementation,
            "forwards": dict(self.forwards),
            "attention_calls": dict(self.attention),
            "flash_kernels": dict(self.kernels),
        }
