"""`dapo_math` equals DAPO's published scorer (verl's `math_dapo.compute_score`) on a differential corpus.

The expected score / acc / pred of every case were produced by running verl's own math_dapo.py outside this
repository (see tests/data/make_dapo_math_corpus.py for the commit and the command).
"""

import json
from pathlib import Path

import pytest

from dapo_trl.rewards import Verdict, dapo_math_reward
from dapo_trl.rewards.dapo import DapoScore, _dapo_verdict, dapo_math_score

CORPUS = Path(__file__).resolve().parent / "data" / "dapo_math_corpus.jsonl"
CASES = [json.loads(line) for line in CORPUS.read_text(encoding="ascii").splitlines()]


def test_the_corpus_covers_every_kind_of_case():
    kinds = {case["kind"] for case in CASES}
    assert len(CASES) >= 1_000 and CORPUS.stat().st_size < 1_000_000
    assert {"whitespace-tail", "repeated-lines", "window", "boxed-only", "normalisation", "unicode", "long"} <= kinds
    assert 0.1 < sum(case["acc"] for case in CASES) / len(CASES) < 0.9  # both verdicts are well represented


def test_every_corpus_case_scores_as_the_reference():
    mismatches = []
    for index, case in enumerate(CASES):
        expected = DapoScore(case["score"], case["acc"], case["pred"])
        ours = dapo_math_score(case["response"], case["ground_truth"])
        if ours != expected:
            mismatches.append((index, case["kind"], case["response"][-80:], case["ground_truth"], ours, expected))
    assert not mismatches, f"{len(mismatches)} of {len(CASES)} differ, e.g. {mismatches[:5]}"


def test_the_batched_reward_agrees_with_the_corpus():
    rewards = dapo_math_reward([case["response"] for case in CASES], [case["ground_truth"] for case in CASES])
    assert rewards == [case["score"] for case in CASES]


@pytest.mark.parametrize(
    "response,truth,expected",
    [
        # A trailing empty "Answer:" line is skipped: the previous answer counts.
        ("Answer: 3\nAnswer:", "3", DapoScore(1.0, True, "3")),
        ("Answer: 3\nAnswer:\n\n", "3", DapoScore(1.0, True, "3")),
        ("Answer: 3\nAnswer: ", "3", DapoScore(-1.0, False, "")),  # a space follows: the empty line counts
        ("Answer:\n4", "4", DapoScore(1.0, True, "4")),  # `\s*` crosses the line break
        # The answer is not stripped before normalising: a trailing \r, tab or no-break space keeps "1,000" unmerged.
        ("Answer: 1,000\r\n", "1000", DapoScore(-1.0, False, "1,000")),
        ("Answer: 1,000\t", "1000", DapoScore(-1.0, False, "1,000")),
        ("Answer: 1,000\xa0", "1000", DapoScore(-1.0, False, "1,000")),
        ("Answer: 1,000\n", "1000", DapoScore(1.0, True, "1000")),
        ("Answer: 5\\ ", "5", DapoScore(1.0, True, "5")),  # "\ " is removed only while the space is still there
        # No answer line is compared as the text "[INVALID]".
        ("no answer", "4", DapoScore(-1.0, False, "[INVALID]")),
    ],
)
def test_corner_cases(response, truth, expected):
    assert dapo_math_score(response, truth) == expected


def test_verdicts_count_blank_answers_as_no_answer():
    assert _dapo_verdict("Answer: ", "4") == Verdict.NO_ANSWER
    assert _dapo_verdict("Answer: 3\nAnswer:", "4") == Verdict.WRONG  # the earlier line is the answer
    assert _dapo_verdict("Answer: 3\nAnswer:", "3") == Verdict.CORRECT
    assert _dapo_verdict("nothing", "4") == Verdict.NO_ANSWER
