"""verl's rewards by data source: the scorer verl's `default_compute_score` picks for each row's `data_source`.

verl scores each response with the scorer of its row's data source (`verl/utils/reward_score/__init__.py`). A run
translated from verl therefore needs the same choice per row, not one scorer for the whole run: DAPO's "Answer:"
scorer gives a GSM8K-format response (`#### 72`) -1 whatever it says. This module makes that choice, and each scorer
equals verl's own, score for score (differential corpus: tests/data/verl_default_corpus.jsonl):

- `openai/gsm8k`: GSM8K's `#### N` (`gsm8k_score`), 1 / 0;
- `lighteval/MATH`, `DigitalLearningGmbH/MATH-lighteval`, `HuggingFaceH4/MATH-500`: Hendrycks' MATH
  (`hendrycks_math_score`: the last box, MATH string normalisation), 1 / 0;
- `math_dapo`, `math`, `math_dapo_reasoning`, `aime*`: DAPO's `Answer:` (`dapo_math_score`), +1 / -1;
- `codecontests`, `apps`, `codeforces`, `taco` with a sandbox URL: verl's SandboxFusion scorer (`verl_code`), the
  pass rate of the first 10 test cases.

`verl_math_verify` scores the MATH sets with verl's math-verify scorer instead (`math_verify_score`, the override
verl's `default_compute_score` recommends for them), in a worker process under a deadline. Any other data source
(code without a sandbox URL, PRIME's numina sets, geometry3k, search-R1) stops the run with an error naming it and
the way to pass your own `compute_score`. Correct means the scorer's own notion: `acc` for DAPO's, a full score for
the others. DAPO's, GSM8K's and MATH's give correct responses one value and all others another, so dynamic
sampling's spread of the raw reward is the spread of that accuracy; a code row's pass rate is its own graded reward.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from ..utils.killable_pool import KillableProcessPool, default_timeout, shared_pool
from .answers import completion_text
from .dapo import dapo_math_score

GSM8K_SOURCES = ("openai/gsm8k",)
MATH_SOURCES = ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500")
DAPO_SOURCES = ("math_dapo", "math", "math_dapo_reasoning")  # and every source starting with "aime"
CODE_SOURCES = ("codecontests", "apps", "codeforces", "taco")  # scored on a SandboxFusion service (`verl_code`)
# Sources verl scores with scorers this package does not have (verl's scorer module in parentheses).
NOT_HERE = {
    **dict.fromkeys(
        (
            "numina_aops_forum",
            "numina_synthetic_math",
            "numina_amc_aime",
            "numina_synthetic_amc",
            "numina_cn_k12",
            "numina_olympiads",
        ),
        "prime_math",
    ),
    **dict.fromkeys(CODE_SOURCES, "sandbox_fusion / prime_code: give --sandbox_url to score them here"),
    "hiyouga/geometry3k": "geo3k",
    **dict.fromkeys(
        (
            "searchR1_nq",
            "searchR1_triviaqa",
            "searchR1_popqa",
            "searchR1_hotpotqa",
            "searchR1_2wikimultihopqa",
            "searchR1_musique",
            "searchR1_bamboogle",
        ),
        "search_r1_like_qa_em",
    ),
}
SOLUTION_TAIL_CHARS = 300  # verl's GSM8K scorer reads the last 300 characters


class VerlScore(NamedTuple):
    """One response's result as verl returns it: the score, and `acc` / `pred` where verl's scorer returns them."""

    score: float
    acc: bool | None = None
    pred: str | None = None

    @property
    def correct(self) -> bool:
        """The scorer's own notion of correct: `acc` where it has one, else a full score (all test cases of a code
        row pass)."""
        return bool(self.acc) if self.acc is not None else self.score >= 1.0


class UnsupportedDataSource(ValueError):
    """Rows whose `data_source` has no scorer here; the message names them and the ways on."""

    def __init__(self, sources: Sequence[Any]) -> None:
        described = ", ".join(
            f"{source!r} (verl's {NOT_HERE[source]})" if source in NOT_HERE else repr(source) for source in sources
        )
        super().__init__(
            f"reward verl_default has no scorer for data_source {described}. It scores {', '.join(supported_sources())}"
            " as verl's default_compute_score does. For other sources pass your own verl-style reward, "
            "--reward_funcs my_reward.py:compute_score with compute_score(data_source, solution_str, ground_truth, "
            "extra_info) (verl's own: --reward_funcs verl.utils.reward_score:default_compute_score, with verl "
            "installed), or fix the dataset's data_source column."
        )
        self.sources = list(sources)


def supported_sources() -> list[str]:
    return [*GSM8K_SOURCES, *MATH_SOURCES, *DAPO_SOURCES, "aime*"]


# ------------------------------------------------------------------------------------------------------------ GSM8K
_GSM8K_ANSWER = re.compile(r"#### (-?[0-9.,]+)")


def gsm8k_score(solution_str: str, ground_truth: Any, format_score: float = 0.0, score: float = 1.0) -> float:
    """verl's GSM8K scorer ("strict"): the last `#### N` in the last 300 characters, commas dropped, equal as text.

    `score` when it equals the ground truth, `format_score` when it does not, 0 without a `#### N` line. The ground
    truth is compared as it is (verl's data holds it as text; a number never equals the extracted text).
    """
    matches = _GSM8K_ANSWER.findall(solution_str[-SOLUTION_TAIL_CHARS:])
    if not matches:
        return 0.0
    return float(score if matches[-1].replace(",", "") == ground_truth else format_score)


# ------------------------------------------------------------------------------------------------------------- MATH
def last_boxed_expression(text: str) -> str | None:
    """The last `\\boxed{...}` (or `\\fbox{...}`) with its braces balanced, or `\\boxed X` up to the next `$`.

    As the Hendrycks MATH evaluation reads it: a `\\boxed ` with a space anywhere wins over braces; a box never
    closed gives None.
    """
    if "\\boxed " in text:
        return "\\boxed " + text.split("\\boxed ")[-1].split("$")[0]
    start = text.rfind("\\boxed")
    if start < 0:
        start = text.rfind("\\fbox")
        if start < 0:
            return None
    depth = 0
    for index in range(start, len(text)):
        if text[index] == "{":
            depth += 1
        elif text[index] == "}":
            depth -= 1
            if depth == 0:
                return text[start : index + 1]
    return None


class _NotABox(ValueError):
    """An expression that is not `\\boxed{...}` / `\\boxed X` (an `\\fbox`): the response scores 0."""


def box_content(expression: str) -> str:
    if expression.startswith("\\boxed "):
        return expression[len("\\boxed ") :]
    if "\\boxed " in expression or not expression.startswith("\\boxed{") or not expression.endswith("}"):
        raise _NotABox(expression)
    return expression[len("\\boxed{") : -1]


def _braced_sqrt(text: str) -> str:
    """`\\sqrt3` -> `\\sqrt{3}`: a one-character radicand gets braces. Raises IndexError on a bare trailing `\\sqrt`."""
    pieces = text.split("\\sqrt")
    out = pieces[0]
    for piece in pieces[1:]:
        out += "\\sqrt" + (piece if piece[0] == "{" else "{" + piece[0] + "}" + piece[1:])
    return out


def _braced_fracs(text: str) -> str:
    """`\\frac12` -> `\\frac{1}{2}`, `\\frac1{2}` -> `\\frac{1}{2}`. A fraction with under two characters after it
    leaves the whole text unchanged; a bare trailing `\\frac` raises IndexError."""
    pieces = text.split("\\frac")
    out = pieces[0]
    for piece in pieces[1:]:
        out += "\\frac"
        if piece[0] == "{":
            out += piece
            continue
        if len(piece) < 2:
            return text
        numerator, second, rest = piece[0], piece[1], piece[2:]
        out += "{" + numerator + "}" + ("{" + second + "}" if second != "{" else second) + rest
    return out


def _slash_fraction(text: str) -> str:
    """`3/4` -> `\\frac{3}{4}` when both sides are integers written canonically; anything else unchanged."""
    parts = text.split("/")
    if len(parts) != 2:
        return text
    try:
        numerator, denominator = int(parts[0]), int(parts[1])
    except ValueError:
        return text
    if text != f"{numerator}/{denominator}":
        return text
    return "\\frac{" + str(numerator) + "}{" + str(denominator) + "}"


def normalize_math_answer(text: str) -> str:
    """Hendrycks' MATH string normalisation (lm-evaluation-harness `strip_string`, as verl's MATH scorer uses it).

    Raises (ValueError, IndexError) where that normalisation fails: two `\\text{ ` units, a bare `\\sqrt` or `\\frac`
    at the end. `math_answers_equal` then compares the raw strings, as the reference does.
    """
    for old, new in (
        ("\n", ""),
        ("\\!", ""),
        ("\\\\", "\\"),
        ("tfrac", "frac"),
        ("dfrac", "frac"),
        ("\\left", ""),
        ("\\right", ""),
        ("^{\\circ}", ""),
        ("^\\circ", ""),
        ("\\$", ""),
    ):
        text = text.replace(old, new)
    if "\\text{ " in text:  # units on the right
        before, *after = text.split("\\text{ ")
        if len(after) != 1:
            raise ValueError("more than one '\\text{ ' unit")
        text = before
    for old, new in (("\\\\%", ""), ("\\%", ""), (" .", " 0."), ("{.", "{0.")):
        text = text.replace(old, new)
    if not text:
        return text
    if text[0] == ".":
        text = "0" + text
    sides = text.split("=")
    if len(sides) == 2 and len(sides[0]) <= 2:  # "k = 5" -> " 5"
        text = sides[1]
    if "\\sqrt" in text:
        text = _braced_sqrt(text)
    text = _braced_fracs(text.replace(" ", ""))
    if text == "0.5":
        text = "\\frac{1}{2}"
    return _slash_fraction(text)


def math_answers_equal(answer: str | None, ground_truth: Any) -> bool:
    """Equal after MATH normalisation; the raw strings' equality when the normalisation fails on either."""
    if answer is None or ground_truth is None:
        return answer is None and ground_truth is None
    try:
        return normalize_math_answer(answer) == normalize_math_answer(ground_truth)
    except (ValueError, IndexError, AttributeError, TypeError):
        return answer == ground_truth


def hendrycks_math_score(solution_str: str, ground_truth: Any) -> float:
    """verl's MATH scorer: 1 when the last box's content equals the ground truth after MATH normalisation, else 0."""
    expression = last_boxed_expression(solution_str)
    if expression is None:
        return 0.0
    try:
        return 1.0 if math_answers_equal(box_content(expression), ground_truth) else 0.0
    except _NotABox:
        return 0.0


# ------------------------------------------------------------------------------------------------------ math-verify
def math_verify_score(solution_str: str, ground_truth: str) -> float:
    """verl's math-verify scorer: math-verify's `math_metric` with the ground truth boxed as LaTeX and the response
    read as an expression or LaTeX; 1.0 / 0.0, and 0.0 when math-verify fails. Runs in a scoring worker (see
    `VerlDefaultReward`), whose deadline replaces math-verify's own signal-based one."""
    from math_verify.metric import math_metric
    from math_verify.parser import ExprExtractionConfig, LatexExtractionConfig

    verify = math_metric(
        gold_extraction_target=(LatexExtractionConfig(),),
        pred_extraction_target=(ExprExtractionConfig(), LatexExtractionConfig()),
    )
    try:
        score, _ = verify(["\\boxed{" + ground_truth + "}"], [solution_str])
    except Exception:  # math-verify's failures score 0, as in verl
        return 0.0
    return float(score)


# ----------------------------------------------------------------------------------------------------- the routing
def scorer_name(data_source: Any, math_sets: str = "math_reward", sandbox: bool = False) -> str | None:
    """Which verl scorer module `default_compute_score` applies to `data_source` (None: no scorer here); code
    sources have one only with a sandbox service (`sandbox`)."""
    if not isinstance(data_source, str):
        return None
    if sandbox and data_source in CODE_SOURCES:
        return "sandbox_fusion"
    if data_source in GSM8K_SOURCES:
        return "gsm8k"
    if data_source in MATH_SOURCES:
        return math_sets
    if data_source in DAPO_SOURCES or data_source.startswith("aime"):
        return "math_dapo"
    return None


def verl_default_score(
    data_source: Any, solution_str: str, ground_truth: Any, math_sets: str = "math_reward"
) -> VerlScore:
    """The score verl's `default_compute_score` gives one response (in-process scorers; `math_verify` runs here too).

    Raises `UnsupportedDataSource` for a source without a scorer here.
    """
    scorer = scorer_name(data_source, math_sets)
    if scorer == "gsm8k":
        return VerlScore(gsm8k_score(solution_str, ground_truth))
    if scorer == "math_reward":
        return VerlScore(hendrycks_math_score(solution_str, ground_truth))
    if scorer == "math_verify":
        return VerlScore(math_verify_score(solution_str, str(ground_truth)))
    if scorer == "math_dapo":
        result = dapo_math_score(solution_str, ground_truth)
        return VerlScore(result.score, result.acc, result.pred)
    raise UnsupportedDataSource([data_source])


def _column(values: Sequence[Any] | None, length: int, name: str) -> Sequence[Any]:
    if values is None:
        raise ValueError(
            f"reward verl_default reads each row's {name!r} column and the dataset has none: load it with "
            "dapo_trl.data.load_prompt_dataset (it keeps verl's data_source and reads reward_model.ground_truth "
            "into solution), or add the column"
        )
    if len(values) != length:
        raise ValueError(f"reward verl_default: {len(values)} values of {name!r} for {length} completions")
    return values


class VerlDefaultReward:
    """A TRL reward function scoring each completion with the scorer verl picks for its row's `data_source`.

    Called as TRL calls reward functions (`completions`, `solution`, `data_source`, ... columns). Logs the scorer's
    own accuracy per data source as `rewards/<name>/acc/<data_source>`. `math_sets="math_verify"` scores the MATH
    sets with verl's math-verify scorer, each response in a worker under `timeout` seconds (0 past it).
    `sandbox_url` (a SandboxFusion service, e.g. http://host:8080) scores the code sources.
    """

    def __init__(
        self,
        name: str = "verl_default",
        math_sets: str = "math_reward",
        timeout: float | None = None,
        pool: KillableProcessPool | None = None,
        sandbox_url: str | None = None,
    ) -> None:
        if math_sets not in ("math_reward", "math_verify"):
            raise ValueError(f"math_sets={math_sets!r}: use 'math_reward' (verl's default) or 'math_verify'")
        self.__name__ = name
        self.math_sets = math_sets
        self.timeout = timeout
        self.pool = pool
        self.sandbox: Any = None
        if sandbox_url:
            from ..utils.http import run_code_url  # checks the URL; the HTTP client loads only for code runs
            from .verl_code import SandboxFusionScorer

            self.sandbox = SandboxFusionScorer(run_code_url(sandbox_url))

    @staticmethod
    def is_correct(reward: float) -> bool:
        """Correct as each scorer means it, from the reward alone: DAPO's +1, a full 1 for GSM8K, MATH, math-verify
        and code (every test case passes). What validation's avg@n and pass@k count."""
        return reward >= 1.0

    def close(self) -> None:
        """Close the SandboxFusion client's connections (a no-op without a sandbox)."""
        if self.sandbox is not None:
            self.sandbox.close()

    def scorer(self, data_source: Any) -> str | None:
        """The verl scorer this reward applies to `data_source` (None: no scorer here)."""
        return scorer_name(data_source, self.math_sets, sandbox=self.sandbox is not None)

    def check_sources(self, sources: Iterable[Any]) -> None:
        """Raise UnsupportedDataSource naming every one of `sources` without a scorer here (each once)."""
        missing = [source for source in dict.fromkeys(sources) if self.scorer(source) is None]
        if missing:
            raise UnsupportedDataSource(missing)

    def scores(
        self, completions: Sequence[Any], solution: Sequence[Any], data_source: Sequence[Any] | None
    ) -> list[VerlScore]:
        """Every completion's VerlScore; raises UnsupportedDataSource naming every source without a scorer."""
        sources = _column(data_source, len(completions), "data_source")
        _column(solution, len(completions), "solution")
        self.check_sources(sources)
        texts = [completion_text(completion) for completion in completions]
        results: list[VerlScore | None] = [None] * len(texts)
        batched: dict[str, list[int]] = defaultdict(list)  # scorers that run outside this process, batch at once
        for index, (text, truth, source) in enumerate(zip(texts, solution, sources, strict=True)):
            scorer = self.scorer(source)
            if scorer in ("math_verify", "sandbox_fusion"):
                batched[scorer].append(index)
            else:
                results[index] = verl_default_score(source, text, truth, self.math_sets)
        if batched["math_verify"]:
            pool = self.pool or shared_pool(preload=("math_verify", __name__))
            timeout = default_timeout() if self.timeout is None else self.timeout
            calls = [(texts[i], str(solution[i])) for i in batched["math_verify"]]
            for index, result in zip(batched["math_verify"], pool.map(math_verify_score, calls, timeout), strict=True):
                results[index] = VerlScore(float(result.value) if result.ok else 0.0)  # verl: 0 past the deadline
        if batched["sandbox_fusion"]:
            indices = batched["sandbox_fusion"]
            code_scores = self.sandbox.score([texts[i] for i in indices], [solution[i] for i in indices])
            for index, score in zip(indices, code_scores, strict=True):
                results[index] = VerlScore(score)
        return results  # type: ignore[return-value]  # every slot was filled

    def __call__(
        self,
        completions: list[Any],
        solution: Sequence[Any] | None = None,
        data_source: Sequence[Any] | None = None,
        log_metric: Callable[[str, float], None] | None = None,
        **kwargs: Any,
    ) -> list[float]:
        errors_before = self.sandbox.api_errors if self.sandbox is not None else 0
        scored = self.scores(completions, solution, data_source)  # type: ignore[arg-type]
        if log_metric is not None:
            by_source: Mapping[str, list[bool]] = defaultdict(list)
            for source, score in zip(data_source or [], scored, strict=True):
                by_source[source].append(score.correct)
            for source, marks in sorted(by_source.items()):
                log_metric(f"rewards/{self.__name__}/acc/{source}", sum(marks) / len(marks))
            if self.sandbox is not None:
                log_metric(f"rewards/{self.__name__}/sandbox_errors", self.sandbox.api_errors - errors_before)
        return [score.score for score in scored]


def check_dataset_sources(reward_funcs: Any, *datasets: Any) -> None:
    """Before training: every row a `VerlDefaultReward` will score has a `data_source` it has a scorer for.

    Map-style datasets (and dicts of them) are checked whole, so a run stops at construction, not at the first
    batch that holds such a row; a streamed dataset is checked as it is scored.
    """
    functions = reward_funcs if isinstance(reward_funcs, list | tuple) else [reward_funcs]
    rewards = [f for f in functions if isinstance(f, VerlDefaultReward)]
    if not rewards:
        return
    tables = [t for d in datasets if d is not None for t in (d.values() if isinstance(d, Mapping) else [d])]
    for table in tables:
        if not hasattr(table, "unique"):  # a streamed dataset
            continue
        if "data_source" not in (table.column_names or []):
            _column(None, 0, "data_source")
        for reward in rewards:
            reward.check_sources(table.unique("data_source"))


verl_default_reward = VerlDefaultReward()
verl_math_verify_reward = VerlDefaultReward(name="verl_math_verify", math_sets="math_verify")
