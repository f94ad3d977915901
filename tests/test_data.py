"""Prompt datasets: built-in problems, DAPO-Math-17k's hub schema (local copy), checks and prompt-length filter."""

import json

import pytest
from datasets import Dataset

from dapo_trl.data import (
    DAPO_PROMPT_TEMPLATE,
    filter_overlong_prompts,
    load_prompt_dataset,
    make_arithmetic_dataset,
    prepare_prompt_dataset,
)
from dapo_trl.rewards import dapo_math_reward
from dapo_trl.testing import build_tiny_model


def test_arithmetic_answers_are_right():
    dataset = make_arithmetic_dataset(num_problems=50, seed=3)
    for row in dataset:
        question = row["prompt"][0]["content"].split("What is ")[1].split("?")[0]
        assert str(eval(question)) == row["solution"]  # noqa: S307 - our own generated arithmetic
        assert dapo_math_reward([f"Answer: {row['solution']}"], [row["solution"]]) == [1.0]


def dapo_math_row(problem: str, answer: str) -> dict:
    return {
        "data_source": "math_dapo",
        "prompt": [{"role": "user", "content": DAPO_PROMPT_TEMPLATE.format(problem=problem)}],
        "ability": "MATH",
        "reward_model": {"ground_truth": answer, "style": "rule-lighteval/MATH_v2"},
        "extra_info": {"index": problem},
    }


def test_dapo_math_17k_schema_is_mapped_and_deduplicated(tmp_path):
    rows = [dapo_math_row("1+1?", "2")] * 5 + [dapo_math_row("2+2?", "4")] * 3
    path = tmp_path / "dapo.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    dataset = load_prompt_dataset(str(path))
    assert len(dataset) == 2
    assert dataset["solution"] == ["2", "4"]


def test_problem_answer_tables(tmp_path):
    path = tmp_path / "aime.csv"
    path.write_text("Problem,Answer\nWhat is 3*3?,9\n")
    dataset = load_prompt_dataset(str(path))
    assert dataset[0]["solution"] == "9" and "What is 3*3?" in dataset[0]["prompt"][0]["content"]


def test_malformed_row_names_row_and_column():
    dataset = Dataset.from_list([{"problem": "a", "answer": "1"}, {"problem": "b", "answer": ""}])
    with pytest.raises(ValueError, match="row 1: empty or missing solution"):
        prepare_prompt_dataset(dataset)


def test_unknown_schema_is_explained():
    with pytest.raises(ValueError, match="no prompt/answer"):
        prepare_prompt_dataset(Dataset.from_list([{"text": "x"}]))


def test_unreachable_hub_dataset_gives_one_message(monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(RuntimeError, match="could not load dataset 'no-such/dataset'"):
        load_prompt_dataset("no-such/dataset")


def test_overlong_prompts_filtered_or_rejected(tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(build_tiny_model(tmp_path / "tiny"))
    short = {"prompt": [{"role": "user", "content": "hi"}], "solution": "1"}
    long = {"prompt": [{"role": "user", "content": "word " * 200}], "solution": "1"}
    dataset = Dataset.from_list([short, long, short])
    assert len(filter_overlong_prompts(dataset, tokenizer, 50)) == 2
    with pytest.raises(ValueError, match="row 1"):
        filter_overlong_prompts(dataset, tokenizer, 50, policy="error")
