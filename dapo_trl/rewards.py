"""Math correctness rewards with TRL's reward-function signature, returning DAPO's +1 / -1.

Three scorers, selectable by name (`REWARD_FUNCTIONS`, `--reward_funcs NAME`):

- `dapo_math` (`dapo_math_reward`): DAPO's own scorer, kept faithful to the paper: the last "Answer: ..." line in the
  last 300 characters, Minerva normalisation, exact string comparison. Exact for DAPO-Math-17k's integer answers, but
  it marks boxed-only responses and equivalent forms (0.5 vs 1/2) wrong.
- `dapo_boxed` (`dapo_boxed_reward`): the same with the last brace-balanced `\\boxed{...}` in the tail instead.
- `math_verify` (`math_verify_reward`): symbolic equivalence with math-verify, on the answer the response commits to
  (its LAST `\\boxed{}` or "Answer:" line, whichever comes last), after normalising forms math-verify misses. Every
  response is scored in a worker process under a hard deadline (`dapo_trl.scoring`), so no input can stall training.

TRL calls reward functions as `f(prompts=..., completions=..., completion_ids=..., log_metric=..., **columns)`; the
ground truth is the `solution` column. Inputs that cannot be read (None, a 1 MB line, an unclosed box) score -1 and
are counted through `log_metric` as `rewards/<function name>/{timeouts,unparseable,no_answer}`, one value per batch.
"""

from __future__ import annotations

import enum
import functools
import logging
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from .scoring import ScoringPool, default_timeout, shared_pool

logger = logging.getLogger(__name__)

CORRECT_REWARD = 1.0
INCORRECT_REWARD = -1.0
# DAPO's scorer only reads the end of a response, where the final answer line must be.
DAPO_TAIL_CHARS = 300
# math_verify reads at most this much of the end of a response (DAPO's longest responses, 20k tokens, fit): it bounds
# the cost of extraction on garbage, done in the trainer process.
MAX_RESPONSE_CHARS = 100_000
# A committed answer longer than this is not a final answer (a 1 MB "Answer:" line); it is not sent to math-verify.
MAX_ANSWER_CHARS = 1_000

_ANSWER_LINE = re.compile(r"(?i)Answer\s*:\s*([^\n]*)")

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


def _read_response(completion: Any) -> str | None:
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
    return _read_response(completion) or ""


def _check_lengths(completions: Sequence[Any], solution: Sequence[Any]) -> None:
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


def _reward(verdict: Verdict) -> float:
    return CORRECT_REWARD if verdict == Verdict.CORRECT else INCORRECT_REWARD


def _log_counts(
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


# ------------------------------------------------------------------------------------------------------------ DAPO
def extract_dapo_answer(response: str) -> str | None:
    """The last "Answer: ..." line within the last DAPO_TAIL_CHARS characters, or None when there is none."""
    matches = _ANSWER_LINE.findall(response[-DAPO_TAIL_CHARS:])
    if not matches:
        return None
    return matches[-1].strip() or None


def dapo_answer_is_correct(response: str, ground_truth: str) -> bool:
    """DAPO's rule: the normalised last "Answer:" line equals the normalised ground truth."""
    predicted = extract_dapo_answer(response)
    if predicted is None:
        return False
    return normalize_final_answer(predicted) == normalize_final_answer(str(ground_truth))


def _dapo_verdict(response: str | None, ground_truth: Any) -> Verdict:
    if response is None:
        return Verdict.UNPARSEABLE
    if extract_dapo_answer(response) is None:
        return Verdict.NO_ANSWER
    return Verdict.CORRECT if dapo_answer_is_correct(response, ground_truth) else Verdict.WRONG


def dapo_math_reward(
    completions: list, solution: list, log_metric: Callable[[str, float], None] | None = None, **kwargs: Any
) -> list[float]:
    """DAPO's correctness reward: +1 when the last "Answer:" line matches `solution`, else -1."""
    _check_lengths(completions, solution)
    verdicts = [_dapo_verdict(_read_response(c), s) for c, s in zip(completions, solution, strict=True)]
    _log_counts(log_metric, "dapo_math_reward", verdicts, ("unparseable", "no_answer"))
    return [_reward(verdict) for verdict in verdicts]


# ------------------------------------------------------------------------------------------------------ strict box
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


def _boxed_verdict(response: str | None, ground_truth: Any) -> Verdict:
    if response is None:
        return Verdict.UNPARSEABLE
    box = last_boxed(response[-DAPO_TAIL_CHARS:])
    if box is None:
        return Verdict.NO_ANSWER
    if box[1] is None:
        return Verdict.UNPARSEABLE  # the box is never closed: a truncated response
    predicted = box[1].strip()
    if not predicted:
        return Verdict.NO_ANSWER
    return (
        Verdict.CORRECT
        if normalize_final_answer(predicted) == normalize_final_answer(str(ground_truth))
        else Verdict.WRONG
    )


def dapo_boxed_reward(
    completions: list, solution: list, log_metric: Callable[[str, float], None] | None = None, **kwargs: Any
) -> list[float]:
    """DAPO's scorer in strict-box mode: +1 when the last `\\boxed{}` in the tail matches `solution`, else -1.

    Like `dapo_math_reward` (last DAPO_TAIL_CHARS characters, Minerva normalisation, string equality), reading the
    box instead of the "Answer:" line. verl's `strict_box_verify` differs: last 100 characters, no normalisation.
    """
    _check_lengths(completions, solution)
    verdicts = [_boxed_verdict(_read_response(c), s) for c, s in zip(completions, solution, strict=True)]
    _log_counts(log_metric, "dapo_boxed_reward", verdicts, ("unparseable", "no_answer"))
    return [_reward(verdict) for verdict in verdicts]


# ------------------------------------------------------------------------------------------------ committed answer
# In the math_verify scorer an "Answer:" line starts a line (after Markdown marks and an optional "Final"), the form the
# DAPO prompt asks for, so that a later "let me check the answer: 3 + 4 = 7" does not override a boxed answer.
_COMMITTED_ANSWER_LINE = re.compile(r"(?im)^[ \t>#*_]*(?:final[ \t]+)?answer[ \t]*[*_]*[ \t]*[:\uff1a][ \t*_]*([^\n]*)")
# Stripping these from both ends of an echoed template ("$Answer", "\$Answer", "{Answer}") leaves "answer".
_TEMPLATE_DECORATION = " \t$\\{}[]<>()*_.:\"'`"


def _committed_answer(response: str) -> tuple[str, bool] | Verdict:
    """(answer, whether it is boxed), or the verdict for a response that commits to no readable answer."""
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
    committed = _committed_answer(response)
    return committed[0] if isinstance(committed, tuple) else None


# --------------------------------------------------------------------------------------------------- normalisation
_VULGAR_FRACTIONS = {
    "\u00bd": (1, 2), "\u2153": (1, 3), "\u2154": (2, 3), "\u00bc": (1, 4), "\u00be": (3, 4), "\u2155": (1, 5),
    "\u2156": (2, 5), "\u2157": (3, 5), "\u2158": (4, 5), "\u2159": (1, 6), "\u215a": (5, 6), "\u2150": (1, 7),
    "\u215b": (1, 8), "\u215c": (3, 8), "\u215d": (5, 8), "\u215e": (7, 8), "\u2151": (1, 9), "\u2152": (1, 10),
    "\u2189": (0, 3),
}  # fmt: skip
_SYMBOLS = str.maketrans(
    {
        **dict.fromkeys("\u2212\u2012\ufe63\uff0d\u2796", "-"),  # minus signs
        **dict.fromkeys("\u00a0\u2002\u2003\u2005\u2006\u2007\u2008\u2009\u200a\u202f\u3000", " "),  # spaces
        **dict.fromkeys("\u200b\u200c\u200d\u2060\ufeff", ""),  # zero-width characters
        "\u00d7": r"\times ", "\u22c5": r"\cdot ", "\u00b7": r"\cdot ", "\u00f7": r"\div ", "\u03c0": r"\pi ",
        "\u221e": r"\infty ", "\u2264": r"\le ", "\u2265": r"\ge ", "\u2260": r"\ne ", "\u00b1": r"\pm ",
        "\u00b0": r"^{\circ}", "\u2044": "/", "\u2215": "/",
    }
)  # fmt: skip
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


# ------------------------------------------------------------------------------------- math-verify (in the workers)
_MATH_DELIMITERS = re.compile(r"\$|\\\(|\\\[")
_MATH_WORDS = re.compile(
    r"\\[A-Za-z]+|\b(?:sqrt|pi|e|sin|cos|tan|cot|sec|csc|arcsin|arccos|arctan|log|ln|exp|lim|max|min|gcd|lcm|mod)\b"
)
_PROSE_WORD = re.compile(r"[A-Za-z]{2,}")


class _QuietTimeoutWarning(logging.Filter):
    """Drops math-verify's "Timeout is disabled" warning: its timeouts are off on purpose, the pool enforces ours."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Timeout is disabled")


@functools.cache
def _math_verify() -> Any:
    """math-verify, imported on first use (in the workers) with its timeout warning filtered."""
    import math_verify

    for name in ("math_verify.parser", "math_verify.grader"):
        logging.getLogger(name).addFilter(_QuietTimeoutWarning())
    return math_verify


def _is_math(parsed: Sequence[Any]) -> bool:
    from sympy import Basic, MatrixBase

    return any(isinstance(item, (Basic, MatrixBase)) for item in parsed)


def _parse_math(text: str, latex_first: bool) -> list[Any]:
    """math-verify's parse of one answer. Off: its signal-based timeout (`parsing_timeout=None`); the pool's holds.

    Text with $...$ is read as LaTeX in it. A box's content, the ground truth, or an answer line that reads as a
    formula (no words other than function names) is parsed whole as LaTeX: plain parse would take "3" out of
    "3\\sqrt{2}". Prose ("12 dollars", "the answer is 4") goes to math-verify's own extraction.
    """
    mv = _math_verify()
    default = [mv.LatexExtractionConfig(), mv.ExprExtractionConfig()]
    attempts: list[tuple[str, list[Any]]] = []
    if _MATH_DELIMITERS.search(text):
        attempts.append((text, [mv.LatexExtractionConfig()]))
    elif latex_first or not _PROSE_WORD.search(_MATH_WORDS.sub(" ", text)):
        attempts.append(("\\boxed{" + text + "}", [mv.LatexExtractionConfig(boxed_match_priority=0)]))
    attempts.append((text, default))
    parsed: list[Any] = []
    for candidate, config in attempts:
        parsed = mv.parse(candidate, extraction_config=config, parsing_timeout=None)
        if _is_math(parsed):
            return parsed
    return parsed


@functools.lru_cache(maxsize=4096)
def _parse_ground_truth(ground_truth: str) -> tuple[Any, ...]:
    return tuple(_parse_math(ground_truth, latex_first=True))


def verify_answer(answer: str, ground_truth: str, boxed: bool = False) -> Verdict:
    """Whether a committed answer equals the ground truth: CORRECT, WRONG or UNPARSEABLE.

    Runs in a scoring worker (it can take unbounded time on a power tower; the caller's deadline kills it). First
    DAPO's normalised string equality (cheap, and it covers text answers), then math-verify's symbolic equivalence
    with its signal-based timeout off (`timeout_seconds=None`).
    """
    answer, ground_truth = normalize_math_text(answer), normalize_math_text(ground_truth)
    normalized = normalize_final_answer(answer)
    if normalized and normalized == normalize_final_answer(ground_truth):
        return Verdict.CORRECT
    predicted = _parse_math(answer, latex_first=boxed)
    if not _is_math(predicted):
        return Verdict.UNPARSEABLE
    gold = list(_parse_ground_truth(ground_truth))
    return Verdict.CORRECT if _math_verify().verify(gold, predicted, timeout_seconds=None) else Verdict.WRONG


# ---------------------------------------------------------------------------------------------- math_verify reward
# Imported by each worker before it reports ready (the fork server has them already), so no call pays for imports.
_WORKER_PRELOAD = ("math_verify", __name__)


def warm_up_worker() -> None:
    """One judgement before a worker reports ready: the first sympy / LaTeX parse of a process costs ~0.1 s."""
    verify_answer("\\frac{1}{2}", "0.5")


def math_verify_pool(num_workers: int | None = None, *, shared: bool = True) -> ScoringPool:
    """A pool set up for `verify_answer`: this process's shared one, or a new one (`shared=False`) to close yourself."""
    if shared:
        return shared_pool(num_workers, preload=_WORKER_PRELOAD, initializer=warm_up_worker)
    return ScoringPool(num_workers, preload=_WORKER_PRELOAD, initializer=warm_up_worker)


@dataclass(frozen=True)
class ScoredResponse:
    """One response's verdict, the committed answer that was judged, and the seconds a worker spent on it."""

    verdict: Verdict
    answer: str | None = None
    seconds: float = 0.0

    @property
    def reward(self) -> float:
        return _reward(self.verdict)


def score_math_verify(
    completions: Sequence[Any],
    solution: Sequence[Any],
    *,
    timeout: float | None = None,
    num_workers: int | None = None,
    pool: ScoringPool | None = None,
) -> list[ScoredResponse]:
    """Score responses with math-verify in worker processes, each under `timeout` seconds (default: 5, or
    $DAPO_SCORING_TIMEOUT); a response past it is WRONG-as-TIMEOUT and its worker replaced.

    The answer is extracted here (linear-time, bounded input); only (answer, truth) pairs go to the workers, and
    identical pairs in the batch (a group often agrees) are judged once. `pool` defaults to this process's shared
    pool of `num_workers` workers (default: the usable CPUs divided among the ranks of this node).
    """
    _check_lengths(completions, solution)
    timeout = default_timeout() if timeout is None else timeout
    scored: list[ScoredResponse | None] = [None] * len(completions)
    calls: list[tuple[str, str, bool]] = []
    owners: dict[tuple[str, str, bool], list[int]] = {}
    for index, (completion, truth) in enumerate(zip(completions, solution, strict=True)):
        text = _read_response(completion)
        committed = Verdict.UNPARSEABLE if text is None else _committed_answer(text)
        if isinstance(committed, Verdict):
            scored[index] = ScoredResponse(committed)
        elif truth is None:
            scored[index] = ScoredResponse(Verdict.WRONG, committed[0])
        else:
            call = (committed[0], str(truth), committed[1])
            if call not in owners:
                owners[call] = []
                calls.append(call)
            owners[call].append(index)
    if calls:
        pool = pool if pool is not None else math_verify_pool(num_workers)
        for call, result in zip(calls, pool.map(verify_answer, calls, timeout), strict=True):
            if result.timed_out:
                verdict = Verdict.TIMEOUT
            elif result.error is not None:
                logger.warning("math-verify scoring raised %s; the response scores as unparseable", result.error)
                verdict = Verdict.UNPARSEABLE
            else:
                verdict = Verdict(result.value)
            for index in owners[call]:
                scored[index] = ScoredResponse(verdict, call[0], result.seconds)
    timeouts = [s.answer for s in scored if s is not None and s.verdict == Verdict.TIMEOUT]
    if timeouts:
        logger.warning(
            "%d response(s) ran past the %.1f s scoring deadline and score %s, e.g. answer %.80r",
            len(timeouts),
            timeout,
            INCORRECT_REWARD,
            timeouts[0],
        )
    return scored  # type: ignore[return-value]  # every slot was filled


def make_math_verify_reward(
    timeout: float | None = None,
    num_workers: int | None = None,
    *,
    name: str = "math_verify_reward",
    pool: ScoringPool | None = None,
) -> Callable[..., list[float]]:
    """A `math_verify_reward` with its own deadline / worker count / pool; `name` names it in TRL's metrics."""

    def reward(
        completions: list, solution: list, log_metric: Callable[[str, float], None] | None = None, **kwargs: Any
    ) -> list[float]:
        scored = score_math_verify(completions, solution, timeout=timeout, num_workers=num_workers, pool=pool)
        _log_counts(log_metric, name, [s.verdict for s in scored], ("timeouts", "unparseable", "no_answer"))
        return [s.reward for s in scored]

    reward.__name__ = reward.__qualname__ = name
    reward.__doc__ = math_verify_reward.__doc__
    return reward


def math_verify_reward(
    completions: list, solution: list, log_metric: Callable[[str, float], None] | None = None, **kwargs: Any
) -> list[float]:
    """+1 when the answer a response commits to (its last box or "Answer:" line) is equivalent to `solution`
    by math-verify (0.5 == 1/2, sqrt(18) == 3*sqrt(2), 1\\,000 == 1000), else -1.

    Each response is judged in a worker process under a deadline (5 s, or $DAPO_SCORING_TIMEOUT) that holds in any
    thread; `make_math_verify_reward` builds one with other settings. Logs `rewards/math_verify_reward/timeouts`,
    `/unparseable` and `/no_answer` per batch through TRL's `log_metric`.
    """
    return _DEFAULT_MATH_VERIFY(completions, solution, log_metric=log_metric, **kwargs)


_DEFAULT_MATH_VERIFY = make_math_verify_reward()

# Rewards selectable by name on the command line (`--reward_funcs math_verify`).
# ------------------------------------------------------------------------------------------------------ tool use
RETOOL_WRONG_CAP = -0.6
RETOOL_BONUS_PER_TOOL_ROUND = 0.1


def tool_turns(completion: Any) -> int:
    """ReTool's (verl's) `num_turns`: the prompt, each assistant message and each round of tool replies.

    A response with no tool call has 2 turns; each tool round adds 2 (the tool's reply and the assistant's next
    message). Parallel calls answered in one round count once, as in verl's agent loop.
    """
    if not isinstance(completion, Sequence) or isinstance(completion, str | bytes | bytearray):
        return 2
    turns, previous_role = 1, None
    for message in completion:
        role = message.get("role") if isinstance(message, Mapping) else None
        if role == "assistant" or (role == "tool" and previous_role != "tool"):
            turns += 1
        previous_role = role
    return max(turns, 2)


def retool_shaped_score(score: float, num_turns: int) -> float:
    """ReTool's rule: a wrong answer (score < 0) that used more tool turns is penalised less, never above -0.6."""
    if score >= 0:
        return score
    return min(RETOOL_WRONG_CAP, score + (num_turns - 2) / 2 * RETOOL_BONUS_PER_TOOL_ROUND)


def make_tool_aware_reward(base: Callable[..., list[float]], name: str) -> Callable[..., list[float]]:
    """Wrap a correctness reward with ReTool's tool-turn rule; the answer is read from the assistant's text only.

    verl scores the decoded response with tool replies in it, so a program that prints "\\boxed{42}" can answer
    for the model; here only what the model itself wrote is scored.
    """

    def reward(completions: list, log_metric: Callable[[str, float], None] | None = None, **kwargs: Any) -> list[float]:
        scores = base(completions=completions, log_metric=log_metric, **kwargs)
        turns = [tool_turns(completion) for completion in completions]
        if log_metric is not None and turns:
            log_metric(f"rewards/{name}/tool_rounds_mean", sum((t - 2) / 2 for t in turns) / len(turns))
        return [
            None if score is None else retool_shaped_score(score, turn)
            for score, turn in zip(scores, turns, strict=True)
        ]

    reward.__name__ = name
    reward.__doc__ = f"{base.__name__} with ReTool's tool-turn rule for wrong answers."
    return reward


retool_reward = make_tool_aware_reward(dapo_boxed_reward, "retool_reward")
retool_math_verify_reward = make_tool_aware_reward(math_verify_reward, "retool_math_verify_reward")

REWARD_FUNCTIONS = {
    "dapo_math": dapo_math_reward,
    "dapo_boxed": dapo_boxed_reward,
    "math_verify": math_verify_reward,
    "retool": retool_reward,
    "retool_math_verify": retool_math_verify_reward,
}
