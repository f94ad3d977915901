"""Validation with avg@n and unbiased pass@k, per data source.

`DAPOTrainer.evaluate` calls `evaluate_with_validation`: TRL's own evaluation, plus `validate`'s avg@n / pass@k when
the eval rows carry answers, logged together once. The `python -m dapo_trl.evaluate` command calls
`validate_checkpoint`.

For each prompt, n responses are sampled with the validation sampling parameters (paper: temperature 1.0,
top_p 0.7, n = 32 for AIME) and scored with the accuracy reward; a response is correct when its reward is > 0.
avg@n is the mean accuracy over all n x prompts responses; pass@k (k = 1..n) uses the unbiased estimator of
Chen et al. (2021), averaged over prompts.
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import json
import logging
import math
import os
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch

if TYPE_CHECKING:  # TRL and datasets load lazily: the evaluate command and the scoring helpers do not need them
    from datasets import Dataset, IterableDataset

    from .trainer import DAPOTrainer

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
class SamplingSettings:
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
    settings: SamplingSettings,
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


def correct_per_prompt(rewards: Sequence[float | None], num_samples: int) -> list[list[bool]]:
    """Rewards of consecutive groups of `num_samples` responses -> correct (reward > 0; None and NaN are wrong)."""
    marks = [reward is not None and reward > 0 for reward in rewards]
    return [marks[start : start + num_samples] for start in range(0, len(marks), num_samples)]


def score_responses(
    reward_func: Callable[..., list[float]],
    rows: Sequence[dict[str, Any]],
    completions: Sequence[Sequence[str]],
    extra_kwargs: dict[str, Any] | None = None,
) -> list[list[bool]]:
    """Correct (reward > 0) per response of text `completions` (as messages for chat prompts), scored like TRL."""
    flat_rows = [row for row, responses in zip(rows, completions, strict=True) for _ in responses]
    flat = [text for responses in completions for text in responses]
    conversational = bool(flat_rows) and not isinstance(flat_rows[0]["prompt"], str)
    formatted = [[{"role": "assistant", "content": text}] for text in flat] if conversational else flat
    rewards = call_reward(reward_func, flat_rows, formatted, extra_kwargs)
    correct, position = [], 0
    for responses in completions:
        correct.append([reward is not None and reward > 0 for reward in rewards[position : position + len(responses)]])
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


def _ignore(*args: Any, **kwargs: Any) -> None:
    """Reward-function hooks (log_metric, log_extra) that validation does not record."""


def log_samples_table(trainer: DAPOTrainer, results: Sequence[PromptResult], key: str = "eval_samples") -> None:
    """The sampled validation responses as a wandb table, when wandb is the active logger."""
    if "wandb" not in (trainer.args.report_to or []):
        return
    import wandb

    if wandb.run is None:
        return
    rows = [
        [trainer.state.global_step, r.data_source, str(r.prompt), r.solution, text, ok]
        for r in results
        for text, ok in zip(r.completions, r.correct, strict=True)
    ]
    columns = ["step", "data_source", "prompt", "solution", "response", "correct"]
    wandb.log({key: wandb.Table(columns=columns, data=rows)})


# ------------------------------------------------------------------------------------------ during training
_logged_once: set[str] = set()


def _info_once(message: str) -> None:
    if message not in _logged_once:
        _logged_once.add(message)
        logger.info(message)


def evaluate_with_validation(
    trainer: DAPOTrainer,
    trl_evaluate: Callable[..., dict[str, float]],
    eval_dataset: Any,
    ignore_keys: list[str] | None,
    metric_key_prefix: str,
) -> dict[str, float]:
    """`DAPOTrainer.evaluate`: TRL's evaluation, with DAPO's avg@n / pass@k merged into its metrics and its log.

    `trl_evaluate` is `super().evaluate` (`Trainer.evaluate`), called with the same arguments, for every eval set
    form TRL takes (Dataset, IterableDataset, a dict of them or a key of the trainer's dict):
    1. a dict goes straight to it: `Trainer.evaluate` calls `evaluate` back once per key with the prefix
       `{prefix}_{key}`, so each set gets both parts below under its own prefix;
    2. `validate` samples and scores the set (nothing when its rows carry no `solution` or the accuracy reward
       is a model) and its metrics are queued in `trainer._metrics["eval"]`;
    3. TRL's evaluation runs: its eval loop calls `GRPOTrainer.prediction_step` per batch (generation with
       `num_generations_eval` and the training sampling parameters, every reward function or model, sync or async,
       the loss), then logs once. GRPOTrainer's `log` averages `_metrics["eval"]` into that log entry, prefixed
       `eval_`, and into the returned dict: the validation metrics are logged with TRL's, as one entry.
    `eval_on_start`, `eval_strategy` and `metric_for_best_model` all go through here.
    """
    dataset = eval_dataset if eval_dataset is not None else trainer.eval_dataset
    if isinstance(dataset, str) and isinstance(trainer.eval_dataset, dict):
        dataset = trainer.eval_dataset[dataset]
    metrics = {} if dataset is None or isinstance(dataset, dict) else validate(trainer, dataset, metric_key_prefix)
    # GRPOTrainer.log prefixes what it averages from `_metrics["eval"]` with "eval_", whatever metric_key_prefix is
    # (so with a prefix not starting with "eval", these land under eval_{prefix}_..., as TRL's own land under eval_).
    queued = {name.removeprefix("eval_"): value for name, value in metrics.items()}
    pending = trainer._metrics["eval"]
    for key, value in queued.items():
        pending[key] = [value]
    try:
        return trl_evaluate(eval_dataset, ignore_keys, metric_key_prefix)
    finally:
        for key in queued:  # logged (and cleared) by now, unless TRL's evaluation failed
            pending.pop(key, None)


def eval_sampling_settings(args: Any) -> SamplingSettings:
    """The eval sampling fields of a DAPOConfig: eval_num_samples, eval_temperature, eval_top_p, eval_max_new_tokens
    (default max_completion_length) and per_device_eval_batch_size prompts per generation call."""
    max_new_tokens = args.eval_max_new_tokens or args.max_completion_length
    return SamplingSettings(
        args.eval_num_samples, args.eval_temperature, args.eval_top_p, max_new_tokens, args.per_device_eval_batch_size
    )


def _why_not_validated(trainer: DAPOTrainer) -> str | None:
    reward = trainer.reward_funcs[trainer.accuracy_reward_index]
    name = trainer.reward_func_names[trainer.accuracy_reward_index]
    if isinstance(reward, torch.nn.Module) or not callable(reward):
        return (
            f"the accuracy reward {name!r} is a reward model, not a function deciding correctness: evaluate() "
            "reports TRL's eval metrics only (no avg@n / pass@k)"
        )
    if getattr(trainer, "environment_factories", None) is not None:
        return (
            "with environment_factory every rollout needs its environment's reset(): evaluate() reports TRL's eval "
            "metrics only (no avg@n / pass@k)"
        )
    return None


def _local_rows(
    dataset: Dataset | IterableDataset, process_index: int, num_processes: int
) -> tuple[list[tuple[int, dict]], int, Any]:
    """This process's (index, row) share of the eval set, the number of rows, and the first row (None if empty).

    A map-style set is indexed; a stream (IterableDataset) is read once, whole, on every process: no len().
    """
    if hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__"):
        total = len(dataset)
        local = [(i, dataset[i]) for i in range(process_index, total, num_processes)]
        return local, total, dataset[0] if total else None
    local, total, first = [], 0, None
    for index, row in enumerate(dataset):
        first = row if first is None else first
        if index % num_processes == process_index:
            local.append((index, row))
        total = index + 1
    return local, total, first


@contextmanager
def eval_sampling(trainer: DAPOTrainer, settings: SamplingSettings) -> Iterator[None]:
    """Make the trainer's own generation (`_generate`: transformers, vLLM or a rollout_func, then TRL's tool loop)
    sample with the eval settings, and restore the training ones after.

    TRL reads these attributes at each call: `num_generations_eval` (consecutive copies of a prompt; vLLM server
    mode samples n per prompt), `max_completion_length` (the tool loop's token budget), and the backend's
    temperature, top_p and response length (`generation_config` / `generation_kwargs`, or the vLLM generator's).
    Other sampling knobs (top_k, min_p, repetition_penalty, generation_kwargs) stay the training ones.
    """
    length, sampling = settings.max_new_tokens, {"temperature": settings.temperature, "top_p": settings.top_p}
    overrides: list[tuple[Any, dict[str, Any]]] = [
        (trainer, {"num_generations_eval": settings.num_samples, "max_completion_length": length})
    ]
    if getattr(trainer, "generation_config", None) is not None:  # transformers generation
        config = copy.deepcopy(trainer.generation_config)
        config.update(**sampling, max_new_tokens=length)
        kwargs = {**trainer.generation_kwargs, **sampling, "max_new_tokens": length}
        overrides.append((trainer, {"generation_config": config, "generation_kwargs": kwargs}))
    if getattr(trainer, "vllm_generation", None) is not None:
        overrides.append((trainer.vllm_generation, {**sampling, "max_completion_length": length}))
    saved = [(target, {name: getattr(target, name) for name in values}) for target, values in overrides]
    try:
        for target, values in overrides:
            for name, value in values.items():
                setattr(target, name, value)
        yield
    finally:
        for target, values in reversed(saved):
            for name, value in values.items():
                setattr(target, name, value)


def _generate(trainer: DAPOTrainer, prompts: list[Any]) -> tuple[list[list[int]], list[Any]]:
    """`trainer._generate(prompts)` -> (completion ids, completions as TRL hands them to rewards).

    With tools, TRL's tool loop reads per-rollout tool tables that `_generate_and_score_completions` builds for each
    batch; they are built here the same way for the standalone tools (the same for every rollout).
    """
    if trainer.tools:
        tools = trainer._standalone_tools
        sync_tools = {tool.__name__: tool for tool in tools if not inspect.iscoroutinefunction(tool)}
        async_tools = {tool.__name__: tool for tool in tools if inspect.iscoroutinefunction(tool)}
        trainer._sync_tool_dicts = [sync_tools] * len(prompts)
        trainer._async_tool_dicts = [async_tools] * len(prompts)
    _, completion_ids, _, completions, *_ = trainer._generate(prompts)
    return completion_ids, completions


def _sample_and_score(
    trainer: DAPOTrainer, batches: list[list[tuple[int, dict]]], settings: SamplingSettings
) -> tuple[list[PromptResult], dict[str, float]]:
    """Sample `num_samples` responses per prompt through the trainer's generation in eval mode, and score them.

    Every process runs the same number of equal batches (the generation's collectives need it); padding rows
    (index -1) are generated but neither scored nor reported. Returns this process's results and the generation
    metrics of the pass (TRL's completions/*, tools/*, DAPO's tool metrics), averaged over its batches.
    """
    reward = trainer.reward_funcs[trainer.accuracy_reward_index]
    context = {"trainer_state": trainer.state, "log_metric": _ignore, "log_extra": _ignore}
    async_loop = getattr(trainer, "async_loop", None)
    n, results = settings.num_samples, []
    was_training = trainer.model.training
    trl_eval_metrics, trainer._metrics["eval"] = trainer._metrics["eval"], defaultdict(list)
    trainer.model.eval()  # `_generate` logs to the eval metrics, not the training ones
    try:
        with eval_sampling(trainer, settings):
            for batch in batches:
                prompts = [row["prompt"] for _, row in batch for _ in range(n)]
                completion_ids, completions = _generate(trainer, prompts)
                texts = trainer._tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
                real = [position for position, (index, _) in enumerate(batch) if index >= 0]
                if not real:
                    continue
                picked = [position * n + k for position in real for k in range(n)]
                rows = [batch[position][1] for position in real for _ in range(n)]
                extra = {**context, "completion_ids": [completion_ids[i] for i in picked]}
                rewards = call_reward(reward, rows, [completions[i] for i in picked], extra, async_loop)
                marks = correct_per_prompt(rewards, n)
                for position, correct in zip(real, marks, strict=True):
                    index, row = batch[position]
                    responses = texts[position * n : (position + 1) * n]
                    results.extend(build_results([index], [row], [responses], [correct]))
    finally:
        sampled, trainer._metrics["eval"] = trainer._metrics["eval"], trl_eval_metrics
        if was_training:
            trainer.model.train()
    metrics = {}
    for name, values in sampled.items():
        valid = [value for value in values if not math.isnan(value)]
        if name != "num_tokens" and valid:  # num_tokens counts training tokens; TRL logs it already
            metrics[name] = sum(valid) / len(valid)
    return results, metrics


def validate(
    trainer: DAPOTrainer, dataset: Dataset | IterableDataset, metric_key_prefix: str = "eval"
) -> dict[str, float]:
    """DAPO's validation of one eval set (Dataset or IterableDataset), the part `evaluate()` adds to TRL's.

    Returns `{prefix}_{source}/avg@n`, `pass@k` (k = 1..n) and `num_prompts` per `data_source` (plus `all/` over
    several), and the sampling pass's generation metrics as `{prefix}_sampling/...` (`completions/mean_length`,
    `tools/call_frequency`, ...); {} when the rows carry no `solution` column or the accuracy reward is not a
    function (a reward model), said once in the log.

    It samples separately from TRL's eval generation, with the eval sampling settings: `eval_num_samples` responses
    per prompt at `eval_temperature` / `eval_top_p`, up to `eval_max_new_tokens` tokens. Reusing TRL's eval
    generations would save that pass, but they are `num_generations_eval` samples at the training temperature and
    top_p (the paper validates at top_p 0.7 with n = 32), and their count is tied to the eval batch size. Sampling
    goes through the trainer's own generation (`_generate` in eval mode), so it uses vLLM when training does, the
    chat template and tool schema of training prompts, and, with tools, TRL's multi-turn tool loop; its generation
    metrics land in the eval metrics. Prompts are sharded over processes; correctness is the accuracy reward > 0,
    called as TRL calls rewards (async ones on the trainer's loop). The responses to the first
    `eval_samples_to_log` prompts go to output_dir/eval_samples/step_XXXXXX.jsonl (`_<key>` added for a dict of eval
    sets) and, under wandb, to a table. The model's train mode is restored.
    """
    from accelerate.utils import gather_object

    reason = _why_not_validated(trainer)
    if reason is not None:
        _info_once(reason)
        return {}
    args, accelerator = trainer.args, trainer.accelerator
    local, total, first = _local_rows(dataset, accelerator.process_index, accelerator.num_processes)
    if first is None or "solution" not in first:
        _info_once("eval rows without a `solution` column: evaluate() reports TRL's eval metrics only for them")
        return {}
    settings = eval_sampling_settings(args)
    per_process = -(-total // accelerator.num_processes)
    batch_size = min(settings.batch_size, per_process)
    num_batches = -(-per_process // batch_size)
    padded = local + [(-1, first)] * (num_batches * batch_size - len(local))
    batches = [padded[start : start + batch_size] for start in range(0, len(padded), batch_size)]
    local_results, sampling_metrics = _sample_and_score(trainer, batches, settings)
    results = sorted(gather_object(local_results), key=lambda result: result.index)
    metrics = {f"{metric_key_prefix}_{key}": value for key, value in summarize(results).items()}
    metrics.update({f"{metric_key_prefix}_sampling/{key}": value for key, value in sampling_metrics.items()})
    if accelerator.is_main_process:
        key = metric_key_prefix.removeprefix("eval").lstrip("_")
        name = f"step_{trainer.state.global_step:06d}{f'_{key}' if key else ''}.jsonl"
        write_samples(os.path.join(args.output_dir, "eval_samples", name), results, args.eval_samples_to_log)
        log_samples_table(trainer, results[: args.eval_samples_to_log], f"{metric_key_prefix}_samples")
    return metrics


def validate_checkpoint(
    model_path: str,
    tokenizer: Any,
    rows: Sequence[dict[str, Any]],
    reward_func: Callable[..., list[float]],
    settings: SamplingSettings,
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
