"""DAPO's "Answer:" scorer."""

import pytest

from dapo_trl.rewards import (
    CORRECT_REWARD,
    INCORRECT_REWARD,
    dapo_math_reward,
    extract_dapo_answer,
    normalize_final_answer,
)


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
        ("Answer: 12 dollars", "12", True),
    ],
)
def test_dapo_scorer(response, truth, correct):
    expected = CORRECT_REWARD if correct else INCORRECT_REWARD
    assert dapo_math_reward([response], [truth]) == [expected]


def test_only_the_tail_is_read():
    response = "Answer: 4\n" + "x" * 400
    assert extract_dapo_answer(response) is None
    assert dapo_math_reward([response], ["4"]) == [INCORRECT_REWARD]


def test_chat_message_completions():
    completions = [[{"role": "assistant", "content": "Answer: 9"}], [{"role": "assistant", "content": "Answer: 8"}]]
    assert dapo_math_reward(completions, ["9", "9"]) == [CORRECT_REWARD, INCORRECT_REWARD]


def test_length_mismatch_is_an_error():
    with pytest.raises(ValueError, match="2 completions but 1 solutions"):
        dapo_math_reward(["a", "b"], ["1"])


def test_normalisation_examples():
    assert normalize_final_answer("\\text{5 inches}") == "5"
    assert normalize_final_answer("$\\frac12$") == "\\frac{1}{2}"
    assert normalize_final_answer("10^{\\circ}") == "10"
