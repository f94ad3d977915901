"""Math correctness rewards with TRL's reward-function signature, returning DAPO's +1 / -1.

`dapo_math_reward` is DAPO's own scorer (paper, Section 6 of the design spec): read the last "Answer: ..." line
in the tail of the response, normalise it Minerva-style, compare strings. It is exact for DAPO-Math-17k's integer
answers. TRL calls reward functions as `f(prompts=..., completions=..., completion_ids=..., **dataset_columns)`;
the ground truth is the `solution` column.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

CORRECT_REWARD = 1.0
INCORRECT_REWARD = -1.0
# DAPO's scorer only reads the end of a response, where the final answer line must be.
DAPO_TAIL_CHARS = 300

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


def completion_text(completion: str | Sequence[dict[str, Any]]) -> str:
    """The assistant's text of a completion, whether TRL passes a string or a list of chat messages."""
    if isinstance(completion, str):
        return completion
    return "".join(
        message.get("content") or "" for message in completion if message.get("role", "assistant") == "assistant"
    )


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


def dapo_math_reward(completions: list, solution: list, **kwargs: Any) -> list[float]:
    """DAPO's correctness reward: +1 when the last "Answer:" line matches `solution`, else -1."""
    if len(completions) != len(solution):
        raise ValueError(f"got {len(completions)} completions but {len(solution)} solutions")
    return [
        CORRECT_REWARD if dapo_answer_is_correct(completion_text(c), s) else INCORRECT_REWARD
        for c, s in zip(completions, solution, strict=True)
    ]


# Rewards selectable by name on the command line (`--reward_funcs dapo_math`).
REWARD_FUNCTIONS = {"dapo_math": dapo_math_reward}
