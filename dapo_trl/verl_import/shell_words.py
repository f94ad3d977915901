"""A shell script as simple commands of words, each word a list of (quoting, text) parts so that expansion can
honour the quotes: newlines and `;` `&` `|` separate commands, a backslash-newline joins lines, `#` comments.
"""

from __future__ import annotations

from .hydra import VerlInputError

# The words of one shell command, each a list of (kind, text) parts: "bare" (unquoted), "single", "double".
Word = list[tuple[str, str]]


def closing_span(text: str, start: int) -> int:
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
            index = closing_span(text, index)
            continue
        if char == '"':
            return index
        index += 1
    raise VerlInputError(f"unterminated double quote: {text[start - 1 : start + 60]!r}")


class _WordParts:
    """The parts of the word being read; unquoted characters gather in `bare` until a quoted part follows them."""

    def __init__(self) -> None:
        self.parts: Word = []
        self.bare: list[str] = []

    def flush(self) -> None:
        if self.bare:
            self.parts.append(("bare", "".join(self.bare)))
            self.bare.clear()

    def quoted(self, kind: str, text: str) -> None:
        self.flush()
        self.parts.append((kind, text))

    def take_span(self, text: str, index: int) -> int | None:
        """At a `"..."` (a double-quoted part) or a `$(...)`/`${...}` (unquoted text, expanded later): keep it and
        return the index after it; None at any other character."""
        if text[index] == '"':
            closing = _closing_double_quote(text, index + 1)
            self.quoted("double", text[index + 1 : closing])
            return closing + 1
        if text[index] == "$" and index + 1 < len(text) and text[index + 1] in "({":
            end = closing_span(text, index)
            self.bare.append(text[index:end])
            return end
        return None


def quoted_parts(text: str) -> Word:
    """One word's parts by quoting, without splitting on whitespace (the word of `${NAME:-word}`)."""
    word = _WordParts()
    index = 0
    while index < len(text):
        char = text[index]
        after_span = word.take_span(text, index)
        if after_span is not None:
            index = after_span
        elif char == "'" and "'" in text[index + 1 :]:
            closing = text.index("'", index + 1)
            word.quoted("single", text[index + 1 : closing])
            index = closing + 1
        elif char == "\\" and index + 1 < len(text):
            word.quoted("single", text[index + 1])
            index += 2
        else:
            word.bare.append(char)
            index += 1
    word.flush()
    return word.parts or [("single", "")]


def split_shell_commands(text: str) -> list[list[Word]]:
    """The script's simple commands, each a list of words; quotes are kept as parts so expansion can honour them.

    Newlines, `;`, `&`, `&&`, `|` and `||` separate commands; a backslash-newline joins lines; `#` at the start of a
    word starts a comment. Control structures (`if`, `for`) are not interpreted: their words are plain commands.
    """
    commands: list[list[Word]] = []
    words: list[Word] = []
    word = _WordParts()

    def end_word() -> None:
        word.flush()
        if word.parts:
            words.append(word.parts.copy())
            word.parts.clear()

    def end_command() -> None:
        end_word()
        if words:
            commands.append(words.copy())
            words.clear()

    index, length = 0, len(text)
    while index < length:
        char = text[index]
        after_span = word.take_span(text, index)
        if after_span is not None:
            index = after_span
        elif char == "\\":
            if index + 1 < length and text[index + 1] == "\n":
                index += 2
                continue
            if index + 1 < length:
                word.quoted("single", text[index + 1])
            index += 2
        elif char in " \t\r":
            end_word()
            index += 1
        elif char in "\n;&|":
            end_command()
            index += 1
        elif char == "#" and not word.bare and not word.parts:
            newline = text.find("\n", index)
            index = length if newline < 0 else newline
        elif char == "'":
            closing = text.find("'", index + 1)
            if closing < 0:
                raise VerlInputError(f"unterminated single quote: {text[index : index + 60]!r}")
            word.quoted("single", text[index + 1 : closing])
            index = closing + 1
        elif char == "`":
            closing = text.find("`", index + 1)
            end = length if closing < 0 else closing + 1
            word.bare.append(text[index:end])
            index = end
        else:
            word.bare.append(char)
            index += 1
    end_command()
    return commands
