"""Validation: unbiased pass@k against brute force, per-source summaries, and the trainer / CLI entry points."""

import itertools
import json
import sys

import pytest
from datasets import Dataset

from dapo_trl import DAPOTrainer
from dapo_trl.builtin_models import build_tiny_model
from dapo_trl.validation import (
    PromptResult,
    ValidationSampling,
    format_table,
    pass_at_k,
    sample_responses,
    score_responses,
    summarize,
)

from .helpers import run_command, tiny_config


def pass_at_k_brute_force(n: int, c: int, k: int) -> float:
    """Share of all k-subsets of n samples (c of them correct) that hold at least one correct sample."""
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(samples[i] for i in subset) for subset in subsets) / len(subsets)


@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_pass_at_k_matches_brute_force(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(pass_at_k_brute_force(n, c, k), abs=1e-12)


def test_pass_at_k_rejects_nonsense():
    with pytest.raises(ValueError, match=r"need 0 <= c <= n and 1 <= k <= n, got n=4, c=5, k=1"):
        pass_at_k(4, 5, 1)
    with pytest.raises(ValueError, match=r"need 0 <= c <= n and 1 <= k <= n, got n=4, c=1, k=0"):
        pass_at_k(4, 1, 0)


def result(source: str, correct: list[bool], index: int = 0) -> PromptResult:
    return PromptResult(index, source, "p", "1", ["x"] * len(correct), correct)


def test_summary_per_source_and_overall():
    results = [result("aime", [True, False, False, False]), result("aime", [False] * 4), result("gsm", [True] * 4)]
    metrics = summarize(results)
    assert metrics["aime/avg@4"] == pytest.approx(1 / 8)
    assert metrics["aime/pass@1"] == pytest.approx((0.25 + 0) / 2)
    assert metrics["aime/pass@4"] == pytest.approx(0.5)
    assert metrics["gsm/avg@4"] == 1.0 and metrics["all/avg@4"] == pytest.approx(5 / 12)
    assert metrics["aime/num_prompts"] == 2 and metrics["all/num_prompts"] == 3
    table = format_table(metrics)
    assert "| aime | 2 | 0.1250 |" in table and table.splitlines()[0].startswith("| source | prompts | avg@4 | pass@1")
    with pytest.raises(ValueError, match="same number of samples"):
        summarize([result("a", [True]), result("a", [True, False])])


def test_score_responses_calls_the_reward_like_trl():
    seen = {}

    def reward(prompts, completions, solution, data_source, **kwargs):
        seen.update(completions=completions, solution=solution, data_source=data_source)
        return [1.0 if c[0]["content"] == s else -1.0 for c, s in zip(completions, solution, strict=True)]

    rows = [{"prompt": [{"role": "user", "content": "q"}], "solution": "7", "data_source": "d"}]
    assert score_responses(reward, rows, [["7", "8"]]) == [[True, False]]
    assert seen["solution"] == ["7", "7"] and seen["completions"][1] == [{"role": "assistant", "content": "8"}]


@pytest.mark.parametrize(
    "backend,message", [("transformers", "needs a model"), ("vllm", "needs a model_path"), ("tgi", "unknown")]
)
def test_sample_responses_checks_its_backend(backend, message):
    settings = ValidationSampling(num_samples=1, temperature=1.0, top_p=1.0, max_new_tokens=1)
    with pytest.raises(ValueError, match=message):
        sample_responses(["What is 1 + 1?"], settings, backend=backend, tokenizer=None)


def source_reward(completions, data_source, **kwargs):
    """Correct for every 'easy' response, wrong for every 'hard' one: known avg@n and pass@k."""
    return [1.0 if source == "easy" else -1.0 for source in data_source]


@pytest.mark.e2e
def test_trainer_validation_and_val_before_train(tmp_path):
    rows = [
        {"prompt": [{"role": "user", "content": f"q{i}"}], "solution": "1", "data_source": kind}
        for i, kind in enumerate(["easy", "hard", "easy"])
    ]
    config = tiny_config(
        tmp_path, eval_num_samples=3, eval_max_new_tokens=6, per_device_eval_batch_size=2, val_before_train=True
    )
    trainer = DAPOTrainer(
        model=str(build_tiny_model(tmp_path / "tiny")),
        reward_funcs=source_reward,
        args=config,
        train_dataset=Dataset.from_list(rows * 4),
        eval_dataset=Dataset.from_list(rows),
    )
    trainer.train()
    before = next(entry for entry in trainer.state.log_history if "eval_all/avg@3" in entry)
    assert before["step"] == 0
    assert "eval_loss" in before and "eval_rewards/source_reward/mean" in before  # TRL's, in the same log entry
    assert before["eval_easy/avg@3"] == 1.0 and before["eval_easy/pass@3"] == 1.0
    assert before["eval_hard/avg@3"] == 0.0 and before["eval_all/avg@3"] == pytest.approx(2 / 3)
    samples = [json.loads(line) for line in (tmp_path / "eval_samples" / "step_000000.jsonl").read_text().splitlines()]
    assert len(samples) == 3 and all(len(s["completions"]) == 3 for s in samples)
    metrics = trainer.evaluate()
    assert metrics["eval_hard/pass@1"] == 0.0


@pytest.mark.e2e
def test_standalone_evaluate_command(tmp_path):
    output = tmp_path / "metrics.json"
    result = run_command(
        [
            sys.executable,
            "-m",
            "dapo_trl.evaluate",
            "--model",
            "builtin:tiny",
            "--dataset",
            "builtin:arithmetic",
            "--max_prompts",
            "3",
            "--num_samples",
            "2",
            "--max_new_tokens",
            "8",
            "--backend",
            "transformers",
            "--output",
            str(output),
        ]
    )
    assert "| arithmetic | 3 |" in result.stdout
    saved = json.loads(output.read_text())
    assert saved["metrics"]["arithmetic/num_prompts"] == 3 and "arithmetic/pass@2" in saved["metrics"]
    assert len((tmp_path / "metrics.json.samples.jsonl").read_text().splitlines()) == 3
