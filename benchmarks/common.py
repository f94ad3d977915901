"""Helpers shared by the benchmark scripts (run as `python benchmarks/<name>.py`, so this is importable)."""

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

    from dapo_trl.tiny_model import build_tiny_model

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
