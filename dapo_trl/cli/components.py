"""Turn the script's reward and tool flags into what the trainer takes: reward callables and tool functions.

`dapo_trl.cli.train` (model loading, `main`) calls these; the flags themselves are `dapo_trl.cli.arguments`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import importlib.util
import logging
import sys
from pathlib import Path
from typing import Any

from ..rewards import REWARD_BUILDERS, REWARD_FUNCTIONS, MissingRewardOptions, build_reward
from ..rewards.verl_compat import from_verl_compute_score, is_verl_compute_score
from .arguments import TOOL_NAMES, DAPOScriptArguments

logger = logging.getLogger("dapo_trl")


class UserFacingError(RuntimeError):
    """An error whose message is the whole story: printed without a traceback."""


def resolve_reward_function(name: str, script_args: DAPOScriptArguments | None = None) -> Any:
    """A registered reward by name (built with the options it reads from `script_args`, e.g. the judge's endpoint),
    or any importable callable by dotted path."""
    if name in REWARD_BUILDERS:
        try:
            return build_reward(name, script_args)
        except MissingRewardOptions as error:
            needed = " and ".join(f"--{option}" for option in error.required)
            raise UserFacingError(f"--reward_funcs {name} needs {needed}.") from None
    if ":" in name:  # module:function or path/to/file.py:function (verl's custom_reward_function.path / .name)
        module_name, _, attribute = name.rpartition(":")
    else:
        module_name, _, attribute = name.rpartition(".")
    if not module_name or not attribute:
        raise UserFacingError(
            f"--reward_funcs {name!r}: unknown reward; use one of {sorted(REWARD_FUNCTIONS)}, a dotted path "
            "(my_pkg.rewards.fn), module:function or path/to/file.py:function."
        )
    try:
        function = getattr(_import_reward_module(module_name), attribute)
    except (ImportError, AttributeError, OSError, SyntaxError) as error:
        raise UserFacingError(f"--reward_funcs {name!r}: cannot import it ({error}).") from None
    if is_verl_compute_score(function):  # verl's per-response signature: adapt it to TRL's batched one
        return from_verl_compute_score(function)
    return function


def _import_reward_module(module_name: str) -> Any:
    """A module by dotted name, or a Python file by path (imported under a name derived from the path)."""
    if not module_name.endswith(".py"):
        return importlib.import_module(module_name)
    path = Path(module_name).expanduser().resolve()
    if not path.is_file():
        raise ImportError(f"no file {str(path)!r}")
    digest = hashlib.sha256(str(path).encode()).hexdigest()[:16]  # the same name in every process
    spec = importlib.util.spec_from_file_location(f"dapo_trl_reward_{digest}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses and pickling look modules up by name
    spec.loader.exec_module(module)
    return module


# --tool_config sets these script fields; the same flag given with another non-default value is a conflict.
TOOL_CONFIG_FIELDS = {
    "sandbox": lambda settings: "remote",
    "sandbox_url": lambda settings: settings.sandbox_url,
    "sandbox_timeout": lambda settings: settings.timeout_s,
    "sandbox_memory_mb": lambda settings: settings.memory_mb,
    "sandbox_max_concurrency": lambda settings: settings.max_concurrency,
}


def apply_tool_config(script_args: DAPOScriptArguments, world_size: int = 1) -> Any:
    """Read --tool_config (verl's tool YAML) into the --sandbox_* fields; returns its settings (None without it)."""
    if not script_args.tool_config:
        return None
    from ..tools.verl_config import ToolConfigError, load_verl_tool_config

    try:
        settings = load_verl_tool_config(script_args.tool_config, world_size=world_size)
    except ToolConfigError as error:
        raise UserFacingError(f"--tool_config: {error}") from None
    defaults = {f.name: f.default for f in dataclasses.fields(script_args)}  # DAPOScriptArguments' defaults
    for name, value_of in TOOL_CONFIG_FIELDS.items():
        given, value = getattr(script_args, name), value_of(settings)
        if given not in (defaults[name], value):
            raise UserFacingError(
                f"--{name} {given} contradicts --tool_config {script_args.tool_config}, which sets it to {value}: "
                "drop one of them."
            )
        setattr(script_args, name, value)
    if script_args.tools and script_args.tools != [TOOL_NAMES[0]]:
        raise UserFacingError(f"--tool_config describes the {TOOL_NAMES[0]} tool only; drop --tools from the call.")
    script_args.tools = [TOOL_NAMES[0]]
    for note in settings.notes:
        logger.warning("--tool_config %s: %s", script_args.tool_config, note)
    return settings


def build_tools(script_args: DAPOScriptArguments, world_size: int = 1) -> list[Any]:
    """The tool functions named by --tools (or --tool_config), each over the sandbox the --sandbox_* flags describe."""
    settings = apply_tool_config(script_args, world_size)
    unknown = [name for name in script_args.tools if name not in TOOL_NAMES]
    if unknown:
        raise UserFacingError(f"--tools {' '.join(unknown)}: unknown tool; available: {', '.join(TOOL_NAMES)}.")
    if not script_args.tools:
        return []
    from ..tools.code_interpreter import build_code_interpreter

    try:
        interpreter = build_code_interpreter(
            script_args.sandbox,
            url=script_args.sandbox_url,
            timeout_s=script_args.sandbox_timeout,
            memory_mb=script_args.sandbox_memory_mb,
            max_concurrency=script_args.sandbox_max_concurrency,
            rate_limit=script_args.sandbox_rate_limit,
            require_isolation=script_args.sandbox_require_isolation,
            max_output_chars=script_args.tool_max_output_chars,
        )
    except ValueError as error:
        raise UserFacingError(f"--tools code_interpreter: {error}") from None
    if script_args.sandbox == "local" and script_args.sandbox_require_isolation:
        interpreter.sandbox.isolation()  # fail now, not at the first tool call
    if settings is not None:
        from ..tools.verl_config import apply_tool_schema

        apply_tool_schema(interpreter.tool, settings)
    return [interpreter.tool]
