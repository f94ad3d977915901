"""What a verl run sets (`VerlInput`), and Hydra's syntax for it: override values and `${...}` interpolations.

`resolve_interpolations` replaces `${key}` and `${oc.select:key,default}` by the other keys' values, else verl's
defaults.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml

OVERRIDE_PATTERN = re.compile(r"(\+\+|\+|~)?([A-Za-z_][\w\-]*(?:\.[\w\-@]+)+)(?:=(.*))?", re.S)
_INTERPOLATION = re.compile(r"\$\{([^${}]+)\}")
INT_PATTERN = re.compile(r"[-+]?\d+")
FLOAT_PATTERN = re.compile(r"[-+]?(\d+\.\d*|\.\d+|\d+)([eE][-+]?\d+)?|[-+]?(inf|nan)", re.I)


class VerlInputError(ValueError):
    """An input that cannot be read as a verl run; the message says what and where."""


@dataclass
class VerlInput:
    """What a verl run sets: the keys in the order given, their values and provenance."""

    source: str
    kind: str  # "shell script" or "YAML config"
    values: dict[str, Any] = field(default_factory=dict)
    written: dict[str, str] = field(default_factory=dict)  # the value as written (after shell expansion)
    unresolved: dict[str, list[str]] = field(default_factory=dict)  # key -> the variables it needs
    deleted: list[str] = field(default_factory=list)  # Hydra `~key` deletions
    command: str | None = None  # the program the overrides go to, e.g. "python3 -m recipe.dapo.main_dapo"
    notes: list[str] = field(default_factory=list)


def _split_top_level(text: str) -> list[str]:
    """Comma-separated items of a Hydra list's content, ignoring commas inside quotes and brackets."""
    items, depth, quote, current = [], 0, None, []
    for char in text:
        if quote:
            current.append(char)
            if char == quote:
                quote = None
            continue
        if char in "'\"":
            quote = char
        elif char in "[{(":
            depth += 1
        elif char in "]})":
            depth -= 1
        elif char == "," and depth == 0:
            items.append("".join(current))
            current = []
            continue
        current.append(char)
    if "".join(current).strip():
        items.append("".join(current))
    return items


def parse_hydra_value(text: str) -> Any:
    """A Hydra override's value as Hydra reads it: null, booleans, numbers (1e-6 included), lists, quoted strings."""
    text = text.strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    if text.startswith("[") and text.endswith("]"):
        return [parse_hydra_value(item) for item in _split_top_level(text[1:-1])]
    if text.startswith("{") and text.endswith("}"):
        try:
            return yaml.safe_load(text)
        except yaml.YAMLError:
            return text
    lowered = text.lower()
    if lowered in ("null", "~"):
        return None
    if lowered in ("true", "false"):
        return lowered == "true"
    if INT_PATTERN.fullmatch(text):
        return int(text)
    if FLOAT_PATTERN.fullmatch(text):
        return float(text)
    return text


def record_value(found: VerlInput, key: str, value: Any, written: str, unresolved: set[str]) -> None:
    found.values.pop(key, None)  # a later override wins and takes the later place
    found.values[key] = value
    found.written[key] = written
    if unresolved:
        found.unresolved[key] = sorted(unresolved)
    else:
        found.unresolved.pop(key, None)


def resolve_interpolations(found: VerlInput, defaults: Mapping[str, Any]) -> None:
    """Replace `${key}` / `${oc.select:key,default}` values by the key's value (given, else verl's default)."""

    def lookup(expression: str, depth: int, key: str) -> tuple[bool, Any]:
        expression = expression.strip()
        fallback: tuple[bool, Any] = (False, None)
        if expression.startswith("oc.select:"):
            target, _, default_text = expression[len("oc.select:") :].partition(",")
            expression = target.strip()
            if default_text:
                fallback = (True, parse_hydra_value(default_text))
        if expression.startswith("."):  # relative: `.x` is a sibling of `key`, `..x` its parent's sibling, ...
            dots = len(expression) - len(expression.lstrip("."))
            parent = key.split(".")[:-dots]
            expression = ".".join([*parent, expression[dots:]])
        if expression in found.values and expression not in found.unresolved:
            return True, resolve(found.values[expression], depth + 1, expression)
        if expression in defaults:
            return True, resolve(defaults[expression], depth + 1, expression)
        return fallback

    def resolve(value: Any, depth: int, key: str) -> Any:
        if not isinstance(value, str) or "${" not in value or depth > 10:
            return value
        whole = _INTERPOLATION.fullmatch(value)
        if whole:
            known, result = lookup(whole.group(1), depth, key)
            return result if known else value

        def substitute(match: re.Match) -> str:
            known, result = lookup(match.group(1), depth, key)
            return str(result) if known else match.group(0)

        return _INTERPOLATION.sub(substitute, value)

    for key, value in list(found.values.items()):
        resolved = resolve(value, 0, key)
        if isinstance(resolved, str) and _INTERPOLATION.search(resolved):
            found.unresolved.setdefault(key, []).append(f"interpolation {resolved}")
        found.values[key] = resolved
