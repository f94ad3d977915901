"""A shell script's variables and the expansion of its words against them, as bash does it for the subset verl run
scripts use: `$VAR`, `${VAR}`, `${VAR<op>word}`, `$((...))` arithmetic, quotes. A variable that is neither
assigned nor in the environment is never guessed: it is reported as unresolved.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from .hydra import INT_PATTERN, VerlInputError
from .shell_words import Word, closing_span, quoted_parts

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_PARAMETER = re.compile(r"([A-Za-z_][A-Za-z0-9_]*|[0-9]+|[@*#?$!-])(?:(:?[-=?+])(.*))?", re.S)


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
        fields, unresolved, _ = self.expand_word(quoted_parts(word), split=False)
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
            if INT_PATTERN.fullmatch(text):
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
                end = closing_span(text, index)
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
