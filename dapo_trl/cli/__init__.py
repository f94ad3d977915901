"""The training command line (`train_dapo.py`, `dapo-train`, `python -m dapo_trl.cli`).

- `arguments`: the script's own flags (`DAPOScriptArguments`; model flags are TRL's `ModelConfig` as
  `DAPOModelConfig`, training flags `DAPOConfig`) and `DAPOParser`, which reads all three from the command line or a
  YAML `--config` recipe;
- `components`: `--reward_funcs`, `--tools` and `--tool_config` turned into reward callables and tool functions;
- `run_summary`: the end-of-run metrics table and `--plot` charts;
- `train`: model loading (`from_pretrained_kwargs`, `quantization_config`) and `main`.
"""

from .arguments import BUILTIN_TINY_MODEL, RECIPE_HELP, TOOL_NAMES, DAPOModelConfig, DAPOParser, DAPOScriptArguments
from .components import TOOL_CONFIG_FIELDS, UserFacingError, apply_tool_config, build_tools, resolve_reward_function
from .run_summary import LEADING_SUMMARY_METRICS, SUMMARY_METRICS, print_summary, summary_columns, write_charts
from .train import (
    TRL_DEPRECATED_CALLS,
    from_pretrained_kwargs,
    load_model_and_tokenizer,
    main,
    quantization_config,
    resolve_chat_template,
)

__all__ = [
    "BUILTIN_TINY_MODEL",
    "LEADING_SUMMARY_METRICS",
    "RECIPE_HELP",
    "SUMMARY_METRICS",
    "TOOL_CONFIG_FIELDS",
    "TOOL_NAMES",
    "TRL_DEPRECATED_CALLS",
    "DAPOModelConfig",
    "DAPOParser",
    "DAPOScriptArguments",
    "UserFacingError",
    "apply_tool_config",
    "build_tools",
    "from_pretrained_kwargs",
    "load_model_and_tokenizer",
    "main",
    "print_summary",
    "quantization_config",
    "resolve_chat_template",
    "resolve_reward_function",
    "summary_columns",
    "write_charts",
]
