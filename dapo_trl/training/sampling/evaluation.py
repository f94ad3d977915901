"""`DAPOTrainer.evaluate`: TRL's own evaluation, plus avg@n / pass@k per data source when the eval rows carry answers.

`evaluate_with_validation` runs `validate` (sampling through the trainer's own generation, so vLLM and TRL's tool
loop are used as in training, with the eval sampling settings swapped in by `eval_sampling`), puts its metrics where
TRL's single `log` call picks them up, then calls TRL's evaluation. The scoring math (pass@k, summaries) and the
standalone command's sampling are `dapo_trl.validation`.
"""

from __future__ import annotations

import copy
import logging
import math
import os
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from transformers import TrainerCallback

from ...validation import (
    PromptResult,
    ValidationSampling,
    build_results,
    call_reward,
    correct_per_prompt,
    summarize,
    write_samples,
)
from .. import trl_seam

if TYPE_CHECKING:
    from datasets import Dataset, IterableDataset
    from trl import GRPOTrainer as DAPOTrainer  # a dapo_trl.DAPOTrainer; named by its base, so imports run one way

    from ...config import DAPOConfig

logger = logging.getLogger(__name__)


class ValidateBeforeTraining(TrainerCallback):
    """verl's `val_before_train`: one validation pass once the model is prepared, before the first step."""

    def __init__(self, trainer: DAPOTrainer):
        if trainer.eval_dataset is None:
            raise ValueError("val_before_train needs an eval_dataset (--eval_dataset_name on the command line).")
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        if state.global_step == 0 and not args.eval_on_start:  # with eval_on_start, TRL evaluates right after this
            self.trainer.evaluate()


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


def eval_set_prefix(metric_key_prefix: str) -> str:
    """What TRL's eval metrics of one evaluation are prefixed with before GRPOTrainer.log adds `eval_`: nothing for
    "eval" (one eval set), `math_` for "eval_math" (the set "math" of a dict), `test_` for a prefix "test"."""
    return f"{metric_key_prefix}_".removeprefix("eval_")


def name_eval_metrics(trainer: DAPOTrainer, pending: dict[str, list[float]]) -> None:
    """Prefix the pending eval metrics (`_metrics["eval"]`, about to be logged) with the eval set's name, in place.

    GRPOTrainer.log adds its averaged metrics, prefixed `eval_` whatever the evaluation's metric_key_prefix, to the
    log entry and to the dict `evaluate()` returns: with a dict of eval sets every set would log `eval_reward`, and
    the combined dict would keep the last set's. Called by `DAPOTrainer.log` in eval mode; a no-op outside an
    evaluation and for the prefix "eval".
    """
    prefix = getattr(trainer, "_eval_metric_prefix", "")
    if prefix:
        named = {f"{prefix}{key}": values for key, values in pending.items()}
        pending.clear()
        pending.update(named)


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
       is a model) and its metrics are queued in TRL's pending eval metrics (`trl_seam.metrics`);
    3. TRL's evaluation runs: its eval loop calls `GRPOTrainer.prediction_step` per batch (generation with
       `num_generations_eval` and the training sampling parameters, every reward function or model, sync or async,
       the loss), then logs once. GRPOTrainer's `log` averages `_metrics["eval"]` into that log entry, prefixed
       `eval_`, and into the returned dict: the validation metrics are logged with TRL's, as one entry.
    TRL's own metrics (reward, rewards/<fn>/mean, completions/..., ...) follow the prefix too (`name_eval_metrics`):
    `eval_reward` for one eval set, `eval_math_reward` for the set "math" of a dict, so no set's metrics overwrite
    another's. Because GRPOTrainer.log always adds `eval_`, a prefix not starting with "eval" gives `eval_{prefix}_`
    (`eval_test_reward` for "test"; Trainer's own loss and speed metrics are `test_loss`, ...).
    `eval_on_start`, `eval_strategy` and `metric_for_best_model` all go through here.
    """
    dataset = eval_dataset if eval_dataset is not None else trainer.eval_dataset
    if isinstance(dataset, str) and isinstance(trainer.eval_dataset, dict):
        dataset = trainer.eval_dataset[dataset]
    if isinstance(dataset, dict):  # Trainer.evaluate calls back here once per set, with the set's prefix
        return trl_evaluate(eval_dataset, ignore_keys, metric_key_prefix)
    metrics = {} if dataset is None else validate(trainer, dataset, metric_key_prefix)
    # Queued under their bare names (`all/avg@2`): `name_eval_metrics` prefixes them with TRL's at log time.
    queued = {name.removeprefix(f"{metric_key_prefix}_"): value for name, value in metrics.items()}
    pending = trl_seam.metrics(trainer, "eval")
    for key, value in queued.items():
        pending[key] = [value]
    outer_prefix = getattr(trainer, "_eval_metric_prefix", "")
    trainer._eval_metric_prefix = eval_set_prefix(metric_key_prefix)
    try:
        return trl_evaluate(eval_dataset, ignore_keys, metric_key_prefix)
    finally:
        trainer._eval_metric_prefix = outer_prefix
        for key in queued:  # logged (and cleared) by now, unless TRL's evaluation failed
            pending.pop(key, None)


def eval_sampling_settings(args: DAPOConfig) -> ValidationSampling:
    """The eval sampling fields of a DAPOConfig: eval_num_samples, eval_temperature, eval_top_p, eval_max_new_tokens
    (default max_completion_length) and per_device_eval_batch_size prompts per generation call."""
    max_new_tokens = args.eval_max_new_tokens or args.max_completion_length
    return ValidationSampling(
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
def eval_sampling(trainer: DAPOTrainer, settings: ValidationSampling) -> Iterator[None]:
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
    """The trainer's generation of `prompts` -> (completion ids, completions as TRL hands them to rewards).

    With tools, TRL's tool loop reads per-rollout tool tables that `_generate_and_score_completions` builds for each
    batch; they are built here the same way for the standalone tools (the same for every rollout).
    """
    if trainer.tools:
        trl_seam.set_rollout_tools(trainer, len(prompts))
    output = trl_seam.generate(trainer, prompts)
    return output.completion_ids, output.completions


def _sample_and_score(
    trainer: DAPOTrainer, batches: list[list[tuple[int, dict]]], settings: ValidationSampling
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
    trl_eval_metrics = trl_seam.swap_metrics(trainer, "eval", defaultdict(list))
    trainer.model.eval()  # `_generate` logs to the eval metrics, not the training ones
    try:
        with eval_sampling(trainer, settings):
            for batch in batches:
                prompts = [row["prompt"] for _, row in batch for _ in range(n)]
                completion_ids, completions = _generate(trainer, prompts)
                texts = trl_seam.tokenizer(trainer).batch_decode(completion_ids, skip_special_tokens=True)
                real = [position for position, (index, _) in enumerate(batch) if index >= 0]
                if not real:
                    continue
                picked = [position * n + k for position in real for k in range(n)]
                rows = [batch[position][1] for position in real for _ in range(n)]
                extra = {**context, "completion_ids": [completion_ids[i] for i in picked]}
                rewards = call_reward(reward, rows, [completions[i] for i in picked], extra, async_loop)
                marks = correct_per_prompt(rewards, n, reward)
                for position, correct in zip(real, marks, strict=True):
                    index, row = batch[position]
                    responses = texts[position * n : (position + 1) * n]
                    results.extend(build_results([index], [row], [responses], [correct]))
    finally:
        sampled = trl_seam.swap_metrics(trainer, "eval", trl_eval_metrics)
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
