"""Correctness rewards: DAPO's "Answer:" scorer, its strict-box mode, and math-verify under a hard deadline.

The math-verify tables are grouped by the pitfall classes of the design spec, section 8.
"""

import threading
import time

import pytest

from dapo_trl.cli import resolve_reward_function
from dapo_trl.rewards import (
    CORRECT_REWARD,
    INCORRECT_REWARD,
    REWARD_FUNCTIONS,
    Verdict,
    completion_text,
    dapo_boxed_reward,
    dapo_math_reward,
    extract_boxed_answer,
    extract_committed_answer,
    extract_dapo_answer,
    make_math_verify_reward,
    math_verify_pool,
    math_verify_reward,
    normalize_final_answer,
    normalize_math_text,
    retool_math_verify_reward,
    retool_reward,
    score_math_verify,
    verify_answer,
    verl_default_reward,
    verl_math_verify_reward,
)

TOWER = "\\boxed{2^{2^{2^{2^{2^{100}}}}}}"  # sympy works on it for minutes
SHORT_TIMEOUT = 1.0


def reward_of(correct: bool) -> float:
    return CORRECT_REWARD if correct else INCORRECT_REWARD


class MetricLog:
    """A stand-in for TRL's `log_metric(name, value)` kwarg."""

    def __init__(self) -> None:
        self.values: dict[str, list[float]] = {}

    def __call__(self, name: str, value: float) -> None:
        self.values.setdefault(name, []).append(value)


@pytest.fixture(scope="module")
def pool():
    pool = math_verify_pool(2, shared=False)
    pool.start()
    yield pool
    pool.close()


# ------------------------------------------------------------------------------------------------------ DAPO scorer
@pytest.mark.parametrize(
    "response,truth,correct",
    [
        ("2 + 2 = 4\nAnswer: 4", "4", True),
        ("Answer: 5", "4", False),
        ("Answer: $1{,}000$", "1000", True),
        ("Answer: 1,000", "1000", True),
        ("Answer: \\boxed{42}", "42", True),
        ("answer:   -7 ", "-7", True),
        ("x = 3, so\nAnswer: x = 3", "3", True),
        ("Answer: 3\nwait, no.\nAnswer: 4", "4", True),  # the last answer counts
        ("Answer: 4\nwait, no.\nAnswer: 3", "4", False),
        ("The answer is 4.", "4", False),  # no Answer line
        ("Answer:", "4", False),  # empty Answer line
        ("Answer: 4\nAnswer:", "4", True),  # as DAPO's scorer: a trailing empty Answer line is skipped
        ("Answer: 1,000\r\n", "1000", False),  # as DAPO's scorer: not stripped, so the \r keeps the comma
        ("Answer: 12 dollars", "12", True),
        # Faithful to the paper, so blind to what math_verify fixes:
        ("\\boxed{4}", "4", False),  # boxed only
        ("Answer: 0.5", "\\frac{1}{2}", False),  # an equivalent form
        ("Answer: \\sqrt{18}", "3\\sqrt{2}", False),
    ],
)
def test_dapo_scorer(response, truth, correct):
    assert dapo_math_reward([response], [truth]) == [reward_of(correct)]


def test_only_the_tail_is_read():
    response = "Answer: 4\n" + "x" * 400
    assert extract_dapo_answer(response) is None
    assert dapo_math_reward([response], ["4"]) == [INCORRECT_REWARD]


def test_chat_message_completions():
    completions = [[{"role": "assistant", "content": "Answer: 9"}], [{"role": "assistant", "content": "Answer: 8"}]]
    assert dapo_math_reward(completions, ["9", "9"]) == [CORRECT_REWARD, INCORRECT_REWARD]


def test_length_mismatch_is_an_error():
    for reward in (dapo_math_reward, dapo_boxed_reward, math_verify_reward):
        with pytest.raises(ValueError, match="2 completions but 1 solutions"):
            reward(["a", "b"], ["1"])


def test_normalisation_examples():
    assert normalize_final_answer("\\text{5 inches}") == "5"
    assert normalize_final_answer("$\\frac12$") == "\\frac{1}{2}"
    assert normalize_final_answer("10^{\\circ}") == "10"


def test_dapo_scorers_count_unreadable_responses():
    log = MetricLog()
    completions = [None, "no answer here", "Answer: 4", 3.5]
    assert dapo_math_reward(completions, ["4"] * 4, log_metric=log) == [-1.0, -1.0, 1.0, -1.0]
    assert log.values == {"rewards/dapo_math_reward/unparseable": [2.0], "rewards/dapo_math_reward/no_answer": [1.0]}
    log = MetricLog()
    assert dapo_boxed_reward(["\\boxed{4", "\\boxed{4}", "x"], ["4"] * 3, log_metric=log) == [-1.0, 1.0, -1.0]
    assert log.values == {"rewards/dapo_boxed_reward/unparseable": [1.0], "rewards/dapo_boxed_reward/no_answer": [1.0]}


# ------------------------------------------------------------------------------------------------ strict-box scorer
@pytest.mark.parametrize(
    "response,truth,correct",
    [
        ("so \\boxed{42}.", "42", True),
        ("\\boxed{41}", "42", False),
        ("\\boxed{\\frac12}", "\\frac{1}{2}", True),  # Minerva normalisation
        ("\\boxed{1{,}000}", "1000", True),
        ("\\boxed{3} then \\boxed{4}", "4", True),  # the last box counts
        ("\\boxed{4} then \\boxed{3}", "4", False),
        ("\\boxed{\\boxed{4}}", "4", True),
        ("\\boxed{\\{1,2\\}}", "\\{1,2\\}", True),  # escaped braces do not close the box
        ("\\boxed{\\frac{1}{2}", "\\frac{1}{2}", False),  # never closed: a truncated response
        ("\\boxed{}", "4", False),
        ("Answer: 4", "4", False),  # strict: no box, no credit
        ("\\boxed{4}" + "x" * 400, "4", False),  # outside the tail
        ("\\boxed{0.5}", "\\frac{1}{2}", False),  # string comparison, like DAPO
    ],
)
def test_strict_box_scorer(response, truth, correct):
    assert dapo_boxed_reward([response], [truth]) == [reward_of(correct)]


def test_boxed_extraction():
    assert extract_boxed_answer("\\boxed{ \\frac{1}{2} }") == "\\frac{1}{2}"
    assert extract_boxed_answer("\\fbox{7}") == "7"
    assert extract_boxed_answer("\\boxed{") is None
    assert extract_boxed_answer("no box") is None


# ------------------------------------------------------------------------------------------ the committed answer
@pytest.mark.parametrize(
    "response,answer",
    [
        ("Answer: 4", "4"),
        ("**Final Answer:** $\\frac{3}{4}$.", "$\\frac{3}{4}$"),
        ("\\boxed{3}\nActually no.\nAnswer: 4", "4"),  # plain math-verify takes the box
        ("Answer: 3\nActually no: \\boxed{4}", "4"),
        ("Answer: \\boxed{5}", "5"),
        ("\\boxed{4}\nLet me check the answer: 2 + 2 = 5?", "4"),  # not an Answer line: it does not start one
        ("Answer: $Answer", None),  # the echoed template
        ("\\boxed{4}\nAnswer: $Answer", None),
        ("\\boxed{4}\nAnswer:", None),  # an empty Answer line is the last word
        ("Answer: \\boxed{}", None),
        ("\\boxed{ }", None),
        ("The answer is 4.", None),  # committed to nothing
        ("\\boxed{\\frac{1}{2}", None),  # unclosed
    ],
)
def test_extract_committed_answer(response, answer):
    assert extract_committed_answer(response) == answer


# ---------------------------------------------------------------------------------------------- normalisation
@pytest.mark.parametrize(
    "text,normalized",
    [
        ("1\\,000", "1000"),
        ("1\\;000\\;000", "1000000"),
        ("1{,}000", "1000"),
        ("1\u2009000", "1000"),
        ("3.141\\,592", "3.141592"),
        ("(1,\\;2)", "(1,\\;2)"),  # a spaced pair, not a thousands separator
        ("0.\\overline{3}", "\\frac{1}{3}"),
        ("0.1\\overline{6}", "\\frac{1}{6}"),
        ("-2.\\bar{5}", "-\\frac{23}{9}"),
        ("0.\\overline 9", "1"),
        ("0.\\dot{1}4\\dot{2}", "\\frac{142}{999}"),
        ("\u22123", "-3"),
        ("3\u221a2", "3\\sqrt{2}"),
        ("\u221a(x+1)", "\\sqrt{x+1}"),
        ("\u221b27", "\\sqrt[3]{27}"),
        ("\u00bd", "\\frac{1}{2}"),
        ("2\u00be", "(2+\\frac{3}{4})"),
        ("x\u00b2", "x^{2}"),
        ("3*sqrt(2*(1+1))", "3*\\sqrt{2*(1+1)}"),
        ("pi/2", "\\pi/2"),
        ("\\pi/2", "\\pi/2"),
    ],
)
def test_normalize_math_text(text, normalized):
    assert normalize_math_text(text) == normalized


def test_verify_answer_in_process():
    assert verify_answer("0.5", "\\frac{1}{2}") == Verdict.CORRECT
    assert verify_answer("\\frac{1}{3}", "0.5", boxed=True) == Verdict.WRONG
    assert verify_answer("\\frac{{{}}}{", "4") == Verdict.UNPARSEABLE


# ---------------------------------------------------------------------------------------------- math_verify reward
MATH_VERIFY_TABLE = {
    "the last answer counts": [
        ("\\boxed{3}\nWait, I made an error.\nAnswer: 4", "4", Verdict.CORRECT),
        ("\\boxed{4}\nWait, I made an error.\nAnswer: 3", "4", Verdict.WRONG),
        ("Answer: 3\nHmm, rechecking: \\boxed{4}", "4", Verdict.CORRECT),
        ("Answer: 4\nHmm, rechecking: \\boxed{3}", "4", Verdict.WRONG),
        ("\\boxed{3} or rather \\boxed{4}", "4", Verdict.CORRECT),
        ("\\boxed{4}\nLet me check the answer: 2 + 2 = 5?", "4", Verdict.CORRECT),
    ],
    "templates and empty answers": [
        ("Answer: $Answer", "4", Verdict.NO_ANSWER),
        ("\\boxed{4}\nAnswer: $Answer", "4", Verdict.NO_ANSWER),
        ("\\boxed{4}\nAnswer:", "4", Verdict.NO_ANSWER),
        ("Answer: \\boxed{}", "4", Verdict.NO_ANSWER),
        ("The answer is 4.", "4", Verdict.NO_ANSWER),
    ],
    "thin-space thousands": [
        ("\\boxed{1\\,000}", "1000", Verdict.CORRECT),
        ("Answer: 1\\;000", "1000", Verdict.CORRECT),
        ("\\boxed{1{,}000}", "1000", Verdict.CORRECT),
        ("Answer: 1\u2009000", "1000", Verdict.CORRECT),
        ("Answer: 12\\,345\\,678", "12345678", Verdict.CORRECT),
        ("\\boxed{1\\,000}", "1", Verdict.WRONG),  # plain math-verify reads 1\,000 as 1*0 = 0
    ],
    "repeating decimals": [
        ("\\boxed{0.\\overline{3}}", "\\frac{1}{3}", Verdict.CORRECT),
        ("Answer: 0.1\\overline{6}", "1/6", Verdict.CORRECT),
        ("\\boxed{1.\\overline{142857}}", "8/7", Verdict.CORRECT),
        ("\\boxed{0.\\dot{3}}", "1/3", Verdict.CORRECT),
        ("\\boxed{0.\\overline{3}}", "0.3", Verdict.WRONG),
    ],
    "unicode minus": [
        ("Answer: \u22123", "-3", Verdict.CORRECT),
        ("\\boxed{\u2212\\frac{1}{2}}", "-0.5", Verdict.CORRECT),
        ("Answer: \u22123", "3", Verdict.WRONG),
    ],
    "roots and vulgar fractions": [
        ("\\boxed{3\u221a2}", "\\sqrt{18}", Verdict.CORRECT),
        ("Answer: \u221a(50)", "5\\sqrt{2}", Verdict.CORRECT),
        ("Answer: \u221b27", "3", Verdict.CORRECT),
        ("Answer: 3*sqrt(2)", "\\sqrt{18}", Verdict.CORRECT),
        ("Answer: \u00bd", "0.5", Verdict.CORRECT),
        ("\\boxed{\u00be}", "\\frac{3}{4}", Verdict.CORRECT),
        ("Answer: 2\u00bd", "5/2", Verdict.CORRECT),
        ("Answer: \u2212\u00bd", "-1/2", Verdict.CORRECT),
        ("Answer: 2\u00b3", "8", Verdict.CORRECT),
        ("\\boxed{3\u221a3}", "3\\sqrt{2}", Verdict.WRONG),
    ],
    "symbolic equivalence": [
        ("\\boxed{0.5}", "\\frac{1}{2}", Verdict.CORRECT),
        ("Answer: \\sqrt{18}", "3\\sqrt{2}", Verdict.CORRECT),
        ("Answer: 1,000", "1000", Verdict.CORRECT),
        ("Answer: x = 3", "3", Verdict.CORRECT),
        ("**Final Answer:** $\\dfrac{3}{4}$.", "0.75", Verdict.CORRECT),
        ("Answer: 12 dollars", "12", Verdict.CORRECT),
        ("\\boxed{\\{1, 2\\}}", "\\{2,1\\}", Verdict.CORRECT),
        ("\\boxed{\\pi/2}", "\\frac{\\pi}{2}", Verdict.CORRECT),
        ("\\boxed{x^2 + 2x + 1}", "(x+1)^2", Verdict.CORRECT),
        ("Answer: 42", 42, Verdict.CORRECT),  # an integer column
        ("Answer: 5", "4", Verdict.WRONG),
        ("\\boxed{\\frac{1}{3}}", "0.5", Verdict.WRONG),
        ("Answer: \\frac{{{}}}{", "4", Verdict.UNPARSEABLE),
    ],
}
MATH_VERIFY_CASES = [(cls, *case) for cls, cases in MATH_VERIFY_TABLE.items() for case in cases]


@pytest.fixture(scope="module")
def math_verify_table_results(pool):
    """The whole table scored in one batch, as TRL would call it."""
    completions = [response for _, response, _, _ in MATH_VERIFY_CASES]
    solutions = [truth for _, _, truth, _ in MATH_VERIFY_CASES]
    return score_math_verify(completions, solutions, pool=pool), math_verify_reward(completions, solutions)


@pytest.mark.parametrize("index", range(len(MATH_VERIFY_CASES)), ids=[f"{c[0]}: {c[1]!r}" for c in MATH_VERIFY_CASES])
def test_math_verify_table(math_verify_table_results, index):
    scored, rewards = math_verify_table_results
    _, response, truth, verdict = MATH_VERIFY_CASES[index]
    assert scored[index].verdict == verdict
    assert rewards[index] == reward_of(verdict == Verdict.CORRECT)  # the default reward agrees with the pool's


def test_math_verify_reads_chat_messages(pool):
    reward = make_math_verify_reward(pool=pool)
    completions = [
        [{"role": "assistant", "content": "Answer: 0.5"}],
        [{"role": "assistant", "content": [{"type": "text", "text": "\\boxed{\\frac{1}{2}}"}]}],
        [{"role": "tool", "content": "Answer: 0.5"}],  # not the model's words
    ]
    assert reward(completions, ["1/2"] * 3) == [1.0, 1.0, -1.0]
    assert completion_text(completions[1]) == "\\boxed{\\frac{1}{2}}"


PATHOLOGICAL = [
    (TOWER, "4", Verdict.TIMEOUT),
    ("Answer: 9^{9^{9}}", "4", Verdict.TIMEOUT),
    ("x" * 1_000_000, "4", Verdict.NO_ANSWER),  # 1 MB of garbage
    ("Answer: " + "7" * 50_000, "4", Verdict.UNPARSEABLE),  # no final answer is that long
    ("{" * 300_000 + "\\boxed{" * 1_000, "4", Verdict.UNPARSEABLE),  # unbalanced braces
    ("\\boxed{\\frac{1}{2}", "1/2", Verdict.UNPARSEABLE),  # truncated in the box
    ("\\boxed{\\left(}", "4", Verdict.UNPARSEABLE),
    ("\ud800\nAnswer: \udfff", "4", Verdict.UNPARSEABLE),  # lone surrogates
    (b"\xff\xfe\xfd Answer", "4", Verdict.NO_ANSWER),  # bytes that are not UTF-8
    (None, "4", Verdict.UNPARSEABLE),
    (3.5, "4", Verdict.UNPARSEABLE),
    ([{"role": "assistant", "content": None}], "4", Verdict.NO_ANSWER),
    ("Answer: 4", None, Verdict.WRONG),  # no ground truth
]


def test_pathological_inputs_are_wrong_counted_and_bounded(pool):
    reward = make_math_verify_reward(timeout=SHORT_TIMEOUT, pool=pool)
    log = MetricLog()
    started = time.monotonic()
    rewards = reward([c for c, _, _ in PATHOLOGICAL], [t for _, t, _ in PATHOLOGICAL], log_metric=log)
    elapsed = time.monotonic() - started
    assert rewards == [INCORRECT_REWARD] * len(PATHOLOGICAL)
    # The two towers run side by side on the two workers, each stopped at its deadline.
    assert elapsed < 2 * SHORT_TIMEOUT + 3.0
    counted = [("timeouts", Verdict.TIMEOUT), ("unparseable", Verdict.UNPARSEABLE), ("no_answer", Verdict.NO_ANSWER)]
    assert log.values == {
        f"rewards/math_verify_reward/{name}": [float(sum(v == verdict for _, _, v in PATHOLOGICAL))]
        for name, verdict in counted
    }
    scored = score_math_verify([c for c, _, _ in PATHOLOGICAL], [t for _, t, _ in PATHOLOGICAL], pool=pool, timeout=0.5)
    assert [s.verdict for s in scored] == [v for _, _, v in PATHOLOGICAL]
    # Only the end of a long response is read, where its answer is.
    assert reward(["x" * 1_000_000 + "\nAnswer: 4"], ["4"]) == [CORRECT_REWARD]


def test_the_timeout_holds_off_the_main_thread(pool):
    reward = make_math_verify_reward(timeout=SHORT_TIMEOUT, pool=pool, name="threaded_reward")
    log, box = MetricLog(), []
    thread = threading.Thread(target=lambda: box.append(reward([TOWER, "Answer: 0.5"], ["4", "1/2"], log_metric=log)))
    started = time.monotonic()
    thread.start()
    thread.join(timeout=30)
    assert not thread.is_alive()
    assert time.monotonic() - started < SHORT_TIMEOUT + 3.0
    assert box == [[INCORRECT_REWARD, CORRECT_REWARD]]
    assert log.values["rewards/threaded_reward/timeouts"] == [1.0]


def test_identical_answers_are_judged_once(pool):
    # A group that agrees on a tower costs one deadline, not one per response.
    started = time.monotonic()
    scored = score_math_verify([TOWER] * 8, ["4"] * 8, pool=pool, timeout=SHORT_TIMEOUT)
    assert [s.verdict for s in scored] == [Verdict.TIMEOUT] * 8
    assert time.monotonic() - started < SHORT_TIMEOUT + 3.0


def test_registered_names():
    assert REWARD_FUNCTIONS == {
        "dapo_math": dapo_math_reward,
        "dapo_boxed": dapo_boxed_reward,
        "math_verify": math_verify_reward,
        "retool": retool_reward,
        "retool_math_verify": retool_math_verify_reward,
        "verl_default": verl_default_reward,
        "verl_math_verify": verl_math_verify_reward,
    }
    assert resolve_reward_function("math_verify") is math_verify_reward
    assert make_math_verify_reward(name="mv").__name__ == "mv"
