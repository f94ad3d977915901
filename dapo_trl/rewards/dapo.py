"""DAPO's own scorers. `dapo_math` equals DAPO's published scorer (verl's `math_dapo.compute_score`, checked on a
differential corpus, tests/data/dapo_math_corpus.jsonl): the last "Answer:" line in the last 300 characters, Minerva
normalisation, exact string comparison. Exact for DAPO-Math-17k's integer answers; equivalent forms score -1.
`dapo_boxed` reads the last `\\boxed{}` instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from .answers import (
    CORRECT_REWARD,
    DAPO_TAIL_CHARS,
    INCORRECT_REWARD,
    Verdict,
    check_lengths,
    extract_dapo_answer,
    last_boxed,
    log_verdict_counts,
    normalize_final_answer,
    read_response,
    verdict_reward,
)

# The prediction DAPO's scorer normalises and compares when a response has no "Answer:" line.
NO_ANSWER_PREDICTION = "[INVALID]"


# ------------------------------------------------------------------------------------------------------ "Answer:"
class DapoScore(NamedTuple):
    """One response's result, field for field the dict DAPO's published `compute_score` returns."""

    score: float  # +1 / -1
    acc: bool
    pred: str  # the normalised prediction


def _score_answer(answer: str | None, ground_truth: Any) -> DapoScore:
    pred = normalize_final_answer(NO_ANSWER_PREDICTION if answer is None else answer)
    acc = pred == normalize_final_answer(str(ground_truth))
    return DapoScore(CORRECT_REWARD if acc else INCORRECT_REWARD, acc, pred)


def dapo_math_score(response: str, ground_truth: Any) -> DapoScore:
    """DAPO's published scorer on one response: `compute_score(response, ground_truth)` of verl's `math_dapo`.

    The last "Answer:" line of the last DAPO_TAIL_CHARS characters (`extract_dapo_answer`, unstripped), Minerva
    normalisation, string equality with the normalised ground truth. Faithful in its corners too: a response without
    an "Answer:" line is compared as the text "[INVALID]", and an empty normalised answer equals an empty ground truth.
    """
    return _score_answer(extract_dapo_answer(response), ground_truth)


def dapo_answer_is_correct(response: str, ground_truth: str) -> bool:
    """DAPO's rule: the normalised last "Answer:" line equals the normalised ground truth."""
    return dapo_math_score(response, ground_truth).acc


def _dapo_verdict(response: str | None, ground_truth: Any) -> Verdict:
    if response is None:
        return Verdict.UNPARSEABLE
    answer = extract_dapo_answer(response)
    if _score_answer(answer, ground_truth).acc:
        return Verdict.CORRECT
    return Verdict.NO_ANSWER if answer is None or not answer.strip() else Verdict.WRONG


def dapo_math_reward(
    completions: list, solution: list, log_metric: Callable[[str, float], None] | None = None, **kwargs: Any
) -> list[float]:
    """DAPO's correctness reward (`dapo_math_score`): +1 when the last "Answer:" line matches `solution`, else -1."""
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
