"""verl's tool config YAML (`actor_rollout_ref.rollout.multi_turn.tool_config_path`) as code-interpreter settings.

verl's ReTool recipe describes its sandbox in a YAML file::

    tools:
      - class_name: <module>.SandboxFusionTool      # or a subclass, e.g. the recipe's CustomSandboxFusionTool
        config: {sandbox_fusion_url, num_workers, enable_global_rate_limit, rate_limit, default_timeout,
                 default_language, memory_limit_mb, type}
        tool_schema: {type: function, function: {name, description, parameters}}

`train_dapo.py --tool_config FILE` reads such a file: the SandboxFusion service becomes the code interpreter's remote
sandbox, with verl's defaults for absent fields (`verl/tools/sandbox_fusion_tools.py`). What cannot be honoured
exactly is returned in `VerlToolSettings.notes` (the CLI logs each as a warning); what cannot be honoured at all
raises `ToolConfigError` naming the field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .code_interpreter import TOOL_NAME

# verl's SandboxFusionTool reads these config fields, with these defaults.
VERL_SANDBOX_DEFAULTS: dict[str, Any] = {
    "num_workers": 10,
    "rate_limit": 10,
    "enable_global_rate_limit": True,
    "default_timeout": 30,
    "default_language": "python",
    "memory_limit_mb": 1024,
    "type": "native",
}
SANDBOX_TOOL_CLASS = "SandboxFusionTool"


class ToolConfigError(ValueError):
    """A verl tool config that cannot become the code interpreter; the message names the field and the fix."""


@dataclass
class VerlToolSettings:
    """The code interpreter a verl tool config describes: a remote SandboxFusion sandbox and the tool's schema."""

    sandbox_url: str
    timeout_s: float
    memory_mb: int
    max_concurrency: int
    tool_name: str = TOOL_NAME
    description: str | None = None
    code_description: str | None = None
    notes: list[str] = field(default_factory=list)


def _schema_texts(schema: Any, where: str) -> tuple[str, str | None, str | None]:
    """(name, description, description of the `code` parameter) of an OpenAI function schema."""
    if schema is None:
        return TOOL_NAME, None, None
    function = schema.get("function") if isinstance(schema, dict) else None
    if not isinstance(function, dict):
        raise ToolConfigError(f"{where}.tool_schema must be an OpenAI function schema with a 'function' mapping.")
    name = function.get("name", TOOL_NAME)
    if not isinstance(name, str) or not name.isidentifier():
        raise ToolConfigError(f"{where}.tool_schema.function.name={name!r} must be a Python identifier.")
    properties = (function.get("parameters") or {}).get("properties") or {}
    if set(properties) != {"code"}:
        raise ToolConfigError(
            f"{where}.tool_schema.function.parameters has properties {sorted(properties)}; the code interpreter "
            "takes exactly one, 'code' (the program to run)."
        )
    code = properties["code"] if isinstance(properties["code"], dict) else {}
    return name, function.get("description"), code.get("description")


def parse_verl_tool_config(data: Any, *, world_size: int = 1, source: str = "tool config") -> VerlToolSettings:
    """The settings of a parsed verl tool config (see the module docstring) for `world_size` training processes.

    Concurrency: verl's `rate_limit` (with `enable_global_rate_limit`, its default) caps the executions in flight
    across the whole cluster; here the cap is per training process, so each process gets
    `ceil(rate_limit / world_size)`, at most `num_workers` (the size of verl's per-tool thread pool).
    """
    tools = data.get("tools") if isinstance(data, dict) else None
    if not isinstance(tools, list) or not tools:
        raise ToolConfigError(
            f"{source}: expected a mapping with a non-empty 'tools' list (verl's tool config format)."
        )
    if len(tools) > 1:
        names = [tool.get("class_name") if isinstance(tool, dict) else tool for tool in tools]
        raise ToolConfigError(
            f"{source}: {len(tools)} tools {names}; dapo-trl has one tool, the SandboxFusion code interpreter."
        )
    tool = tools[0]
    where = f"{source}: tools[0]"
    if not isinstance(tool, dict):
        raise ToolConfigError(f"{where} must be a mapping with class_name, config and tool_schema.")
    class_name = str(tool.get("class_name", ""))
    if not class_name.rsplit(".", 1)[-1].endswith(SANDBOX_TOOL_CLASS):
        raise ToolConfigError(
            f"{where}.class_name={class_name!r}: only verl's {SANDBOX_TOOL_CLASS} (or a subclass) has a counterpart "
            "here, the code_interpreter tool over a SandboxFusion service."
        )
    notes: list[str] = []
    if class_name.rsplit(".", 1)[-1] != SANDBOX_TOOL_CLASS:
        notes.append(
            f"class_name {class_name!r} is a subclass of {SANDBOX_TOOL_CLASS}: its own code handling is not run "
            "here. dapo-trl's interpreter runs the code as given and prints the value of a final bare expression "
            "(the ReTool recipe's subclass also unwraps ```python fences and wraps the last line in print())"
        )
    unknown_tool_keys = sorted(set(tool) - {"class_name", "config", "tool_schema"})
    if unknown_tool_keys:
        notes.append(f"ignored tool fields {unknown_tool_keys} (verl's tool loader reads none of them)")

    config = {**VERL_SANDBOX_DEFAULTS, **(tool.get("config") or {})}
    url = config.get("sandbox_fusion_url") or ""
    if not url:
        raise ToolConfigError(f"{where}.config.sandbox_fusion_url is not set (verl refuses this too).")
    if config["type"] != "native":
        raise ToolConfigError(f"{where}.config.type={config['type']!r}: only 'native' tools are supported (not MCP).")
    if str(config["default_language"]).lower() != "python":
        raise ToolConfigError(
            f"{where}.config.default_language={config['default_language']!r}: the code interpreter runs Python only."
        )
    try:
        timeout_s = float(config["default_timeout"])
        memory_mb = int(config["memory_limit_mb"])
        num_workers = int(config["num_workers"])
        rate_limit = int(config["rate_limit"])
    except (TypeError, ValueError) as error:
        raise ToolConfigError(f"{where}.config: {error}") from None
    if min(timeout_s, memory_mb, num_workers, rate_limit) <= 0:
        raise ToolConfigError(
            f"{where}.config: default_timeout, memory_limit_mb, num_workers and rate_limit must be > 0."
        )
    world_size = max(1, int(world_size))
    if config["enable_global_rate_limit"]:
        per_process = max(1, min(num_workers, math.ceil(rate_limit / world_size)))
        notes.append(
            f"rate_limit={rate_limit} is verl's cluster-wide cap on executions in flight; with {world_size} training "
            f"process(es) each gets sandbox_max_concurrency={per_process} (at most num_workers={num_workers})"
        )
    else:
        per_process = num_workers
        notes.append(
            f"enable_global_rate_limit is off: each training process runs at most num_workers={num_workers} "
            "executions at once (verl: num_workers per tool instance, with no global cap)"
        )
    unknown_config_keys = sorted(set(config) - set(VERL_SANDBOX_DEFAULTS) - {"sandbox_fusion_url"})
    if unknown_config_keys:
        notes.append(f"ignored config fields {unknown_config_keys}: verl's SandboxFusionTool does not read them either")
    name, description, code_description = _schema_texts(tool.get("tool_schema"), where)
    return VerlToolSettings(
        sandbox_url=str(url),
        timeout_s=timeout_s,
        memory_mb=memory_mb,
        max_concurrency=per_process,
        tool_name=name,
        description=description,
        code_description=code_description,
        notes=notes,
    )


def load_verl_tool_config(path: str | Path, *, world_size: int = 1) -> VerlToolSettings:
    """`parse_verl_tool_config` of a YAML file; an unreadable file is a `ToolConfigError` naming it."""
    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as error:
        raise ToolConfigError(f"cannot read the tool config {str(path)!r}: {error}") from None
    return parse_verl_tool_config(data, world_size=world_size, source=str(path))


def apply_tool_schema(tool: Any, settings: VerlToolSettings) -> None:
    """Give the tool function the schema's name and descriptions, which TRL renders into the chat template.

    TRL builds a tool's schema from the function's name and Google-style docstring (`transformers.utils.
    get_json_schema`), so the policy sees the same tool description as under verl.
    """
    tool.__name__ = tool.__qualname__ = settings.tool_name
    if settings.description or settings.code_description:
        summary = (settings.description or "Run Python code in a sandbox.").strip()
        argument = (settings.code_description or "The Python source code to run.").strip()
        tool.__doc__ = f"{summary}\n\nArgs:\n    code: {argument}\n"
