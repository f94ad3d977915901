"""`read_verl_input`: a verl run script or YAML config (by extension), plus `key=value` overrides given after it."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from .hydra import OVERRIDE_PATTERN, VerlInput, VerlInputError, parse_hydra_value, record_value
from .script import read_shell_script
from .yaml_config import read_verl_yaml


def read_verl_input(
    path: str | Path, environment: Mapping[str, str], extra_overrides: list[str] | None = None
) -> VerlInput:
    """A verl run script or YAML config (by extension), plus `key=value` overrides appended as `$@` would be."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise VerlInputError(f"cannot read {str(path)!r}: {error.strerror or error}") from None
    if path.suffix.lower() in (".yaml", ".yml"):
        found = read_verl_yaml(text, source=str(path))
    else:
        found = read_shell_script(text, environment, source=str(path))
    for override in extra_overrides or []:
        match = OVERRIDE_PATTERN.fullmatch(override)
        if match is None or (match.group(3) is None and match.group(1) != "~"):
            raise VerlInputError(f"extra override {override!r} is not of the form key.subkey=value")
        if match.group(1) == "~":
            found.deleted.append(match.group(2))
        else:
            record_value(found, match.group(2), parse_hydra_value(match.group(3)), match.group(3), set())
    return found
