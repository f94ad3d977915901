"""A verl YAML config as dotted keys (nested keys -> `section.key`), with OmegaConf's reading of numbers."""

from __future__ import annotations

from typing import Any

import yaml

from .hydra import FLOAT_PATTERN, INT_PATTERN, VerlInput, VerlInputError, record_value


def _flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(data, dict) and data:
        flat: dict[str, Any] = {}
        for key, value in data.items():
            flat.update(_flatten(value, f"{prefix}.{key}" if prefix else str(key)))
        return flat
    return {prefix: data}


def _yaml_scalar(value: Any) -> Any:
    """YAML 1.1 reads `1e-6` as a string; OmegaConf (verl) reads it as a float."""
    if isinstance(value, str) and FLOAT_PATTERN.fullmatch(value.strip()) and not INT_PATTERN.fullmatch(value.strip()):
        return float(value)
    if isinstance(value, list):
        return [_yaml_scalar(item) for item in value]
    return value


def read_verl_yaml(text: str, source: str = "config") -> VerlInput:
    """A verl YAML config's keys, flattened to dotted names."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise VerlInputError(f"{source}: not valid YAML: {error}") from None
    if not isinstance(data, dict):
        raise VerlInputError(f"{source}: expected a mapping of verl config sections (data, actor_rollout_ref, ...)")
    found = VerlInput(source=source, kind="YAML config")
    for key, value in _flatten(data).items():
        value = _yaml_scalar(value)
        record_value(
            found, key, value, yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("..."), set()
        )
        found.written[key] = found.written[key].strip()
    return found
