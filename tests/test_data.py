"""Prompt datasets: built-in problems, the presets' hub schemas (as local copies), checks, prompt-length filter."""

import json
import logging

import pytest
from datasets import Dataset

from dapo_trl.builtin_models import build_tiny_model
from dapo_trl.data import (
    DAPO_PROMPT_TEMPLATE,
    STREAM_LOOKAHEAD_ROWS,
    DatasetLoadError,
    MalformedRowError,
    StreamPeek,
    filter_overlong_prompts,
    load_prompt_dataset,
    make_arithmetic_dataset,
    prepare_prompt_dataset,
)
from dapo_trl.rewards import dapo_math_reward

from .helpers import SCRIPTS, python_command, run_command, tiny_config


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


def write_jsonl(path, rows) -> str:
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return str(path)


def test_dapo_math_17k_schema_is_mapped_and_deduplicated(tmp_path, caplog):
    rows = [dapo_math_row("1+1?", "2")] * 5 + [dapo_math_row("2+2?", "4")] * 3
    with caplog.at_level(logging.INFO, logger="dapo_trl.data"):
        dataset = load_prompt_dataset(f"dapo-math-17k:{write_jsonl(tmp_path / 'dapo.jsonl', rows)}")
    assert dataset["solution"] == ["2", "4"] and dataset["data_source"] == ["math_dapo", "math_dapo"]
    assert dataset[0]["prompt"] == rows[0]["prompt"]  # already templated: used as is
    assert "removed 6 duplicated prompts" in caplog.text


def test_aime_presets_read_the_answer_not_the_worked_solution(tmp_path):
    aime24 = [{"ID": "2024-I-1", "Problem": "Find x.", "Solution": "Long worked solution ... 204", "Answer": 204}]
    aime25 = [{"id": 0, "problem": "Find y.", "solution": "worked ... 70", "answer": "70", "url": "u", "year": 2025}]
    d24 = load_prompt_dataset(f"aime2024:{write_jsonl(tmp_path / 'a24.jsonl', aime24)}")
    d25 = load_prompt_dataset(f"aime2025:{write_jsonl(tmp_path / 'a25.jsonl', aime25)}")
    assert (d24[0]["solution"], d24[0]["data_source"]) == ("204", "aime2024")
    assert (d25[0]["solution"], d25[0]["data_source"]) == ("70", "aime2025")
    assert "Find x." in d24[0]["prompt"][0]["content"] and "Answer: $Answer" in d24[0]["prompt"][0]["content"]


def test_gsm8k_final_answer_is_extracted(tmp_path):
    rows = [{"question": "Tom has 3 apples...", "answer": "He has 3+4=7.\n#### 1,007"}]
    dataset = load_prompt_dataset(f"gsm8k:{write_jsonl(tmp_path / 'gsm.jsonl', rows)}")
    assert dataset[0]["solution"] == "1007"


def test_local_table_with_named_columns_and_template(tmp_path):
    path = tmp_path / "mine.csv"
    path.write_text("q,final,notes\nWhat is 3*3?,9,x\n")
    dataset = load_prompt_dataset(str(path), prompt_column="q", answer_column="final", template="none")
    assert dataset[0]["prompt"] == [{"role": "user", "content": "What is 3*3?"}]
    assert (dataset[0]["solution"], dataset[0]["data_source"]) == ("9", "mine")
    custom = load_prompt_dataset(str(path), prompt_column="q", answer_column="final", template="Q: {problem}\nA:")
    assert custom[0]["prompt"][0]["content"] == "Q: What is 3*3?\nA:"
    with pytest.raises(ValueError, match="containing"):
        load_prompt_dataset(str(path), prompt_column="q", answer_column="final", template="no placeholder")


@pytest.mark.parametrize(
    "bad_row,message",
    [
        ({"problem": "b", "answer": ""}, "row 2, column 'answer': missing or empty answer"),
        ({"problem": "", "answer": "1"}, "row 2, column 'problem': empty prompt"),
        ({"problem": "b", "answer": None}, "row 2, column 'answer': missing or empty answer"),
    ],
)
def test_malformed_row_names_row_and_column(bad_row, message):
    dataset = Dataset.from_list([{"problem": "a", "answer": "1"}, bad_row, {"problem": "c", "answer": "3"}])
    with pytest.raises(MalformedRowError, match=message):
        prepare_prompt_dataset(dataset)
    assert len(prepare_prompt_dataset(dataset, skip_malformed=True)) == 2


def test_malformed_chat_messages_are_named():
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": "hi"}], "answer": "1"}] * 2)
    dataset = dataset.add_item({"prompt": [{"role": "user", "content": None}], "answer": "1"})
    with pytest.raises(MalformedRowError, match="row 3, column 'prompt': expected chat messages"):
        prepare_prompt_dataset(dataset)


def test_missing_columns_are_explained():
    with pytest.raises(ValueError, match="--prompt_column"):
        prepare_prompt_dataset(Dataset.from_list([{"text": "x", "answer": "1"}]))
    with pytest.raises(ValueError, match="--answer_column"):
        prepare_prompt_dataset(Dataset.from_list([{"problem": "x", "label": "1"}]), answer_column="final")


def test_unreachable_hub_dataset_gives_one_message(monkeypatch):
    def no_hub(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'no-such/dataset' on the Hub (LocalEntryNotFoundError)\nmore lines")

    monkeypatch.setattr("dapo_trl.data.load_dataset", no_hub)
    with pytest.raises(RuntimeError, match="could not load dataset 'no-such/dataset'.*aime2024:/data"):
        load_prompt_dataset("no-such/dataset")


def test_overlong_prompts_filtered_or_rejected(tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(build_tiny_model(tmp_path / "tiny"))
    short = {"prompt": [{"role": "user", "content": "hi"}], "solution": "1"}
    long = {"prompt": [{"role": "user", "content": "word " * 200}], "solution": "1"}
    dataset = Dataset.from_list([short, long, short])
    assert len(filter_overlong_prompts(dataset, tokenizer, 50)) == 2
    with pytest.raises(ValueError, match="all 2 prompts exceed max_prompt_length=50.*nothing is left to train on"):
        filter_overlong_prompts(Dataset.from_list([long, long]), tokenizer, 50)  # not a run of 0 steps that exits 0
    with pytest.raises(ValueError, match="row 2 with"):  # rows count from 1
        filter_overlong_prompts(dataset, tokenizer, 50, policy="error")
    streamed = dataset.to_iterable_dataset()
    assert [row["prompt"] for row in filter_overlong_prompts(streamed, tokenizer, 50)] == [short["prompt"]] * 2
    with pytest.raises(ValueError, match="streamed prompt has"):
        list(filter_overlong_prompts(streamed, tokenizer, 50, policy="error"))


SHORT = {"prompt": [{"role": "user", "content": "hi"}], "solution": "1"}
LONG = {"prompt": [{"role": "user", "content": "word " * 200}], "solution": "1"}


def test_a_stream_without_a_prompt_that_fits_is_an_error_up_front(tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(build_tiny_model(tmp_path / "tiny"))

    def stream(*rows):
        if not rows:  # a stream that ends at once
            return Dataset.from_list([SHORT]).to_iterable_dataset().filter(lambda row: False)
        return Dataset.from_list(list(rows)).to_iterable_dataset()

    assert STREAM_LOOKAHEAD_ROWS == 1000  # the README documents it
    # the stream ends first: every prompt read is too long
    with pytest.raises(ValueError, match=r"all 2 prompts of the streamed train_dataset exceed max_prompt_length=50 "):
        filter_overlong_prompts(stream(LONG, LONG), tokenizer, 50)  # at the call, not 0 steps once training starts
    # the look-ahead ends first
    late = stream(LONG, LONG, LONG, SHORT)
    with pytest.raises(ValueError, match=r"the first 3 prompts .* all exceed max_prompt_length=50 .*at most 3 rows"):
        filter_overlong_prompts(late, tokenizer, 50, lookahead=3)
    assert [row["prompt"] for row in filter_overlong_prompts(late, tokenizer, 50, lookahead=4)] == [SHORT["prompt"]]
    with pytest.raises(ValueError, match="the streamed train_dataset yielded no rows"):
        filter_overlong_prompts(stream(), tokenizer, 50)
    # policy 'error': an overlong prompt before the first that fits stops the run at the call
    with pytest.raises(ValueError, match=r"a streamed prompt has \d+ tokens > max_prompt_length=50 \(row 1\)"):
        filter_overlong_prompts(stream(LONG, SHORT), tokenizer, 50, policy="error")
    # every process raises, or none: here another process's stream has no prompt that fits
    other = StreamPeek(rows=5, fits=False, ended=True, shortest=99, first_overlong=(0, 120))
    with pytest.raises(ValueError, match=r"all 5 prompts .* \(process 1's stream\) exceed .*the shortest has 99"):
        filter_overlong_prompts(stream(SHORT), tokenizer, 50, gather=lambda peeks: peeks + [other])
    fine = filter_overlong_prompts(stream(SHORT, LONG), tokenizer, 50, gather=lambda peeks: peeks + peeks)
    assert [row["prompt"] for row in fine] == [SHORT["prompt"]]  # the look-ahead stopped at the first row


def test_trainer_stops_on_a_stream_whose_prompts_are_all_too_long(tmp_path):
    from dapo_trl import DAPOTrainer

    config = tiny_config(tmp_path / "out", max_prompt_length=20)
    with pytest.raises(ValueError, match="all 3 prompts of the streamed train_dataset exceed max_prompt_length=20"):
        DAPOTrainer(
            model=str(build_tiny_model(tmp_path / "tiny")),
            args=config,
            train_dataset=Dataset.from_list([LONG] * 3).to_iterable_dataset(),
        )


@pytest.mark.e2e
def test_every_process_decides_the_same_on_a_stream_split_by_process(tmp_path):
    """Process 1's stream has no prompt that fits, process 0's does: both raise the same error, none hangs."""
    run_command(python_command(str(SCRIPTS / "overlong_stream_run.py"), str(tmp_path), "20", num_processes=2))
    outcomes = {(tmp_path / f"rank{rank}.txt").read_text() for rank in (0, 1)}
    assert len(outcomes) == 1 and "all 4 prompts of the streamed train_dataset (process 1's stream)" in outcomes.pop()


def test_a_broken_jsonl_line_is_named_by_file_and_line(tmp_path):
    path = tmp_path / "problems.jsonl"
    good = json.dumps({"problem": "1 + 1?", "answer": "2"})
    path.write_text(f'{good}\n{good}\n\n{{"problem": "2 + 2?", "answer": 4\n{good}\n')
    with pytest.raises(DatasetLoadError, match=r"problems.jsonl', line 4: not valid JSON \(Expecting ',' delimiter"):
        load_prompt_dataset(str(path))
    path.write_text(f"{good}\n[1, 2]\n")
    with pytest.raises(DatasetLoadError, match="line 2: a JSON Lines row must be an object"):
        load_prompt_dataset(str(path))


def test_a_broken_json_document_is_named_by_line_and_other_files_by_their_cause(tmp_path):
    document = tmp_path / "problems.json"
    document.write_text('[\n  {"problem": "1 + 1?", "answer": "2"},\n  {"problem": "2 + 2?" "answer": "4"}\n]\n')
    with pytest.raises(DatasetLoadError, match=r"problems.json', line 3: not valid JSON \(Expecting ','"):
        load_prompt_dataset(str(document))
    table = tmp_path / "problems.parquet"
    table.write_bytes(b"not a parquet file")
    with pytest.raises(DatasetLoadError, match=r"problems.parquet' could not be read: \w+"):
        load_prompt_dataset(str(table))
