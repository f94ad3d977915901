"""Validation with avg@n and unbiased pass@k, per data source.

`DAPOTrainer.evaluate` adds them to TRL's own evaluation (`dapo_trl.training.sampling.evaluation`); the
`python -m dapo_trl.evaluate` command calls `validate_checkpoint`.

For each prompt, n responses are sampled with the validation sampling parameters (paper: temperature 1.0,
top_p 0.7, n = 32 for AIME) and scored with the accuracy reward; a response is correct when its reward is > 0.
avg@n is the mean accuracy over all n x prompts responses; pass@k (k = 1..n) uses the unbiased estimator of
Chen et al. (2021), averaged over prompts.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import math
import os
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch

if TYPE_CHECKING:  # TRL and datasets load lazily: the evaluate command and the scoring helpers do not need them
    pass

Backend = Literal["transformers", "vllm"]

logger = logging.getLogger(__name__)


def pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
    """Unbiased pass@k: 1 - C(n - c, k) / C(n, k), the chance that k of the n samples hold a correct one."""
    if not 0 <= num_correct <= num_samples or not 1 <= k <= num_samples:
        raise ValueError(f"need 0 <= c <= n and 1 <= k <= n, got n={num_samples}, c={num_correct}, k={k}")
    if num_samples - num_correct < k:
        return 1.0
    # Product form avoids huge binomials: prod_{i=n-c+1}^{n} (1 - k / i).
    return 1.0 - math.prod(1.0 - k / i for i in range(num_samples - num_correct + 1, num_samples + 1))


@dataclass
class PromptResult:
    """The sampled responses to one validation prompt and whether each was correct."""

    index: int
    data_source: str
    prompt: Any
    solution: str
    completions: list[str]
    correct: list[bool]


def summarize(results: Sequence[PromptResult], ks: Sequence[int] | None = None) -> dict[str, float]:
    """avg@n, pass@k and prompt counts per data source and over everything (`all/...`)."""
    if not results:
        raise ValueError("no validation results to summarize")
    num_samples = len(results[0].correct)
    if any(len(r.correct) != num_samples for r in results):
        raise ValueError("every prompt needs the same number of samples")
    ks = list(ks) if ks is not None else list(range(1, num_samples + 1))
    by_source: dict[str, list[PromptResult]] = defaultdict(list)
    for result in results:
        by_source[result.data_source].append(result)
    if len(by_source) > 1:
        by_source["all"] = list(results)
    metrics = {}
    for source, group in sorted(by_source.items()):
        correct_counts = [sum(r.correct) for r in group]
        metrics[f"{source}/avg@{num_samples}"] = sum(correct_counts) / (num_samples * len(group))
        for k in ks:
            metrics[f"{source}/pass@{k}"] = sum(pass_at_k(num_samples, c, k) for c in correct_counts) / len(group)
        metrics[f"{source}/num_prompts"] = float(len(group))
    return metrics


def _prompt_text(tokenizer: Any, prompt: Any, chat_template_kwargs: dict[str, Any] | None) -> str:
    if isinstance(prompt, str):
        return prompt
    return tokenizer.apply_chat_template(
        prompt, tokenize=False, add_generation_prompt=True, **(chat_template_kwargs or {})
    )


@torch.no_grad()
def _generate_with_transformers(
    model: Any,
    tokenizer: Any,
    texts: list[str],
    num_samples: int,
    temperature: float,
    top_p: float,
    max_new_tokens: int,
    batch_size: int,
) -> list[list[str]]:
    """`model.generate` in batches of prompts, left padded, special tokens stripped from the responses."""
    padding_side, tokenizer.padding_side = tokenizer.padding_side, "left"
    outputs: list[list[str]] = []
    try:
        for start in range(0, len(texts), batch_size):
            batch = tokenizer(
                texts[start : start + batch_size], return_tensors="pt", padding=True, add_special_tokens=False
            ).to(model.device)
            generated = model.generate(
                **batch,
                do_sample=True,
                temperature=temperature,
                top_p=top_p,
                max_new_tokens=max_new_tokens,
                num_return_sequences=num_samples,
                pad_token_id=tokenizer.pad_token_id,
            )
            decoded = tokenizer.batch_decode(generated[:, batch["input_ids"].size(1) :], skip_special_tokens=True)
            outputs.extend(decoded[i : i + num_samples] for i in range(0, len(decoded), num_samples))
    finally:
        tokenizer.padding_side = padding_side
    return outputs


def _generate_with_vllm(
    model_path: str,
    texts: list[str],
    num_samples: int,
    temperature: float,
    top_p: float,
    max_new_tokens: int,
    seed: int,
) -> list[list[str]]:
    """A local vLLM engine on a saved checkpoint (standalone evaluation; vLLM loads the weights itself)."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=model_path, seed=seed)
    params = SamplingParams(n=num_samples, temperature=temperature, top_p=top_p, max_tokens=max_new_tokens, seed=seed)
    return [[choice.text for choice in output.outputs] for output in llm.generate(texts, params)]


@dataclass(frozen=True)
class ValidationSampling:
    """How validation samples: `num_samples` responses per prompt at (temperature, top_p), up to `max_new_tokens`;
    `batch_size` prompts per generation call (in training and with the transformers backend), the standalone vLLM
    backend is seeded with `seed`."""

    num_samples: int
    temperature: float
    top_p: float
    max_new_tokens: int
    batch_size: int = 8
    seed: int = 0


def sample_responses(
    prompts: Sequence[Any],
    settings: ValidationSampling,
    *,
    backend: Backend = "transformers",
    model: Any = None,
    model_path: str | None = None,
    tokenizer: Any,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> list[list[str]]:
    """`num_samples` sampled responses per prompt, prompts rendered with the chat template either way.

    backend="transformers" samples with the loaded `model` (in training, or any model in memory), `batch_size`
    prompts per call; backend="vllm" starts a local engine on the checkpoint at `model_path`, seeded with `seed`.
    """
    texts = [_prompt_text(tokenizer, prompt, chat_template_kwargs) for prompt in prompts]
    sampling = (settings.num_samples, settings.temperature, settings.top_p, settings.max_new_tokens)
    if backend == "transformers":
        if model is None:
            raise ValueError("backend='transformers' needs a model")
        return _generate_with_transformers(model, tokenizer, texts, *sampling, settings.batch_size)
    if backend == "vllm":
        if model_path is None:
            raise ValueError("backend='vllm' needs a model_path")
        return _generate_with_vllm(model_path, texts, *sampling, settings.seed)
    raise ValueError(f"unknown sampling backend {backend!r}: use 'transformers' or 'vllm'")


def call_reward(
    reward_func: Callable[..., Any],
    rows: Sequence[dict[str, Any]],
    completions: Sequence[Any],
    extra_kwargs: dict[str, Any] | None = None,
    async_loop: asyncio.AbstractEventLoop | None = None,
) -> list[float | None]:
    """One reward per completion, calling `reward_func` as TRL does: `prompts`, `completions`, the dataset columns
    as keyword lists (`rows` holds one row per completion) and `extra_kwargs`. An `async def` reward is awaited on
    `async_loop` (the trainer's event loop thread, as TRL runs async rewards), or on a fresh loop without one."""
    excluded = ("prompt", "completion", "completion_ids")  # the columns TRL does not pass either
    columns = {key: [row[key] for row in rows] for key in rows[0] if key not in excluded} if rows else {}
    prompts = [row["prompt"] for row in rows]
    rewards = reward_func(prompts=prompts, completions=list(completions), **columns, **(extra_kwargs or {}))
    if inspect.isawaitable(rewards):
        if async_loop is None:
            return asyncio.run(rewards)
        return asyncio.run_coroutine_threadsafe(rewards, async_loop).result()
    return rewards


def is_correct(reward_func: Any, reward: float | None) -> bool:
    """Whether a reward means correct: the reward function's own `is_correct(reward)` where it has one (verl's code
    scorer: every test passes), else reward > 0. None and NaN are wrong."""
    if reward is None or reward != reward:
        return False
    judge = getattr(reward_func, "is_correct", None)
    return bool(judge(reward)) if callable(judge) else reward > 0


def correct_per_prompt(rewards: Sequence[float | None], num_samples: int, reward_func: Any = None) -> list[list[bool]]:
    """Rewards of consecutive groups of `num_samples` responses -> correct (`is_correct`)."""
    marks = [is_correct(reward_func, reward) for reward in rewards]
    return [marks[start : start + num_samples] for start in range(0, len(marks), num_samples)]


def score_responses(
    reward_func: Callable[..., list[float]],
    rows: Sequence[dict[str, Any]],
    completions: Sequence[Sequence[str]],
    extra_kwargs: dict[str, Any] | None = None,
) -> list[list[bool]]:
    """Correct (`is_correct`) per response of text `completions` (as messages for chat prompts), scored like TRL."""
    flat_rows = [row for row, responses in zip(rows, completions, strict=True) for _ in responses]
    flat = [text for responses in completions for text in responses]
    conversational = bool(flat_rows) and not isinstance(flat_rows[0]["prompt"], str)
    formatted = [[{"role": "assistant", "content": text}] for text in flat] if conversational else flat
    rewards = call_reward(reward_func, flat_rows, formatted, extra_kwargs)
    correct, position = [], 0
    for responses in completions:
        correct.append([is_correct(reward_func, reward) for reward in rewards[position : position + len(responses)]])
        position += len(responses)
    return correct


def build_results(
    indices: Sequence[int],
    rows: Sequence[dict[str, Any]],
    completions: Sequence[list[str]],
    correct: Sequence[list[bool]],
) -> list[PromptResult]:
    """One PromptResult per prompt; `indices` are positions in the whole dataset, to restore order after gather."""
    return [
        PromptResult(index, row.get("data_source") or "validation", row["prompt"], str(row["solution"]), texts, marks)
        for index, row, texts, marks in zip(indices, rows, completions, correct, strict=True)
    ]


def write_samples(path: str, results: Sequence[PromptResult], limit: int | None = None) -> None:
    """The sampled generations as JSON lines: prompt, solution, responses and their correctness."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        for result in results[:limit]:
            f.write(json.dumps(asdict(result), ensure_ascii=False) + "\n")


def format_table(metrics: dict[str, float]) -> str:
    """A markdown table: one row per data source, avg@n and pass@k columns."""
    sources = sorted({key.split("/")[0] for key in metrics})
    columns = sorted(
        {key.split("/", 1)[1] for key in metrics if "/num_prompts" not in key},
        key=lambda name: (not name.startswith("avg"), int(name.split("@")[1])),
    )
    lines = ["| source | prompts | " + " | ".join(columns) + " |", "|---" * (len(columns) + 2) + "|"]
    for source in sources:
        cells = " | ".join(f"{metrics.get(f'{source}/{c}', float('nan')):.4f}" for c in columns)
        lines.append(f"| {source} | {int(metrics[f'{source}/num_prompts'])} | {cells} |")
    return "\n".join(lines)


def validate_checkpoint(
    model_path: str,
    tokenizer: Any,
    rows: Sequence[dict[str, Any]],
    reward_func: Callable[..., list[float]],
    settings: ValidationSampling,
    backend: Backend,
) -> list[PromptResult]:
    """Sample and score a saved checkpoint outside training (`python -m dapo_trl.evaluate`), one process.

    With the transformers backend the model is loaded here, on the GPU when there is one; vLLM loads its own.
    """
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    torch.manual_seed(settings.seed)
    model = None
    if backend == "transformers":
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_path, dtype="auto")
        model.to("cuda" if torch.cuda.is_available() else "cpu").eval()
    prompts = [row["prompt"] for row in rows]
    completions = sample_responses(
        prompts, settings, backend=backend, model=model, model_path=model_path, tokenizer=tokenizer
    )
    correct = score_responses(reward_func, rows, completions)
    return build_results(list(range(len(rows))), rows, completions, correct)
