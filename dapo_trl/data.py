"""Datasets as TRL prompt rows: `prompt` (chat messages), `solution` (ground-truth answer), `data_source`.

Sources: named presets for DAPO-Math-17k, AIME 2024, AIME 2025 and GSM8K (their hub column names differ; the
presets map them), any hub dataset or local parquet / jsonl / json / csv file with configurable columns, and the
built-in generated arithmetic problems for offline runs.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from datasets import Dataset, IterableDataset, load_dataset

logger = logging.getLogger(__name__)

BUILTIN_ARITHMETIC = "builtin:arithmetic"

DAPO_PROMPT_TEMPLATE = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n{problem}\n\n"
    'Remember to put your answer on its own line after "Answer:".'
)
PROMPT_TEMPLATES = {"dapo": DAPO_PROMPT_TEMPLATE, "none": "{problem}"}
LOCAL_FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}
# Tried in order when no column is named: the first present one wins.
_PROBLEM_COLUMNS = ("prompt", "problem", "question", "Problem", "Question")
_ANSWER_COLUMNS = ("reward_model.ground_truth", "answer", "Answer", "ground_truth", "solution")


def gsm8k_final_answer(answer: str) -> str:
    """GSM8K answers end with '#### 42' after the worked solution."""
    return answer.split("####")[-1].strip().replace(",", "")


@dataclass(frozen=True)
class DatasetPreset:
    """Where a known dataset lives and which of its columns hold the problem and the answer."""

    hub_id: str
    split: str
    problem_column: str
    answer_column: str
    data_source: str
    config: str | None = None
    answer_extractor: Callable[[str], str] | None = None


PRESETS = {
    "dapo-math-17k": DatasetPreset(
        "BytedTsinghua-SIA/DAPO-Math-17k", "train", "prompt", "reward_model.ground_truth", "math_dapo"
    ),
    "aime2024": DatasetPreset("Maxwell-Jia/AIME_2024", "train", "Problem", "Answer", "aime2024"),
    "aime2025": DatasetPreset("yentinglin/aime_2025", "train", "problem", "answer", "aime2025"),
    "gsm8k": DatasetPreset("openai/gsm8k", "test", "question", "answer", "gsm8k", "main", gsm8k_final_answer),
}
_PRESET_BY_HUB_ID = {preset.hub_id.lower(): name for name, preset in PRESETS.items()}


class DatasetLoadError(ValueError):
    """A dataset that cannot be used as named (unreadable, unknown, unsupported file, missing columns, no rows).

    The message is the whole story (what failed and the flag or file to change), so the command line prints it
    without a traceback. Rows and lines in every message count from 1, as an editor shows them.
    """


class DatasetUnavailableError(DatasetLoadError, RuntimeError):
    """The hub or file loader failed; also a RuntimeError, which callers caught before DatasetLoadError existed."""


class MalformedRowError(DatasetLoadError):
    """A dataset row that cannot become a training prompt; the message names the row and the column."""


def make_prompt(problem: str, template: str = "dapo") -> list[dict[str, str]]:
    """One user turn holding the problem in a template: 'dapo' (DAPO's "Answer:" template), 'none', or a
    custom string containing `{problem}`."""
    text = PROMPT_TEMPLATES.get(template, template)
    if "{problem}" not in text:
        raise ValueError(f"prompt template {template!r} must be 'dapo', 'none' or a string containing {{problem}}")
    return [{"role": "user", "content": text.replace("{problem}", problem)}]


def make_arithmetic_dataset(num_problems: int = 256, seed: int = 0, max_operand: int = 20) -> Dataset:
    """Generated integer arithmetic problems with verifiable answers, for offline runs."""
    rng = random.Random(seed)
    rows = []
    for _ in range(num_problems):
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        op = rng.choice("+-*")
        answer = a + b if op == "+" else a - b if op == "-" else a * b
        rows.append(
            {"prompt": make_prompt(f"What is {a} {op} {b}?"), "solution": str(answer), "data_source": "arithmetic"}
        )
    return Dataset.from_list(rows)


def _get_field(row: dict[str, Any], column: str) -> Any:
    """A column value; dotted names reach into nested dicts (DAPO-Math-17k's reward_model.ground_truth)."""
    value: Any = row
    for part in column.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


def _pick_column(columns: set[str], sample: dict[str, Any], candidates: tuple[str, ...]) -> str | None:
    for candidate in candidates:
        if candidate.split(".")[0] in columns and _get_field(sample, candidate) is not None:
            return candidate
    return None


def _check_messages(prompt: Any, index: int, column: str) -> list[dict[str, str]]:
    if not prompt or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in prompt
    ):
        raise MalformedRowError(f"row {index + 1}, column {column!r}: expected chat messages with 'role' and 'content'")
    return [{"role": m["role"], "content": m["content"]} for m in prompt]


def prepare_prompt_dataset(
    dataset: Dataset,
    problem_column: str | None = None,
    answer_column: str | None = None,
    template: str = "dapo",
    data_source: str = "custom",
    answer_extractor: Callable[[str], str] | None = None,
    skip_malformed: bool = False,
    deduplicate: bool = True,
) -> Dataset:
    """Map any table to {prompt, solution, data_source} (and verl's `extra_info` when the table has it), checking
    every row and dropping repeated prompts. A row's own `data_source` wins over the `data_source` argument.

    A problem column holding chat messages (DAPO-Math-17k) is used as is; a string gets the prompt template.
    Malformed rows (missing answer, empty prompt, wrong types) raise naming the row and column, or are skipped
    and counted with `skip_malformed`. DAPO-Math-17k's hub copy repeats each problem about 100 times (DAPO repo
    issues #15, #36), so repeated prompts are dropped and the count is logged.
    """
    columns = set(dataset.column_names)
    sample = dataset[0] if len(dataset) else {}
    problem_column = problem_column or _pick_column(columns, sample, _PROBLEM_COLUMNS)
    answer_column = answer_column or _pick_column(columns, sample, _ANSWER_COLUMNS)
    for role, column in (("problem/prompt", problem_column), ("answer", answer_column)):
        if column is None or column.split(".")[0] not in columns:
            raise DatasetLoadError(
                f"no {role} column {column!r} in dataset columns {sorted(columns)}: name it with "
                f"--{'prompt' if role.startswith('problem') else 'answer'}_column."
            )
    rows, seen = [], set()
    malformed = duplicates = 0
    for index, raw in enumerate(dataset):
        try:
            problem, answer = _get_field(raw, problem_column), _get_field(raw, answer_column)
            if isinstance(problem, str):
                if not problem.strip():
                    raise MalformedRowError(f"row {index + 1}, column {problem_column!r}: empty prompt")
                prompt = make_prompt(problem, template)
            elif isinstance(problem, list):
                prompt = _check_messages(problem, index, problem_column)
            else:
                raise MalformedRowError(
                    f"row {index + 1}, column {problem_column!r}: expected text or chat messages, got "
                    f"{type(problem).__name__}"
                )
            if isinstance(answer, bool) or not isinstance(answer, str | int | float) or not str(answer).strip():
                raise MalformedRowError(
                    f"row {index + 1}, column {answer_column!r}: missing or empty answer ({answer!r})"
                )
            solution = str(answer).strip()
            if answer_extractor is not None:
                solution = answer_extractor(solution)
        except MalformedRowError:
            if not skip_malformed:
                raise
            malformed += 1
            continue
        key = repr(prompt)
        if deduplicate and key in seen:
            duplicates += 1
            continue
        seen.add(key)
        source = raw.get("data_source") if isinstance(raw.get("data_source"), str) else data_source
        row = {"prompt": prompt, "solution": solution, "data_source": source}
        if "extra_info" in columns:  # verl's per-row extras, passed to verl-style rewards as `extra_info`
            row["extra_info"] = raw.get("extra_info")
        rows.append(row)
    if malformed:
        logger.warning("skipped %d malformed rows of %d", malformed, len(dataset))
    if duplicates:
        logger.info("removed %d duplicated prompts (%d unique remain)", duplicates, len(rows))
    if not rows:
        raise DatasetLoadError("no usable rows in the dataset")
    return Dataset.from_list(rows)


def unreadable_file_message(path: str, extension: str, error: BaseException) -> str:
    """Why a local dataset file does not load: for JSON Lines the first line that does not parse, or is not an
    object (lines count from 1), with the parser's words; for a JSON document the line of its error; otherwise the
    loader's underlying cause, in one line."""
    if extension in (".jsonl", ".json"):
        with open(path, encoding="utf-8", errors="replace") as file:
            lines = file.read().splitlines()
        document = "\n".join(lines)
        if extension == ".json" and not _is_json_lines(lines):
            try:
                json.loads(document)
            except json.JSONDecodeError as exc:
                return f"dataset file {path!r}, line {exc.lineno}: not valid JSON ({exc.msg} at column {exc.colno})."
        else:
            for number, line in enumerate(lines, start=1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    return (
                        f"dataset file {path!r}, line {number}: not valid JSON ({exc.msg} at column {exc.colno}): "
                        f"{line[:200]!r}. Fix or remove that line."
                    )
                if not isinstance(row, dict):
                    return (
                        f"dataset file {path!r}, line {number}: a JSON Lines row must be an object of columns, got "
                        f"{type(row).__name__}: {line[:200]!r}."
                    )
    cause = error
    while cause.__cause__ is not None or cause.__context__ is not None:
        cause = cause.__cause__ or cause.__context__
    first_line = (str(cause).splitlines() or [""])[0][:300]
    return f"dataset file {path!r} could not be read: {type(cause).__name__}: {first_line}"


def _is_json_lines(lines: list[str]) -> bool:
    """Whether a .json file is JSON Lines (its first non-empty line is a whole JSON object), as `datasets` reads
    either."""
    first = next((line for line in lines if line.strip()), "")
    try:
        return isinstance(json.loads(first), dict)
    except json.JSONDecodeError:
        return False


def load_prompt_dataset(
    name: str,
    split: str | None = None,
    config: str | None = None,
    prompt_column: str | None = None,
    answer_column: str | None = None,
    template: str = "dapo",
    skip_malformed: bool = False,
    seed: int = 0,
) -> Dataset:
    """Load a preset (dapo-math-17k, aime2024, aime2025, gsm8k), a hub id, a local file or `builtin:arithmetic`.

    Hub ids of the presets get the preset's column mapping; a local file in a preset's hub format can be
    loaded with `name="aime2024:/path/file.parquet"`. `seed` picks which generated problems `builtin:arithmetic`
    is; 0 (the default, whatever the training seed) is the set the built-in model was warm-started on.
    """
    if name == BUILTIN_ARITHMETIC:
        return make_arithmetic_dataset(seed=seed)
    preset_name, _, path = name.partition(":") if name.split(":")[0] in PRESETS else ("", "", name)
    preset_name = preset_name or _PRESET_BY_HUB_ID.get(name.lower(), name if name in PRESETS else "")
    preset = PRESETS.get(preset_name)
    source = path or (preset.hub_id if preset else name)
    if os.path.isfile(source):
        extension = os.path.splitext(source)[1].lower()
        if extension not in LOCAL_FORMATS:
            raise DatasetLoadError(
                f"dataset file {source!r}: unsupported extension; use one of {sorted(LOCAL_FORMATS)}."
            )
        try:
            dataset = load_dataset(LOCAL_FORMATS[extension], data_files=source, split="train")
        except Exception as error:  # datasets wraps the parser's error deep in a DatasetGenerationError
            raise DatasetLoadError(unreadable_file_message(source, extension, error)) from None
    else:
        split = split or (preset.split if preset else "train")
        try:
            dataset = load_dataset(source, config or (preset.config if preset else None), split=split)
        except Exception as error:  # the hub raises many types; the user needs one actionable message
            first_line = str(error).splitlines()[0] if str(error) else ""
            raise DatasetUnavailableError(
                f"could not load dataset {source!r} (split {split!r}): {type(error).__name__}: {first_line}. "
                f"Without hub access, pass a local .jsonl/.parquet/.csv file (e.g. 'aime2024:/data/aime.parquet' "
                f"for a copy in a preset's format) or '{BUILTIN_ARITHMETIC}'."
            ) from None
    return prepare_prompt_dataset(
        dataset,
        problem_column=prompt_column or (preset.problem_column if preset else None),
        answer_column=answer_column or (preset.answer_column if preset else None),
        template=template,
        data_source=preset.data_source if preset else os.path.splitext(os.path.basename(source))[0],
        answer_extractor=preset.answer_extractor if preset else None,
        skip_malformed=skip_malformed,
    )


def prompt_token_length(
    tokenizer: Any,
    prompt: Any,
    chat_template_kwargs: dict[str, Any] | None = None,
    tools: list | None = None,
    chat_template: str | None = None,
) -> int:
    """Length in tokens of a prompt as the trainer will feed it (chat template, tool schemas, generation prompt)."""
    tokenizer = getattr(tokenizer, "tokenizer", tokenizer)  # processors wrap the tokenizer
    if isinstance(prompt, str):
        return len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    ids = tokenizer.apply_chat_template(
        prompt,
        tools=tools,
        chat_template=chat_template,
        tokenize=True,
        add_generation_prompt=True,
        **(chat_template_kwargs or {}),
    )
    return len(ids["input_ids"] if hasattr(ids, "keys") else ids)


# How many rows of a streamed train set `filter_overlong_prompts` reads up front, looking for a prompt that fits.
STREAM_LOOKAHEAD_ROWS = 1000


@dataclass(frozen=True)
class StreamPeek:
    """What the look-ahead over a streamed train set's first rows found (one per process, compared across them)."""

    rows: int  # rows read: up to the first prompt that fits, the look-ahead bound or the end of the stream
    fits: bool  # a prompt within max_prompt_length was found
    ended: bool  # the stream ended before a prompt fitting or the look-ahead bound
    shortest: int | None  # the fewest tokens among the overlong rows read
    first_overlong: tuple[int, int] | None  # (row, tokens) of the first overlong row read


def peek_stream(dataset: IterableDataset, length_of: Callable[[Any], int], max_length: int, lookahead: int):
    """Read a stream's rows until one's prompt fits in `max_length` tokens, `lookahead` rows are read, or it ends."""
    rows, shortest, first_overlong = 0, None, None
    for row in itertools.islice(dataset, lookahead):
        length = length_of(row["prompt"])
        if length <= max_length:
            return StreamPeek(rows + 1, True, False, shortest, first_overlong)
        shortest = length if shortest is None else min(shortest, length)
        first_overlong = first_overlong or (rows, length)
        rows += 1
    return StreamPeek(rows, False, rows < lookahead, shortest, first_overlong)


def check_stream_start(
    peeks: list[StreamPeek], max_prompt_length: int, policy: str, lookahead: int, num_processes: int = 1
) -> None:
    """Raise when the look-ahead (every process's: `peeks`, gathered, so that all processes raise together) found no
    prompt that fits, or, with policy 'error', an overlong prompt before the first that fits."""
    for process, peek in enumerate(peeks):
        where = f" (process {process}'s stream)" if num_processes > 1 and len(set(peeks)) > 1 else ""
        if peek.rows == 0:
            raise ValueError(f"the streamed train_dataset yielded no rows{where}: nothing to train on.")
        if peek.fits:
            continue
        if peek.ended:
            raise ValueError(
                f"all {peek.rows} prompts of the streamed train_dataset{where} exceed max_prompt_length="
                f"{max_prompt_length} tokens (the shortest has {peek.shortest}): nothing is left to train on; raise "
                "max_prompt_length."
            )
        raise ValueError(
            f"the first {peek.rows} prompts of the streamed train_dataset{where} all exceed max_prompt_length="
            f"{max_prompt_length} tokens (the shortest has {peek.shortest}): raise max_prompt_length. The check reads "
            f"at most {lookahead} rows ahead (dapo_trl.data.STREAM_LOOKAHEAD_ROWS); if the prompts that fit come "
            "later in the stream, shuffle it or filter it before training."
        )
    overlong = [peek.first_overlong for peek in peeks if peek.first_overlong is not None]
    if policy == "error" and overlong:
        row, length = overlong[0]
        raise ValueError(
            f"a streamed prompt has {length} tokens > max_prompt_length={max_prompt_length} (row {row + 1}); raise "
            "max_prompt_length or use overlong_prompt_policy='filter'."
        )


def filter_overlong_prompts(
    dataset: Dataset,
    tokenizer: Any,
    max_prompt_length: int,
    policy: str = "filter",
    chat_template_kwargs: dict[str, Any] | None = None,
    tools: list | None = None,
    chat_template: str | None = None,
    lookahead: int | None = None,
    gather: Callable[[list[Any]], list[Any]] | None = None,
) -> Dataset:
    """Drop (policy 'filter', logged) or reject (policy 'error') prompts longer than max_prompt_length tokens,
    like verl's filter_overlong_prompts / truncation='error'. When no prompt is left, this raises instead of letting
    the run train 0 steps.

    A streamed (iterable) dataset is filtered lazily, as it is read: nothing is counted up front. It is checked up
    front, though: its first rows are read until a prompt fits, up to `lookahead` rows (default
    `STREAM_LOOKAHEAD_ROWS`, 1000) or the end of the stream. If none fits, or the stream has no rows, this raises; so
    does an overlong prompt met before the first that fits under policy 'error' (later ones stop the run when they are
    read). `gather` (accelerate's `gather_object`, in a run with several processes; every process must call this then)
    gathers every process's look-ahead, so that all processes raise, or none."""
    if isinstance(dataset, IterableDataset):

        def length_of(prompt: Any) -> int:
            return prompt_token_length(tokenizer, prompt, chat_template_kwargs, tools, chat_template)

        def fits(row: dict[str, Any]) -> bool:
            length = length_of(row["prompt"])
            if length > max_prompt_length and policy == "error":
                raise ValueError(
                    f"a streamed prompt has {length} tokens > max_prompt_length={max_prompt_length}; raise "
                    "max_prompt_length or use overlong_prompt_policy='filter'."
                )
            return length <= max_prompt_length

        lookahead = STREAM_LOOKAHEAD_ROWS if lookahead is None else lookahead
        if lookahead < 1:
            raise ValueError(f"lookahead={lookahead} must be >= 1")
        peeks = [peek_stream(dataset, length_of, max_prompt_length, lookahead)]
        peeks = gather(peeks) if gather is not None else peeks
        check_stream_start(peeks, max_prompt_length, policy, lookahead, len(peeks))
        return dataset.filter(fits)
    lengths = [
        prompt_token_length(tokenizer, row["prompt"], chat_template_kwargs, tools, chat_template) for row in dataset
    ]
    too_long = [i for i, n in enumerate(lengths) if n > max_prompt_length]
    if not too_long:
        return dataset
    if policy == "error":
        raise ValueError(
            f"{len(too_long)} prompts exceed max_prompt_length={max_prompt_length} tokens (first: row "
            f"{too_long[0] + 1} with {lengths[too_long[0]]}); raise max_prompt_length or use "
            "overlong_prompt_policy='filter'."
        )
    if len(too_long) == len(dataset):
        raise ValueError(
            f"all {len(dataset)} prompts exceed max_prompt_length={max_prompt_length} tokens (the shortest has "
            f"{min(lengths)}): nothing is left to train on; raise max_prompt_length."
        )
    logger.warning("filtered %d of %d prompts longer than %d tokens", len(too_long), len(dataset), max_prompt_length)
    drop = set(too_long)
    return dataset.select([i for i in range(len(dataset)) if i not in drop])
