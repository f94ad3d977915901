"""The built-in models, `builtin:tiny` (a dense Qwen2) and `builtin:tiny-moe` (a Qwen3 mixture-of-experts), with the
tokenizer they share: shipped warm-started in `tiny/` and `tiny-moe/` beside this file, and rebuilt from scratch
offline by `python -m dapo_trl.builtin_models` (`tiny_model`, `tiny_tokenizer`)."""

from .tiny_model import BUILTIN_MODELS, build_tiny_model, packaged_model_dir, resolve_builtin_model

__all__ = ["BUILTIN_MODELS", "build_tiny_model", "packaged_model_dir", "resolve_builtin_model"]
