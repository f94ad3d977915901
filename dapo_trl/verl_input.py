"""Reading a verl run: a shell script's Hydra overrides, or a verl YAML config, as `{dotted key: value}`.

A verl run script assigns shell variables and then runs `python3 -m verl.trainer.main_ppo key=value ...` (or the
DAPO recipe's `recipe.dapo.main_dapo`, possibly behind `ray job submit ... --`). `read_shell_script` follows the
script the way bash would for the subset such scripts use: assignments (`NAME=value`, `export`), `$VAR`, `${VAR}`,
`${VAR:-default}` and the other `${VAR<op>word}` forms, `$((...))` arithmetic, single and double quotes, backslash
line continuations and comments. Variables come from the script's own assignments over the environment given.
A variable that is neither is never guessed: the keys that need it are returned in `VerlInput.unresolved`.

`read_verl_yaml` flattens a verl YAML config (nested keys -> dotted). Both resolve `${key}` and
`${oc.select:key,default}` interpolations against the other keys and verl's defaults.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

# The words of one shell command, each a list of (kind, text) parts: "bare" (unquoted), "single", "double".
Word = list[tuple[str, str]]

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_ASSIGNMENT = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)(\+?)=(.*)", re.S)
_PARAMETER = re.compile(r"([A-Za-z_][A-Za-z0-9_]*|[0-9]+|[@*#?$!-])(?:(:?[-=?+])(.*))?", re.S)
_OVERRIDE = re.compile(r"(\+\+|\+|~)?([A-Za-z_][\w\-]*(?:\.[\w\-@]+)+)(?:=(.*))?", re.S)
_INTERPOLATION = re.compile(r"\$\{([^${}]+)\}")
_INT = re.compile(r"[-+]?\d+")
_FLOAT = re.compile(r"[-+]?(\d+\.\d*|\.\d+|\d+)([eE][-+]?\d+)?|[-+]?(inf|nan)", re.I)
_DECLARATIONS = ("export", "declare", "typeset", "local", "readonly")
# Modules that take verl's Hydra overrides; a command naming one of them is the run to translate.
_VERL_ENTRY_HINTS = ("main_ppo", "main_dapo", "verl.trainer", "recipe.")


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


# ------------------------------------------------------------------------------------------------ shell words
def _closing_span(text: str, start: int) -> int:
    """Index after the `)` or `}` closing the `$(`/`$((`/`${` that starts at `start` (at the `$`)."""
    opening = text[start + 1]
    closing = ")" if opening == "(" else "}"
    depth, index, quote = 0, start + 1, None
    while index < len(text):
        char = text[index]
        if quote:
            if char == quote:
                quote = None
            elif char == "\\" and quote == '"':
                index += 1
        elif char in "'\"" and opening == "{":
            quote = char
        elif char == "\\":
            index += 1
        elif char == opening:
            depth += 1
        elif char == closing:
            depth -= 1
            if depth == 0:
                return index + 1
        index += 1
    raise VerlInputError(f"unbalanced '${opening}' in: {text[start : start + 60]!r}")


def _closing_double_quote(text: str, start: int) -> int:
    """Index of the `"` closing a double-quoted string whose content starts at `start`."""
    index = start
    while index < len(text):
        char = text[index]
        if char == "\\":
            index += 2
            continue
        if char == "$" and index + 1 < len(text) and text[index + 1] in "({":
            index = _closing_span(text, index)
            continue
        if char == '"':
            return index
        index += 1
    raise VerlInputError(f"unterminated double quote: {text[start - 1 : start + 60]!r}")


def _quoted_parts(text: str) -> Word:
    """One word's parts by quoting, without splitting on whitespace (the word of `${NAME:-word}`)."""
    parts: Word = []
    bare: list[str] = []

    def flush() -> None:
        if bare:
            parts.append(("bare", "".join(bare)))
            bare.clear()

    index = 0
    while index < len(text):
        char = text[index]
        if char == "'" and "'" in text[index + 1 :]:
            closing = text.index("'", index + 1)
            flush()
            parts.append(("single", text[index + 1 : closing]))
            index = closing + 1
        elif char == '"':
            closing = _closing_double_quote(text, index + 1)
            flush()
            parts.append(("double", text[index + 1 : closing]))
            index = closing + 1
        elif char == "\\" and index + 1 < len(text):
            flush()
            parts.append(("single", text[index + 1]))
            index += 2
        elif char == "$" and index + 1 < len(text) and text[index + 1] in "({":
            end = _closing_span(text, index)
            bare.append(text[index:end])
            index = end
        else:
            bare.append(char)
            index += 1
    flush()
    return parts or [("single", "")]


def split_shell_commands(text: str) -> list[list[Word]]:
    """The script's simple commands, each a list of words; quotes are kept as parts so expansion can honour them.

    Newlines, `;`, `&`, `&&`, `|` and `||` separate commands; a backslash-newline joins lines; `#` at the start of a
    word starts a comment. Control structures (`if`, `for`) are not interpreted: their words are plain commands.
    """
    commands: list[list[Word]] = []
    words: list[Word] = []
    parts: Word = []
    bare: list[str] = []

    def flush_bare() -> None:
        if bare:
            parts.append(("bare", "".join(bare)))
            bare.clear()

    def end_word() -> None:
        flush_bare()
        if parts:
            words.append(parts.copy())
            parts.clear()

    def end_command() -> None:
        end_word()
        if words:
            commands.append(words.copy())
            words.clear()

    index, length = 0, len(text)
    while index < length:
        char = text[index]
        if char == "\\":
            if index + 1 < length and text[index + 1] == "\n":
                index += 2
                continue
            if index + 1 < length:
                flush_bare()
                parts.append(("single", text[index + 1]))
            index += 2
        elif char in " \t\r":
            end_word()
            index += 1
        elif char in "\n;&|":
            end_command()
            index += 1
        elif char == "#" and not bare and not parts:
            newline = text.find("\n", index)
            index = length if newline < 0 else newline
        elif char == "'":
            closing = text.find("'", index + 1)
            if closing < 0:
                raise VerlInputError(f"unterminated single quote: {text[index : index + 60]!r}")
            flush_bare()
            parts.append(("single", text[index + 1 : closing]))
            index = closing + 1
        elif char == '"':
            closing = _closing_double_quote(text, index + 1)
            flush_bare()
            parts.append(("double", text[index + 1 : closing]))
            index = closing + 1
        elif char == "$" and index + 1 < length and text[index + 1] in "({":
            end = _closing_span(text, index)
            bare.append(text[index:end])
            index = end
        elif char == "`":
            closing = text.find("`", index + 1)
            end = length if closing < 0 else closing + 1
            bare.append(text[index:end])
            index = end
        else:
            bare.append(char)
            index += 1
    end_command()
    return commands


# ------------------------------------------------------------------------------------------------ expansion
@dataclass
class _Expanded:
    text: str
    unresolved: set[str] = field(default_factory=set)
    expanded: bool = False  # an expansion happened (unquoted ones are then split into fields)
    script_arguments: bool = False  # "$@" / "$*": the script's own arguments


class ShellState:
    """Variables (environment, then the script's assignments) and the expansion of words against them."""

    def __init__(self, environment: Mapping[str, str]) -> None:
        # name -> (value, variables it could not resolve)
        self.variables: dict[str, tuple[str, frozenset[str]]] = {
            name: (str(value), frozenset()) for name, value in environment.items()
        }

    def assign(self, name: str, value: _Expanded, append: bool = False) -> None:
        if append and name in self.variables:
            old, missing = self.variables[name]
            self.variables[name] = (old + value.text, missing | frozenset(value.unresolved))
        else:
            self.variables[name] = (value.text, frozenset(value.unresolved))

    # -------------------------------------------------------------------------------------------- parameters
    def _parameter(self, inner: str) -> _Expanded:
        """`${inner}`: NAME, or NAME with one of the operators :- - := = :? ? :+ +."""
        match = _PARAMETER.fullmatch(inner)
        if match is None:
            return _Expanded(f"${{{inner}}}", {f"${{{inner}}}"}, True)
        name, operator, word = match.groups()
        if name in ("@", "*"):
            return _Expanded("", set(), True, script_arguments=True)
        present = name in self.variables
        value, missing = self.variables.get(name, ("", frozenset()))
        result = _Expanded(value, set(missing), True)
        if operator is None:
            if not present:
                result.unresolved.add(name)
            return result
        empty = not present or (operator.startswith(":") and value == "")
        kind = operator[-1]
        if kind in "-=":
            if empty:
                result = self._operand(word)
                if kind == "=":
                    self.assign(name, result)
            return result
        if kind == "+":
            return self._operand(word) if not empty else _Expanded("", set(), True)
        if empty:  # "?": bash stops here with the message
            return _Expanded("", {name}, True)
        return result

    def _operand(self, word: str) -> _Expanded:
        """The word of `${NAME:-word}`: quotes removed, expansions done, never split."""
        fields, unresolved, _ = self.expand_word(_quoted_parts(word), split=False)
        return _Expanded("".join(fields), unresolved, True)

    def _arithmetic(self, expression: str, depth: int = 0) -> _Expanded:
        """`$((expression))`: integer arithmetic as bash does it; unset names are unresolved (bash would use 0)."""
        inner = self.expand_text(expression, quoted=True)
        unresolved = set(inner.unresolved)

        def value_of(match: re.Match) -> str:
            name = match.group(0)
            if name not in self.variables:
                unresolved.add(name)
                return "0"
            text, missing = self.variables[name]
            unresolved.update(missing)
            text = text.strip() or "0"
            if _INT.fullmatch(text):
                return f"({int(text)})"
            if depth > 8:
                raise VerlInputError(f"arithmetic on {name} recurses too deeply")
            return f"({self._arithmetic(text, depth + 1).text or 0})"

        substituted = _NAME.sub(value_of, inner.text)
        if unresolved:
            return _Expanded(f"$(({expression}))", unresolved, True)
        try:
            value = _evaluate_integer(ast.parse(substituted.strip(), mode="eval").body)
        except (SyntaxError, ValueError, ZeroDivisionError) as error:
            raise VerlInputError(f"cannot evaluate $(({expression})): {error}") from None
        return _Expanded(str(value), set(), True)

    # -------------------------------------------------------------------------------------------- text
    def expand_text(self, text: str, quoted: bool) -> _Expanded:
        """Expand `$...` in `text` (the content of a double-quoted or an unquoted part)."""
        out: list[str] = []
        result = _Expanded("")
        index, length = 0, len(text)
        while index < length:
            char = text[index]
            if char == "\\" and quoted and index + 1 < length and text[index + 1] in '$`"\\\n':
                if text[index + 1] != "\n":
                    out.append(text[index + 1])
                index += 2
                continue
            if char == "`":
                closing = text.find("`", index + 1)
                end = length if closing < 0 else closing + 1
                result.unresolved.add(f"command substitution {text[index:end]}")
                out.append(text[index:end])
                index = end
                continue
            if char != "$" or index + 1 >= length:
                out.append(char)
                index += 1
                continue
            following = text[index + 1]
            if following in "({":
                end = _closing_span(text, index)
                if text.startswith("$((", index) and text[end - 2 : end] == "))":
                    piece = self._arithmetic(text[index + 3 : end - 2])
                elif following == "(":
                    piece = _Expanded(text[index:end], {f"command substitution {text[index:end]}"}, True)
                else:
                    piece = self._parameter(text[index + 2 : end - 1])
                index = end
            else:
                match = _NAME.match(text, index + 1)
                if match:
                    piece = self._parameter(match.group(0))
                    index = match.end()
                elif following in "@*":
                    piece = _Expanded("", set(), True, script_arguments=True)
                    index += 2
                elif following.isdigit() or following in "#?$!-":
                    name = following
                    piece = _Expanded(f"${name}", {f"${name}"}, True)
                    index += 2
                else:
                    out.append(char)
                    index += 1
                    continue
            out.append(piece.text)
            result.unresolved |= piece.unresolved
            result.expanded = True
            result.script_arguments |= piece.script_arguments
        result.text = "".join(out)
        return result

    def expand_word(self, word: Word, split: bool = True) -> tuple[list[str], set[str], bool]:
        """(fields, unresolved variables, whether it held "$@") of one word; an unquoted expansion is split on
        whitespace as bash does (only when `split` and the word has no quoted part)."""
        pieces, unresolved, arguments, any_expansion = [], set(), False, False
        for kind, text in word:
            if kind == "single":
                pieces.append(text)
                continue
            expanded = self.expand_text(text, quoted=kind == "double")
            pieces.append(expanded.text)
            unresolved |= expanded.unresolved
            arguments |= expanded.script_arguments
            any_expansion |= expanded.expanded
        text = "".join(pieces)
        if split and any_expansion and not unresolved and all(kind == "bare" for kind, _ in word):
            return text.split(), unresolved, arguments
        if arguments and not text:
            return [], unresolved, arguments
        return [text], unresolved, arguments


def _evaluate_integer(node: ast.AST) -> int:
    """Bash integer arithmetic on a parsed expression: + - * / % ** << >> & | ^ and unary signs."""
    if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd | ast.Invert):
        value = _evaluate_integer(node.operand)
        return -value if isinstance(node.op, ast.USub) else (~value if isinstance(node.op, ast.Invert) else value)
    if isinstance(node, ast.BinOp):
        left, right = _evaluate_integer(node.left), _evaluate_integer(node.right)
        operations: dict[type, Callable[[int, int], int]] = {
            ast.Add: lambda a, b: a + b,
            ast.Sub: lambda a, b: a - b,
            ast.Mult: lambda a, b: a * b,
            ast.Div: lambda a, b: abs(a) // abs(b) * (1 if (a >= 0) == (b > 0) else -1),  # truncates toward 0
            ast.Mod: lambda a, b: a - b * (abs(a) // abs(b) * (1 if (a >= 0) == (b > 0) else -1)),
            ast.Pow: lambda a, b: a**b,
            ast.LShift: lambda a, b: a << b,
            ast.RShift: lambda a, b: a >> b,
            ast.BitAnd: lambda a, b: a & b,
            ast.BitOr: lambda a, b: a | b,
            ast.BitXor: lambda a, b: a ^ b,
        }
        operation = operations.get(type(node.op))
        if operation is not None:
            return operation(left, right)
    raise ValueError(f"unsupported arithmetic {ast.unparse(node)!r}")


# ------------------------------------------------------------------------------------------------ Hydra values
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
    if _INT.fullmatch(text):
        return int(text)
    if _FLOAT.fullmatch(text):
        return float(text)
    return text


# ------------------------------------------------------------------------------------------------ readers
def _record(found: VerlInput, key: str, value: Any, written: str, unresolved: set[str]) -> None:
    found.values.pop(key, None)  # a later override wins and takes the later place
    found.values[key] = value
    found.written[key] = written
    if unresolved:
        found.unresolved[key] = sorted(unresolved)
    else:
        found.unresolved.pop(key, None)


def _is_assignment(word: Word) -> re.Match | None:
    return _ASSIGNMENT.fullmatch(word[0][1]) if word and word[0][0] == "bare" else None


def _assignment_value(word: Word, match: re.Match) -> Word:
    return [("bare", match.group(3))] + word[1:] if match.group(3) else word[1:]


def _command_overrides(words: list[tuple[str, set[str]]]) -> list[tuple[str, str, str, set[str]]]:
    """(prefix, key, value text, unresolved) of every Hydra override among a command's words."""
    overrides = []
    for text, unresolved in words:
        match = _OVERRIDE.fullmatch(text)
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
        _record(found, key, parse_hydra_value(value), value, unresolved)
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


def _flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(data, dict) and data:
        flat: dict[str, Any] = {}
        for key, value in data.items():
            flat.update(_flatten(value, f"{prefix}.{key}" if prefix else str(key)))
        return flat
    return {prefix: data}


def _yaml_scalar(value: Any) -> Any:
    """YAML 1.1 reads `1e-6` as a string; OmegaConf (verl) reads it as a float."""
    if isinstance(value, str) and _FLOAT.fullmatch(value.strip()) and not _INT.fullmatch(value.strip()):
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
        _record(found, key, value, yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("..."), set())
        found.written[key] = found.written[key].strip()
    return found


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
        match = _OVERRIDE.fullmatch(override)
        if match is None or (match.group(3) is None and match.group(1) != "~"):
            raise VerlInputError(f"extra override {override!r} is not of the form key.subkey=value")
        if match.group(1) == "~":
            found.deleted.append(match.group(2))
        else:
            _record(found, match.group(2), parse_hydra_value(match.group(3)), match.group(3), set())
    return found
