"""`verl_default` equals verl's `default_compute_score` (and `verl_math_verify` verl's math-verify scorer) on a
differential corpus whose expected results came from running verl's own code outside this repository
(tests/data/make_verl_default_corpus.py names the commit and the command)."""

import dataclasses
import json
from pathlib import Path

import pytest

from dapo_trl.rewards import REWARD_FUNCTIONS, verl_default_reward, verl_math_verify_reward
from dapo_trl.rewards.verl_code import SandboxUnreachable
from dapo_trl.rewards.verl_default import (
    NOT_HERE,
    UnsupportedDataSource,
    VerlDefaultReward,
    VerlScore,
    scorer_name,
    verl_default_score,
)

from .helpers import StubServer, closed_port, fusion_execute

CORPUS = Path(__file__).resolve().parent / "data" / "verl_default_corpus.jsonl"
CASES = [json.loads(line) for line in CORPUS.read_text(encoding="ascii").splitlines()]
ROUTED = [case for case in CASES if case["scorer"] == "default_compute_score" and "error" not in case]


def expected(case: dict) -> VerlScore:
    return VerlScore(case["score"], case.get("acc"), case.get("pred"))


def test_the_corpus_covers_every_scorer_and_both_verdicts():
    kinds = {case["kind"] for case in CASES}
    assert {"gsm8k", "gsm8k-window", "math", "math-boxes", "dapo", "unknown-source", "math-verify"} <= kinds
    for kind in ("gsm8k", "math", "math-boxes", "dapo", "math-verify"):
        scores = {case["score"] for case in CASES if case["kind"] == kind}
        assert len(scores) == 2, (kind, scores)  # correct and incorrect both present
    assert len(CASES) > 3000 and CORPUS.stat().st_size < 1_000_000


def test_every_routed_case_scores_as_verl():
    mismatches = []
    for index, case in enumerate(ROUTED):
        ours = verl_default_score(case["data_source"], case["response"], case["ground_truth"])
        if ours != expected(case):
            mismatches.append((index, case["kind"], case["response"][-60:], case["ground_truth"], ours, expected(case)))
    assert not mismatches, f"{len(mismatches)} of {len(ROUTED)} differ, e.g. {mismatches[:5]}"


def test_the_batched_reward_agrees_with_the_corpus():
    rewards = verl_default_reward(
        completions=[[{"role": "assistant", "content": case["response"]}] for case in ROUTED],
        solution=[case["ground_truth"] for case in ROUTED],
        data_source=[case["data_source"] for case in ROUTED],
    )
    assert rewards == [case["score"] for case in ROUTED]


def test_sources_verl_does_not_score_are_refused_by_both():
    unknown = [case for case in CASES if case["kind"] == "unknown-source"]
    assert unknown and all(case["error"] == "NotImplementedError" for case in unknown)
    for case in unknown:
        with pytest.raises(UnsupportedDataSource, match="--reward_funcs my_reward.py:compute_score"):
            verl_default_score(case["data_source"], case["response"], case["ground_truth"])


def test_math_verify_cases_score_as_verls_math_verify():
    cases = [case for case in CASES if case["scorer"] == "math_verify"]
    rewards = verl_math_verify_reward(
        completions=[case["response"] for case in cases],
        solution=[case["ground_truth"] for case in cases],
        data_source=[case["data_source"] for case in cases],
    )
    assert rewards == [case["score"] for case in cases]


def test_the_issue_examples():
    """A GSM8K row: `#### 72` scores 1 and a wrong answer 0; a MATH and a DAPO-Math row each get their own scorer."""
    completions = ["so 48 + 24 = 72\n#### 72", "#### 71", "\\boxed{\\frac12}", "Answer: \\frac{1}{2}", "Answer: 3"]
    rewards = verl_default_reward(
        completions=completions,
        solution=["72", "72", "\\frac{1}{2}", "\\frac{1}{2}", "3"],
        data_source=["openai/gsm8k", "openai/gsm8k", "lighteval/MATH", "lighteval/MATH", "math_dapo"],
    )
    assert rewards == [1.0, 0.0, 1.0, 0.0, 1.0]  # the MATH scorer reads the box, not "Answer:"
    assert verl_default_reward(completions=["Answer: 4"], solution=["3"], data_source=["aime2025"]) == [-1.0]


def test_accuracy_is_each_scorers_own_and_is_logged_per_source():
    logged = {}
    verl_default_reward(
        completions=["#### 72", "#### 7", "Answer: 5", "Answer: 6"],
        solution=["72", "72", "5", "5"],
        data_source=["openai/gsm8k", "openai/gsm8k", "math_dapo", "math_dapo"],
        log_metric=lambda name, value: logged.__setitem__(name, value),
    )
    assert logged == {"rewards/verl_default/acc/math_dapo": 0.5, "rewards/verl_default/acc/openai/gsm8k": 0.5}
    assert VerlScore(-1.0, False, "6").correct is False and VerlScore(0.0).correct is False
    assert VerlScore(1.0).correct and VerlScore(1.0, True, "5").correct


def test_unsupported_sources_are_named_with_verls_scorer_and_the_fix():
    with pytest.raises(UnsupportedDataSource) as raised:
        verl_default_reward(
            completions=["a", "b", "c"], solution=["1", "1", "1"], data_source=["numina_olympiads", "apps", "mine"]
        )
    message = str(raised.value)
    assert "'numina_olympiads' (verl's prime_math)" in message and "'apps' (verl's sandbox_fusion" in message
    assert "'mine'" in message and "verl.utils.reward_score:default_compute_score" in message
    assert raised.value.sources == ["numina_olympiads", "apps", "mine"]
    assert all(scorer_name(source) is None for source in NOT_HERE)


def test_a_dataset_without_data_source_is_refused_naming_the_column():
    with pytest.raises(ValueError, match="'data_source' column"):
        verl_default_reward(completions=["#### 1"], solution=["1"])


def test_registered_by_name():
    assert REWARD_FUNCTIONS["verl_default"] is verl_default_reward
    assert REWARD_FUNCTIONS["verl_math_verify"] is verl_math_verify_reward
    with pytest.raises(ValueError, match="math_sets"):
        VerlDefaultReward(math_sets="prime")


def test_datasets_are_checked_before_training():
    from datasets import Dataset

    from dapo_trl.rewards.verl_default import check_dataset_sources

    good = Dataset.from_list(
        [{"solution": "1", "data_source": "openai/gsm8k"}, {"solution": "2", "data_source": "math"}]
    )
    bad = Dataset.from_list([{"solution": "1", "data_source": "taco"}, {"solution": "2", "data_source": "math"}])
    check_dataset_sources([verl_default_reward], good, {"aime": good}, None)
    check_dataset_sources([lambda **kw: []], bad)  # only verl_default reads data_source
    with pytest.raises(UnsupportedDataSource, match="'taco'"):
        check_dataset_sources([verl_default_reward], good, {"eval": bad})
    with pytest.raises(ValueError, match="'data_source' column"):
        check_dataset_sources([verl_default_reward], Dataset.from_list([{"solution": "1"}]))


# ------------------------------------------------------------------------------------------------ code on SandboxFusion
CODE_CASES = [json.loads(line) for line in (CORPUS.parent / "verl_code_corpus.jsonl").read_text("ascii").splitlines()]


def test_code_sources_score_as_verls_sandbox_fusion_scorer():
    """The corpus' scores came from verl's scorer against this same SandboxFusion stand-in."""
    assert len(CODE_CASES) >= 40 and len({case["score"] for case in CODE_CASES}) >= 4  # 0, 1/3, 1/2, 2/3, 1
    with StubServer(fusion_execute) as server:
        reward = VerlDefaultReward(sandbox_url=server.base_url)
        logged = {}
        rewards = reward(
            completions=[[{"role": "assistant", "content": case["response"]}] for case in CODE_CASES],
            solution=[case["ground_truth"] for case in CODE_CASES],
            data_source=[case["data_source"] for case in CODE_CASES],
            log_metric=lambda name, value: logged.__setitem__(name, value),
        )
        stdins = [request["body"]["stdin"] for request in server.requests]
    assert rewards == pytest.approx([case["score"] for case in CODE_CASES], abs=1e-12)
    assert logged["rewards/verl_default/sandbox_errors"] == 0 and "rewards/verl_default/acc/apps" in logged
    assert "9\n" in stdins and "10\n" not in stdins  # of the 12-case rows only the first 10 run: they alone count


def test_code_sources_need_a_sandbox_and_a_dead_one_stops_the_run():
    with pytest.raises(UnsupportedDataSource, match="give --sandbox_url to score them here"):
        verl_default_reward(completions=["```python\nprint(1)\n```"], solution=["{}"], data_source=["taco"])
    reward = VerlDefaultReward(sandbox_url=f"http://127.0.0.1:{closed_port()}")
    truth = json.dumps({"inputs": ["1"], "outputs": ["1"]})
    with pytest.raises(SandboxUnreachable, match="answered none of 1 requests.*--sandbox_url"):
        reward(completions=["```python\nprint(1)\n```"], solution=[truth], data_source=["apps"])
    with pytest.raises(ValueError, match="sandbox_url='ftp://x'"):
        VerlDefaultReward(sandbox_url="ftp://x")


def test_an_overloaded_sandbox_is_retried():
    replies = iter([504])

    def behaviour(index, body):
        status = next(replies, None)
        return (status, {"detail": "busy"}, {}, 0.0) if status else fusion_execute(index, body)

    with StubServer(behaviour) as server:
        reward = VerlDefaultReward(sandbox_url=server.base_url)
        reward.sandbox.http.policy = dataclasses.replace(reward.sandbox.http.policy, backoff_s=0.0)
        truth = json.dumps({"inputs": ["1"], "outputs": ["1"]})
        assert reward(completions=["```python\nprint(input())\n```"], solution=[truth], data_source=["apps"]) == [1.0]
        assert len(server.requests) == 2


def test_the_command_line_builds_verl_default_with_the_sandbox_url():
    from types import SimpleNamespace

    from dapo_trl.rewards import build_reward

    assert build_reward("verl_default", SimpleNamespace(sandbox_url=None)) is verl_default_reward
    reward = build_reward("verl_default", SimpleNamespace(sandbox_url="http://sandbox:8080"))
    assert reward.sandbox.url == "http://sandbox:8080/run_code" and reward.scorer("taco") == "sandbox_fusion"


def test_validation_counts_a_code_answer_correct_only_when_every_test_passes():
    from dapo_trl.validation import correct_per_prompt, is_correct

    assert correct_per_prompt([1.0, 0.5, 0.0, -1.0], 2, verl_default_reward) == [[True, False], [False, False]]
    assert correct_per_prompt([1.0, 0.5], 2) == [[True, True]]  # a reward without is_correct: reward > 0
    assert not is_correct(verl_default_reward, None) and not is_correct(None, float("nan"))


def test_a_reply_that_is_not_sandbox_fusions_fails_the_case_not_the_run():
    replies = [{"status": "Success", "run_result": "oops"}, ["not", "a", "dict"], {"status": "Success"}]

    with StubServer(lambda index, body: (200, replies[index % 3], {}, 0.0)) as server:
        reward = VerlDefaultReward(sandbox_url=server.base_url)
        truth = json.dumps({"inputs": ["1", "2", "3"], "outputs": ["1", "2", "3"]})
        assert reward(completions=["```python\nprint(input())\n```"], solution=[truth], data_source=["apps"]) == [0.0]
        reward.close()
