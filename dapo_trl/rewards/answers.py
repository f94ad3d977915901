"""What a response answers, read the same way by every scorer: extraction, normalisation, verdicts.

Answer extraction (DAPO's "Answer:" line, the last `\\boxed{}`, the answer a response commits to), Minerva's and
math-verify-oriented normalisation, the `Verdict` of one response and the +1 / -1 it earns, and how verdicts are
counted through TRL's `log_metric`. Pure Python (no math-verify, torch or TRL): every scorer and worker imports it.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable, Mapping, Sequence
from fractions import Fraction
from typing import Any

CORRECT_REWARD = 1.0
INCORRECT_REWARD = -1.0
# DAPO's scorer only reads the end of a response, where the final answer line must be.
DAPO_TAIL_CHARS = 300
# math_verify reads at most this much of the end of a response (DAPO's longest responses, 20k tokens, fit): it bounds
# the cost of extraction on garbage, done in the trainer process.
MAX_RESPONSE_CHARS = 100_000
# A committed answer longer than this is not a final answer (a 1 MB "Answer:" line); it is not sent to math-verify.
MAX_ANSWER_CHARS = 1_000

# DAPO's answer line, as its published scorer reads it: at least one character must follow, and `\s*` may cross line
# breaks, so a trailing empty "Answer:" line does not count but "Answer:\n5" reads "5".
_ANSWER_LINE = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")

# Minerva's normalisation (Lewkowycz et al. 2022, Appendix D), as DAPO uses it.
_SUBSTITUTIONS = [
    ("an ", ""),
    ("a ", ""),
    (".$", "$"),
    ("\\$", ""),
    (r"\ ", ""),
    (" ", ""),
    ("mbox", "text"),
    (",\\text{and}", ","),
    ("\\text{and}", ","),
    ("\\text{m}", "\\text{}"),
]
_REMOVED_EXPRESSIONS = [
    "square",
    "ways",
    "integers",
    "dollars",
    "mph",
    "inches",
    "hours",
    "km",
    "units",
    "\\ldots",
    "sue",
    "points",
    "feet",
    "minutes",
    "digits",
    "cents",
    "degrees",
    "cm",
    "gm",
    "pounds",
    "meters",
    "meals",
    "edges",
    "students",
    "childrentickets",
    "multiples",
    "\\text{s}",
    "\\text{.}",
    "\\text{\ns}",
    "\\text{}^2",
    "\\text{}^3",
    "\\text{\n}",
    "\\text{}",
    r"\mathrm{th}",
    r"^\circ",
    r"^{\circ}",
    r"\;",
    r",\!",
    "{,}",
    '"',
    "\\dots",
]


def normalize_final_answer(answer: str) -> str:
    """Minerva-style normalisation of a final answer string, so '$1{,}000$.' and '1000' compare equal."""
    answer = answer.split("=")[-1]
    for before, after in _SUBSTITUTIONS:
        answer = answer.replace(before, after)
    for expression in _REMOVED_EXPRESSIONS:
        answer = answer.replace(expression, "")
    answer = re.sub(r"(.*?)(\$)(.*?)(\$)(.*)", "$\\3$", answer)
    answer = re.sub(r"(\\text\{)(.*?)(\})", "\\2", answer)
    answer = re.sub(r"(\\textbf\{)(.*?)(\})", "\\2", answer)
    answer = re.sub(r"(\\overline\{)(.*?)(\})", "\\2", answer)
    answer = re.sub(r"(\\boxed\{)(.*)(\})", "\\2", answer)
    # Shorthand LaTeX: \fracab -> \frac{a}{b}, \sqrta -> \sqrt{a}.
    answer = re.sub(r"(frac)([^{])(.)", "frac{\\2}{\\3}", answer)
    answer = re.sub(r"(sqrt)([^{])", "sqrt{\\2}", answer)
    answer = answer.replace("$", "")
    if answer.replace(",", "").isdigit():
        answer = answer.replace(",", "")
    return answer.strip()


def read_response(completion: Any) -> str | None:
    """The assistant's text of a completion, or None when it is not a completion at all (None, a number...)."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, (bytes, bytearray)):
        return bytes(completion).decode("utf-8", errors="replace")
    if not isinstance(completion, Sequence):
        return None
    parts: list[str] = []
    for message in completion:
        if not isinstance(message, Mapping) or message.get("role", "assistant") != "assistant":
            continue
        content = message.get("content")
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):  # content parts: [{"type": "text", "text": ...}, ...]
            parts.extend(
                part["text"]
                for part in content
                if isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str)
            )
    return "".join(parts)


def completion_text(completion: str | Sequence[dict[str, Any]]) -> str:
    """The assistant's text of a completion, whether TRL passes a string or a list of chat messages ("" if neither)."""
    return read_response(completion) or ""


def check_lengths(completions: Sequence[Any], solution: Sequence[Any]) -> None:
    """Refuse mismatched batches: zip would silently score responses against the wrong ground truths."""
    if len(completions) != len(solution):
        raise ValueError(f"got {len(completions)} completions but {len(solution)} solutions")


class Verdict(enum.IntEnum):
    """How a response was scored. Only CORRECT earns CORRECT_REWARD; the last three are counted as metrics."""

    WRONG = 0
    CORRECT = 1
    NO_ANSWER = 2  # no committed answer: none, the echoed template "Answer: $Answer", an empty line or box
    UNPARSEABLE = 3  # not readable: not a completion, an unclosed box, an oversized or unparseable answer, a crash
    TIMEOUT = 4  # scoring ran past its deadline


_METRIC_OF_VERDICT = {Verdict.TIMEOUT: "timeouts", Verdict.UNPARSEABLE: "unparseable", Verdict.NO_ANSWER: "no_answer"}


def verdict_reward(verdict: Verdict) -> float:
    """DAPO's +1 / -1: only CORRECT is rewarded, every failure to read or judge an answer scores as wrong."""
    return CORRECT_REWARD if verdict == Verdict.CORRECT else INCORRECT_REWARD


def log_verdict_counts(
    log_metric: Callable[[str, float], None] | None, name: str, verdicts: Sequence[Verdict], metrics: Sequence[str]
) -> None:
    """Log this batch's count of each metric in `metrics` (zeros too: TRL averages the values it receives)."""
    if log_metric is None:
        return
    counts = dict.fromkeys(metrics, 0)
    for verdict in verdicts:
        metric = _METRIC_OF_VERDICT.get(verdict)
        if metric in counts:
            counts[metric] += 1
    for metric, count in counts.items():
        log_metric(f"rewards/{name}/{metric}", float(count))


# ------------------------------------------------------------------------------------------------------ extraction
def extract_dapo_answer(response: str) -> str | None:
    """The text of the last "Answer: ..." line within the last DAPO_TAIL_CHARS characters, or None when there is none.

    Exactly what DAPO's published scorer reads: the text is not stripped (a trailing `\\r`, tab or no-break space is
    part of the answer and can change its normalised form); an "Answer:" followed only by line breaks is skipped in
    favour of an earlier one, and one followed by line breaks and then text reads that text. The result may be
    whitespace only ("Answer: " at the very end).
    """
    matches = _ANSWER_LINE.findall(response[-DAPO_TAIL_CHARS:])
    return matches[-1] if matches else None


_BOX_OPEN = re.compile(r"\\(?:boxed|fbox)[ \t]*\{")
_BRACE_OR_ESCAPE = re.compile(r"\\.|[{}]", re.DOTALL)


def last_boxed(text: str) -> tuple[int, str | None] | None:
    """Where the last `\\boxed{` (or `\\fbox{`) of `text` starts, and its brace-balanced content (None if unclosed).

    Escaped braces (`\\{1, 2\\}`) do not count, so a boxed set is read whole. Linear in `len(text)`.
    """
    last = None
    for last in _BOX_OPEN.finditer(text):  # noqa: B007 - only the last match is wanted
        pass
    if last is None:
        return None
    depth = 1
    for token in _BRACE_OR_ESCAPE.finditer(text, last.end()):
        if token.group() == "{":
            depth += 1
        elif token.group() == "}":
            depth -= 1
            if depth == 0:
                return last.start(), text[last.end() : token.start()]
    return last.start(), None


def extract_boxed_answer(response: str) -> str | None:
    """The content of the last closed `\\boxed{...}` within the last DAPO_TAIL_CHARS characters, or None."""
    box = last_boxed(response[-DAPO_TAIL_CHARS:])
    if box is None or box[1] is None:
        return None
    return box[1].strip() or None


# ------------------------------------------------------------------------------------------------ committed answer
# In the math_verify scorer an "Answer:" line starts a line (after Markdown marks and an optional "Final"), the form the
# DAPO prompt asks for, so that a later "let me check the answer: 3 + 4 = 7" does not override a boxed answer.
_COMMITTED_ANSWER_LINE = re.compile(r"(?im)^[ \t>#*_]*(?:final[ \t]+)?answer[ \t]*[*_]*[ \t]*[:\uff1a][ \t*_]*([^\n]*)")
# Stripping these from both ends of an echoed template ("$Answer", "\$Answer", "{Answer}") leaves "answer".
_TEMPLATE_DECORATION = " \t$\\{}[]<>()*_.:\"'`"


def committed_answer(response: str) -> tuple[str, bool] | Verdict:
    """(answer, whether it is boxed), or the verdict for a response that commits to no readable answer.

    The verdict lets `score_math_verify` decide such responses here, without sending anything to a worker.
    """
    tail = response[-MAX_RESPONSE_CHARS:]
    box = last_boxed(tail)
    line = None
    for line in _COMMITTED_ANSWER_LINE.finditer(tail):  # noqa: B007 - only the last match is wanted
        pass
    if line is not None and (box is None or line.start() > box[0]):
        answer, boxed = line.group(1).strip().rstrip("*_ ").rstrip("."), False
    elif box is not None:
        if box[1] is None:
            return Verdict.UNPARSEABLE  # the last box is never closed: a truncated response
        answer, boxed = box[1].strip(), True
    else:
        return Verdict.NO_ANSWER
    if answer.strip(_TEMPLATE_DECORATION).lower() in ("", "answer"):
        return Verdict.NO_ANSWER
    if len(answer) > MAX_ANSWER_CHARS:
        return Verdict.UNPARSEABLE
    # Lone surrogates (broken decoding upstream) become "?": they would make the parser raise.
    return answer.encode("utf-8", errors="replace").decode("utf-8"), boxed


def extract_committed_answer(response: str) -> str | None:
    """The answer `response` commits to: its last `\\boxed{}` or "Answer:" line, whichever comes LAST, or None.

    Plain math-verify prefers any box over a later "Answer:" line and credits an echoed template, an empty "Answer:"
    line or an empty box; here those are no answer. Only the last MAX_RESPONSE_CHARS characters are read.
    """
    committed = committed_answer(response)
    return committed[0] if isinstance(committed, tuple) else None


# --------------------------------------------------------------------------------------------------- normalisation
_VULGAR_FRACTIONS = {
    "\u00bd": (1, 2),
    "\u2153": (1, 3),
    "\u2154": (2, 3),
    "\u00bc": (1, 4),
    "\u00be": (3, 4),
    "\u2155": (1, 5),
    "\u2156": (2, 5),
    "\u2157": (3, 5),
    "\u2158": (4, 5),
    "\u2159": (1, 6),
    "\u215a": (5, 6),
    "\u2150": (1, 7),
    "\u215b": (1, 8),
    "\u215c": (3, 8),
    "\u215d": (5, 8),
    "\u215e": (7, 8),
    "\u2151": (1, 9),
    "\u2152": (1, 10),
    "\u2189": (0, 3),
}
_SYMBOLS = str.maketrans(
    {
        **dict.fromkeys("\u2212\u2012\ufe63\uff0d\u2796", "-"),  # minus signs
        **dict.fromkeys("\u00a0\u2002\u2003\u2005\u2006\u2007\u2008\u2009\u200a\u202f\u3000", " "),  # spaces
        **dict.fromkeys("\u200b\u200c\u200d\u2060\ufeff", ""),  # zero-width characters
        "\u00d7": r"\times ",
        "\u22c5": r"\cdot ",
        "\u00b7": r"\cdot ",
        "\u00f7": r"\div ",
        "\u03c0": r"\pi ",
        "\u221e": r"\infty ",
        "\u2264": r"\le ",
        "\u2265": r"\ge ",
        "\u2260": r"\ne ",
        "\u00b1": r"\pm ",
        "\u00b0": r"^{\circ}",
        "\u2044": "/",
        "\u2215": "/",
    }
)
_SUPERSCRIPT_DIGITS = str.maketrans(
    "\u2070\u00b9\u00b2\u00b3\u2074\u2075\u2076\u2077\u2078\u2079\u207a\u207b", "0123456789+-"
)
_SUPERSCRIPT = re.compile("[\u207a\u207b]?[\u2070\u00b9\u00b2\u00b3\u2074-\u2079]+")
# Digit-group separators: "1\,000", "1\;000", "1{,}000", "1~000", "1 000" with a thin or no-break space.
_THOUSANDS_SEPARATOR = re.compile(r"(?<=\d)(?:\\[,;:!> ]|\{,\}|~|[\u00a0\u2007-\u200a\u202f])(?=\d{3}(?!\d))")
_VULGAR_FRACTION = re.compile(r"(\d*)([" + "".join(_VULGAR_FRACTIONS) + "])")
_ROOT = re.compile(r"([\u221a\u221b\u221c])\s*(?:\(([^()]*)\)|\{([^{}]*)\}|(\d+(?:\.\d+)?|\\[A-Za-z]+|[A-Za-z]))")
_ROOT_INDEX = {"\u221a": "", "\u221b": "[3]", "\u221c": "[4]"}
_PLAIN_SQRT = re.compile(r"(?<![A-Za-z])\\?sqrt\s*\(")
_PLAIN_PI = re.compile(r"(?<![\\A-Za-z])pi(?![A-Za-z])")
# 0.\overline{3}, 0.1\overline{6}, 0.\bar{3}, 0.\overline 3 and 0.\dot{1}4\dot{2} (dots over the first and last digit).
_OVERLINE_DECIMAL = re.compile(r"(?<![\d.])(\d*)\.(\d*)\s*\\(?:overline|bar)\s*(?:\{\s*(\d+)\s*\}|(\d))")
_DOTTED_DECIMAL = re.compile(r"(?<![\d.])(\d*)\.((?:\d|\\dot\s*\{\s*\d\s*\}|\\dot\s*\d)+)")
_DOTTED_DIGIT = re.compile(r"\\dot\s*\{?\s*(\d)\s*\}?|(\d)")


def _fraction_latex(value: Fraction) -> str:
    return str(value.numerator) if value.denominator == 1 else rf"\frac{{{value.numerator}}}{{{value.denominator}}}"


def _repeating_decimal(integer: str, fixed: str, repeating: str) -> str:
    """integer.fixed(repeating)... as an exact fraction: 0.1(6) -> \\frac{1}{6}."""
    tail = Fraction(int(fixed + repeating) - int(fixed or "0"), 10 ** len(fixed) * (10 ** len(repeating) - 1))
    return _fraction_latex(int(integer or "0") + tail)


def _dotted_decimal(match: re.Match[str]) -> str:
    digits, dotted = [], []
    for token in _DOTTED_DIGIT.finditer(match.group(2)):
        digits.append(token.group(1) or token.group(2))
        dotted.append(token.group(1) is not None)
    if not any(dotted):
        return match.group(0)
    first = dotted.index(True)
    last = len(dotted) - 1 - dotted[::-1].index(True)
    if last != len(digits) - 1:
        return match.group(0)  # the repeating block must end the number
    return _repeating_decimal(match.group(1), "".join(digits[:first]), "".join(digits[first:]))


def _vulgar_fraction(match: re.Match[str]) -> str:
    numerator, denominator = _VULGAR_FRACTIONS[match.group(2)]
    fraction = rf"\frac{{{numerator}}}{{{denominator}}}"
    return rf"({match.group(1)}+{fraction})" if match.group(1) else fraction  # 3½ is the mixed number 3 + 1/2


def _root(match: re.Match[str]) -> str:
    operand = next(group for group in match.groups()[1:] if group is not None)
    return rf"\sqrt{_ROOT_INDEX[match.group(1)]}{{{operand}}}"


def _plain_sqrt_to_latex(text: str) -> str:
    """sqrt(18) -> \\sqrt{18}: math-verify's LaTeX parser reads only the braced form."""
    while match := _PLAIN_SQRT.search(text):
        depth, end = 1, match.end()
        while end < len(text) and depth:
            depth += {"(": 1, ")": -1}.get(text[end], 0)
            end += 1
        if depth:
            return text  # unbalanced: leave it to the parser
        text = text[: match.start()] + r"\sqrt{" + text[match.end() : end - 1] + "}" + text[end:]
    return text


def normalize_math_text(text: str) -> str:
    """Rewrite forms plain math-verify misreads into LaTeX it parses, keeping the value.

    Thin-space thousands (1\\,000 -> 1000; plain math-verify reads 1\\,000 as 1*0), repeating decimals
    (0.\\overline{3} -> \\frac{1}{3}), Unicode minus and symbols (-3, \\times, \\pi), superscripts (x² -> x^{2}), vulgar
    fractions (½ -> \\frac{1}{2}, 3½ -> 3 + 1/2), roots (3√2 -> 3\\sqrt{2}) and plain sqrt(...) / pi.
    """
    text = _THOUSANDS_SEPARATOR.sub("", text)
    text = text.translate(_SYMBOLS)
    text = _SUPERSCRIPT.sub(lambda m: "^{" + m.group(0).translate(_SUPERSCRIPT_DIGITS) + "}", text)
    text = _VULGAR_FRACTION.sub(_vulgar_fraction, text)
    text = _ROOT.sub(_root, text)
    text = _plain_sqrt_to_latex(text)
    text = _PLAIN_PI.sub(r"\\pi", text)
    text = _OVERLINE_DECIMAL.sub(lambda m: _repeating_decimal(m.group(1), m.group(2), m.group(3) or m.group(4)), text)
    return _DOTTED_DECIMAL.sub(_dotted_decimal, text)
