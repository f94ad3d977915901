"""Reading a verl run script: the Hydra overrides of its verl command, with the shell variables resolved.

A verl run script assigns shell variables and then runs `python3 -m verl.trainer.main_ppo key=value ...` (or the
DAPO recipe's `recipe.dapo.main_dapo`, possibly behind `ray job submit ... --`). `read_shell_script` follows the
script the way bash would for the subset such scripts use: assignments (`NAME=value`, `export`), `$VAR`, `${VAR}`,
`${VAR:-default}` and the other `${VAR<op>word}` forms, `$((...))` arithmetic, single and double quotes, backslash
line continuations and comments. Variables come from the script's own assignments over the environment given.
A variable that is neither is never guessed: the keys that need it are returned in `VerlInput.unresolved`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

from .hydra import OVERRIDE_PATTERN, VerlInput, VerlInputError, parse_hydra_value, record_value
from .shell_expansion import ShellState, _Expanded
from .shell_words import Word, split_shell_commands

_ASSIGNMENT = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)(\+?)=(.*)", re.S)
_DECLARATIONS = ("export", "declare", "typeset", "local", "readonly")
# Modules that take verl's Hydra overrides; a command naming one of them is the run to translate.
_VERL_ENTRY_HINTS = ("main_ppo", "main_dapo", "verl.trainer", "recipe.")


def _is_assignment(word: Word) -> re.Match | None:
    return _ASSIGNMENT.fullmatch(word[0][1]) if word and word[0][0] == "bare" else None


def _assignment_value(word: Word, match: re.Match) -> Word:
    return [("bare", match.group(3))] + word[1:] if match.group(3) else word[1:]


def _command_overrides(words: list[tuple[str, set[str]]]) -> list[tuple[str, str, str, set[str]]]:
    """(prefix, key, value text, unresolved) of every Hydra override among a command's words."""
    overrides = []
    for text, unresolved in words:
        match = OVERRIDE_PATTERN.fullmatch(text)
        if match and (match.group(3) is not None or match.group(1) == "~"):
            overrides.append((match.group(1) or "", match.group(2), match.group(3) or "", unresolved))
    return overrides


def read_shell_script(text: str, environment: Mapping[str, str], source: str = "script") -> VerlInput:
    """The Hydra overrides of the verl command in a run script, with its variables resolved (module docstring)."""
    state = ShellState(environment)
    candidates: list[tuple[list[tuple[str, set[str]]], bool]] = []  # (expanded words, script arguments passed)
    for words in split_shell_commands(text):
        start = 0
        declaration = words[0] == [("bare", words[0][0][1])] and words[0][0][1] in _DECLARATIONS
        if declaration:
            start = 1
        assigned_only = True
        for word in words[start:]:
            match = _is_assignment(word)
            if match is None:
                if declaration and word[0][1].startswith("-"):
                    continue
                assigned_only = False
                break
        if assigned_only:
            for word in words[start:]:
                match = _is_assignment(word)
                if match is not None:
                    fields, unresolved, _ = state.expand_word(_assignment_value(word, match), split=False)
                    state.assign(match.group(1), _Expanded("".join(fields), unresolved), append=bool(match.group(2)))
            continue
        expanded: list[tuple[str, set[str]]] = []
        passes_arguments = False
        leading = True
        for word in words:
            if leading and _is_assignment(word):
                continue  # `VAR=1 python3 ...`: that command's environment, not an argument
            leading = False
            fields, unresolved, arguments = state.expand_word(word)
            passes_arguments |= arguments
            expanded.extend((text, unresolved) for text in fields)
        candidates.append((expanded, passes_arguments))

    def rank(candidate: tuple[list[tuple[str, set[str]]], bool]) -> tuple[bool, int]:
        words, _ = candidate
        named = any(hint in text for text, _ in words for hint in _VERL_ENTRY_HINTS)
        return (named, len(_command_overrides(words)))

    with_overrides = [candidate for candidate in candidates if _command_overrides(candidate[0])]
    if not with_overrides:
        raise VerlInputError(
            f"{source}: no command with verl overrides (key.subkey=value), e.g. `python3 -m verl.trainer.main_ppo "
            "data.train_batch_size=512 ...`"
        )
    words, passes_arguments = max(with_overrides, key=rank)
    found = VerlInput(source=source, kind="shell script")
    module = next((words[i + 1][0] for i, (text, _) in enumerate(words[:-1]) if text == "-m"), None)
    program = next((text for text, _ in words if "python" in Path(text).name), "python")
    found.command = f"{program} -m {module}" if module else " ".join(text for text, _ in words[:3])
    for prefix, key, value, unresolved in _command_overrides(words):
        if prefix == "~":
            found.deleted.append(key)
            continue
        record_value(found, key, parse_hydra_value(value), value, unresolved)
    if passes_arguments:
        found.notes.append(
            "the script passes its own arguments to verl (`$@`): give them to this translator after the script "
            "(`python -m dapo_trl.from_verl SCRIPT --output DIR key=value ...`) so they are translated too"
        )
    extra = [text for text, _ in words if text.startswith("--config-name") or text.startswith("--config-path")]
    if extra:
        found.notes.append(
            f"Hydra options {extra}: the base config is taken to be verl's ppo_trainer.yaml (the DAPO recipe's "
            "dapo_trainer.yaml only adds keys that are translated with verl's defaults)"
        )
    return found
