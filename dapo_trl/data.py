"""Training data as TRL prompt rows: a `prompt` (chat messages) and a `solution` (the ground-truth answer).

Sources: the built-in generated arithmetic problems (offline smoke runs and tests), DAPO-Math-17k's hub format
(`prompt` messages + `reward_model.ground_truth`), and plain problem/answer tables from the hub or local files.
"""

from __future__ import annotations

import logging
import os
import random
from typing import Any

from datasets import Dataset, load_dataset

logger = logging.getLogger(__name__)

BUILTIN_ARITHMETIC = "builtin:arithmetic"

DAPO_PROMPT_TEMPLATE = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n{problem}\n\n"
    'Remember to put your answer on its own line after "Answer:".'
)

_PROBLEM_COLUMNS = ("problem", "question", "Problem", "Question")
_ANSWER_COLUMNS = ("solution", "answer", "Answer", "ground_truth")
_LOCAL_FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}


def dapo_prompt(problem: str) -> list[dict[str, str]]:
    """One user turn holding the problem in DAPO's "Answer:" template."""
    return [{"role": "user", "content": DAPO_PROMPT_TEMPLATE.format(problem=problem)}]


def make_arithmetic_dataset(num_problems: int = 256, seed: int = 0, max_operand: int = 20) -> Dataset:
    """Generated integer arithmetic problems with verifiable answers, for offline runs."""
    rng = random.Random(seed)
    rows = []
    for _ in range(num_problems):
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        op = rng.choice("+-*")
        answer = a + b if op == "+" else a - b if op == "-" else a * b
        rows.append({"prompt": dapo_prompt(f"What is {a} {op} {b}?"), "solution": str(answer)})
    return Dataset.from_list(rows)


def _to_prompt_row(row: dict[str, Any]) -> dict[str, Any]:
    """Map one row of a supported schema to {prompt, solution}."""
    if isinstance(row.get("reward_model"), dict) and "ground_truth" in row["reward_model"]:
        solution = row["reward_model"]["ground_truth"]
    else:
        solution = next((row[c] for c in _ANSWER_COLUMNS if row.get(c) is not None), None)
    prompt = row.get("prompt")
    if prompt is None:
        problem = next((row[c] for c in _PROBLEM_COLUMNS if row.get(c)), None)
        prompt = dapo_prompt(str(problem)) if problem is not None else None
    elif isinstance(prompt, str):
        prompt = dapo_prompt(prompt)
    return {"prompt": prompt, "solution": None if solution is None else str(solution)}


def prepare_prompt_dataset(dataset: Dataset, deduplicate: bool = True) -> Dataset:
    """Normalise a dataset to {prompt, solution}, check every row, and drop repeated prompts.

    DAPO-Math-17k's hub copy repeats each problem about 100 times (DAPO repo issues #15, #36): training on it
    as-is over-weights nothing but wastes 99% of an epoch, so duplicates are removed and counted.
    """
    columns = set(dataset.column_names)
    has_answer = "reward_model" in columns or columns & set(_ANSWER_COLUMNS)
    has_prompt = "prompt" in columns or columns & set(_PROBLEM_COLUMNS)
    if not (has_answer and has_prompt):
        raise ValueError(
            f"dataset columns {sorted(columns)} have no prompt/answer: expected 'prompt' or one of "
            f"{_PROBLEM_COLUMNS}, and 'reward_model.ground_truth' or one of {_ANSWER_COLUMNS}."
        )
    rows = []
    seen: set[str] = set()
    for index, raw in enumerate(dataset):
        row = _to_prompt_row(raw)
        if not row["prompt"] or row["solution"] in (None, ""):
            missing = "prompt" if not row["prompt"] else "solution"
            raise ValueError(f"row {index}: empty or missing {missing}; fix or remove that row.")
        key = repr(row["prompt"])
        if deduplicate and key in seen:
            continue
        seen.add(key)
        rows.append(row)
    removed = len(dataset) - len(rows)
    if removed:
        logger.info("removed %d duplicated prompts (%d unique remain)", removed, len(rows))
    return Dataset.from_list(rows)


def load_prompt_dataset(name: str, split: str = "train", config: str | None = None, seed: int = 0) -> Dataset:
    """Load `builtin:arithmetic`, a local json/jsonl/parquet/csv file, or a hub dataset, as prompt rows."""
    if name == BUILTIN_ARITHMETIC:
        return make_arithmetic_dataset(seed=seed)
    extension = os.path.splitext(name)[1].lower()
    if os.path.isfile(name):
        if extension not in _LOCAL_FORMATS:
            raise ValueError(f"dataset file {name!r}: unsupported extension; use one of {sorted(_LOCAL_FORMATS)}.")
        dataset = load_dataset(_LOCAL_FORMATS[extension], data_files=name, split="train")
    else:
        try:
            dataset = load_dataset(name, config, split=split)
        except Exception as error:  # the hub raises many types; the user needs one actionable message
            raise RuntimeError(
                f"could not load dataset {name!r} (split {split!r}): {type(error).__name__}: {error}. "
                f"Without hub access, pass a local .jsonl/.parquet/.csv file or '{BUILTIN_ARITHMETIC}'."
            ) from None
    return prepare_prompt_dataset(dataset)


def filter_overlong_prompts(
    dataset: Dataset,
    tokenizer: Any,
    max_prompt_length: int,
    policy: str = "filter",
    chat_template_kwargs: dict[str, Any] | None = None,
) -> Dataset:
    """Drop (policy 'filter', logged) or reject (policy 'error') prompts longer than max_prompt_length tokens."""
    tokenizer = getattr(tokenizer, "tokenizer", tokenizer)  # processors wrap the tokenizer
    kwargs = chat_template_kwargs or {}

    def prompt_length(row: dict[str, Any]) -> int:
        prompt = row["prompt"]
        if isinstance(prompt, str):
            return len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
        ids = tokenizer.apply_chat_template(prompt, tokenize=True, add_generation_prompt=True, **kwargs)
        return len(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)

    lengths = [prompt_length(row) for row in dataset]
    too_long = [i for i, n in enumerate(lengths) if n > max_prompt_length]
    if not too_long:
        return dataset
    if policy == "error":
        raise ValueError(
            f"{len(too_long)} prompts exceed max_prompt_length={max_prompt_length} tokens (first: row {too_long[0]} "
            f"with {lengths[too_long[0]]}); raise max_prompt_length or use overlong_prompt_policy='filter'."
        )
    logger.warning("filtered %d of %d prompts longer than %d tokens", len(too_long), len(dataset), max_prompt_length)
    keep = sorted(set(range(len(dataset))) - set(too_long))
    return dataset.select(keep)
