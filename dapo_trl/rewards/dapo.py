"""DAPO's own scorers, faithful to the paper: the last "Answer:" line (or `\\boxed{}`) in the last 300 characters,
Minerva normalisation, exact string comparison. Exact for DAPO-Math-17k's integer answers; equivalent forms score -1.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .answers import (
    DAPO_TAIL_CHARS,
    Verdict,
    check_lengths,
    extract_dapo_answer,
    last_boxed,
    log_verdict_counts,
    normalize_final_answer,
    read_response,
    verdict_reward,
)


# ------------------------------------------------------------------------------------------------------ "Answer:"
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
    check_lengths(completions, solution)
    verdicts = [_dapo_verdict(read_response(c), s) for c, s in zip(completions, solution, strict=True)]
    log_verdict_counts(log_metric, "dapo_math_reward", verdicts, ("unparseable", "no_answer"))
    return [verdict_reward(verdict) for verdict in verdicts]


# ------------------------------------------------------------------------------------------------------ strict box
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
    check_lengths(completions, solution)
    verdicts = [_boxed_verdict(read_response(c), s) for c, s in zip(completions, solution, strict=True)]
    log_verdict_counts(log_metric, "dapo_boxed_reward", verdicts, ("unparseable", "no_answer"))
    return [verdict_reward(verdict) for verdict in verdicts]
