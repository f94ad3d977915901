"""The `math_verify` scorer: symbolic equivalence with math-verify on the answer a response commits to.

The answer is extracted in the trainer process (linear time, bounded input); each (answer, truth) pair is judged in a
worker of a `KillableProcessPool` under a hard deadline, so no input (a power tower) can stall training.
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..utils.killable_pool import KillableProcessPool, default_timeout, shared_pool
from .answers import (
    INCORRECT_REWARD,
    Verdict,
    check_lengths,
    committed_answer,
    log_verdict_counts,
    normalize_final_answer,
    normalize_math_text,
    read_response,
    verdict_reward,
)

logger = logging.getLogger(__name__)


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
# Imported by each worker before it reports ready (the fork server has them already), so no call pays for imports:
# the math-verify package, and this module (`dapo_trl.rewards.math_verify`), where `verify_answer` is found by name.
_WORKER_PRELOAD = ("math_verify", __name__)


def warm_up_worker() -> None:
    """One judgement before a worker reports ready: the first sympy / LaTeX parse of a process costs ~0.1 s."""
    verify_answer("\\frac{1}{2}", "0.5")


def math_verify_pool(num_workers: int | None = None, *, shared: bool = True) -> KillableProcessPool:
    """A pool set up for `verify_answer`: this process's shared one, or a new one (`shared=False`) to close yourself."""
    if shared:
        return shared_pool(num_workers, preload=_WORKER_PRELOAD, initializer=warm_up_worker)
    return KillableProcessPool(num_workers, preload=_WORKER_PRELOAD, initializer=warm_up_worker)


@dataclass(frozen=True)
class ScoredResponse:
    """One response's verdict, the committed answer that was judged, and the seconds a worker spent on it."""

    verdict: Verdict
    answer: str | None = None
    seconds: float = 0.0

    @property
    def reward(self) -> float:
        return verdict_reward(self.verdict)


def score_math_verify(
    completions: Sequence[Any],
    solution: Sequence[Any],
    *,
    timeout: float | None = None,
    num_workers: int | None = None,
    pool: KillableProcessPool | None = None,
) -> list[ScoredResponse]:
    """Score responses with math-verify in worker processes, each under `timeout` seconds (default: 5, or
    $DAPO_SCORING_TIMEOUT); a response past it is WRONG-as-TIMEOUT and its worker replaced.

    The answer is extracted here (linear-time, bounded input); only (answer, truth) pairs go to the workers, and
    identical pairs in the batch (a group often agrees) are judged once. `pool` defaults to this process's shared
    pool of `num_workers` workers (default: the usable CPUs divided among the ranks of this node).
    """
    check_lengths(completions, solution)
    timeout = default_timeout() if timeout is None else timeout
    scored: list[ScoredResponse | None] = [None] * len(completions)
    calls: list[tuple[str, str, bool]] = []
    owners: dict[tuple[str, str, bool], list[int]] = {}
    for index, (completion, truth) in enumerate(zip(completions, solution, strict=True)):
        text = read_response(completion)
        committed = Verdict.UNPARSEABLE if text is None else committed_answer(text)
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
    pool: KillableProcessPool | None = None,
) -> Callable[..., list[float]]:
    """A `math_verify_reward` with its own deadline / worker count / pool; `name` names it in TRL's metrics."""

    def reward(
        completions: list, solution: list, log_metric: Callable[[str, float], None] | None = None, **kwargs: Any
    ) -> list[float]:
        scored = score_math_verify(completions, solution, timeout=timeout, num_workers=num_workers, pool=pool)
        log_verdict_counts(log_metric, name, [s.verdict for s in scored], ("timeouts", "unparseable", "no_answer"))
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
