"""DAPOTrainer: TRL's GRPOTrainer with DAPO's reward shaping, exact token-level loss and dynamic sampling.

The trainer only orchestrates; every override calls `super()`, and every private TRL name it touches is listed and
checked in `dapo_trl.training.trl_seam`. The loss is TRL's `_compute_loss` (for `loss_type="dapo"` with
`epsilon_high` and dual-clip `delta`, tested equal to the reference `dapo_trl.algorithm.dapo_token_loss`), the
log-ratio clamped here, token-budget passes weighted (docs/losses.md); the step machinery
(dynamic sampling, micro-batches, padding-free forwards, reward columns, exact denominators) is `dapo_trl.training`.
"""

from __future__ import annotations

import logging
import os
from functools import partial
from typing import Any

import torch
from accelerate.utils import gather, gather_object
from trl import GRPOTrainer

from .config import DAPOConfig
from .rewards import dapo_math_reward
from .rewards.verl_default import check_dataset_sources
from .tools.runtime import ToolRuntime
from .training import batch_metrics, checkpoints, evaluation, steps, streams, trl_seam
from .training.batch_metrics import row_statistics
from .training.batching import (
    StepPlanner,
    TokenWeightedMetrics,
    backward_without_sync,
    fed_tokens,
    loss_mask,
    process_rows,
    select_rows,
)
from .training.colocate_engine import VLLMColocateEngine
from .training.packing import forward_count_agreement, one_forward_per_backward, packing_mode, padding_free_per_token
from .training.policy_loss import PolicyLossStep
from .training.reference import build_reference_model, needs_own_reference
from .training.rollout_driver import driver_metrics
from .training.rollout_engine import GroupEngine, SamplingSettings
from .training.rollout_setup import build_streaming_rollout
from .training.rollout_stream import ROLLOUT_STATE_FILE, StreamingRollout
from .training.round_scoring import RoundScoring
from .training.run_guard import RunGuard
from .training.sampling import DynamicSampler, Process, ScoredRound, check_regroupable, gather_rows, row_padding
from .training.sequence_parallel import SequenceParallel, check_sequence_parallel
from .training.server_engine import VLLMServerEngine
from .training.shaping import GenerationRecord, ShapingColumns
from .training.vllm_backends import (
    backend_for,
    prune_versions,
    reload_server_weights,
    restore_rollout_versions,
    rollout_weights_dirs,
    save_rollout_versions,
)

logger = logging.getLogger(__name__)


class DAPOTrainer(GRPOTrainer):
    """Drop-in for `trl.GRPOTrainer` (same arguments) that trains with DAPO.

    `reward_funcs` defaults to DAPO's "Answer:" correctness reward (+1 / -1) on the dataset's `solution` column,
    unless an `environment_factory` is given (its environment then owns the reward, as in GRPOTrainer).
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
        trl_seam.check_trl_classes(trl_seam.CLASS_NAMES + (trl_seam.WITH_VLLM if args.use_vllm else ()))
        env_factory = kwargs.get("environment_factory")
        with backend_for(args):
            super().__init__(
                model=model,
                reward_funcs=[dapo_math_reward] if reward_funcs is None and not env_factory else reward_funcs,
                args=args,
                train_dataset=train_dataset,
                eval_dataset=eval_dataset,
                processing_class=processing_class,
                **kwargs,
            )
        trl_seam.check_trainer_attributes(self)
        if args.use_vllm:
            trl_seam.check_trainer_attributes(self, trl_seam.VLLM_INSTANCE_ATTRIBUTES)
        if needs_own_reference(args, self.ref_model, self.model):  # KL in the reward without TRL's KL loss
            self.ref_model = build_reference_model(self, kwargs.get("quantization_config"))
        self.accuracy_reward_index = args.accuracy_reward_index(self.reward_func_names)
        check_dataset_sources(self.reward_funcs, self.train_dataset, self.eval_dataset)  # verl_default's sources
        self._shaping = ShapingColumns.for_trainer(self)  # overlong penalty, KL in the reward
        self._generation = GenerationRecord()  # the batch `_calculate_rewards` scores
        self._tool_runtime = ToolRuntime(self.tools, trl_seam.tokenizer(self), self.max_tool_calling_iterations)
        self._round: RoundScoring | None = None  # the round TRL is scoring for dynamic sampling (`_score_round`)
        self._packing = packing_mode(self.model) if args.padding_free else None  # said once in the log
        self._agree_forwards = forward_count_agreement(self.accelerator)  # ZeRO-3 / FSDP forwards run in lockstep
        self._one_forward = one_forward_per_backward(self.accelerator, args)  # ZeRO-3 + reentrant checkpointing
        self._sequence_parallel = self._build_sequence_parallel(args)
        self._token_metrics = TokenWeightedMetrics()
        self._policy_loss = PolicyLossStep(self, self._get_per_token_logps_and_entropies)  # the loss table's
        group_passes = None if self._sequence_parallel is None else self._sequence_parallel.group_passes
        self._planner = StepPlanner(args, self.accelerator, self.loss_type, group_passes)
        self._optimizer_steps = steps.OptimizerSteps(args, self.accelerator.device, self._planner.exact_denominator)
        self.add_callback(steps.SkipEmptySteps(self, self._optimizer_steps))  # a step without a loss token: no change
        self._guard = RunGuard(self)  # preemption, Ctrl-C, one process failing: `train` runs inside it
        if args.val_before_train:
            if self.eval_dataset is None:
                raise ValueError("val_before_train needs an eval_dataset (--eval_dataset_name on the command line).")
            self.add_callback(evaluation.ValidateBeforeTraining(self))
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
                gather=gather_object if self.accelerator.num_processes > 1 else None,
            )
        process = Process(self.accelerator.process_index, self.accelerator.num_processes, gather_object)
        padding, shuffle = row_padding(trl_seam.tokenizer(self).pad_token_id), self.shuffle_dataset
        self._sampler = DynamicSampler(args, self.train_dataset, self.num_generations, padding, process, shuffle)
        self._rollout = self._build_streaming_rollout(args) if args.rollout_streaming else None

    # ----------------------------------------------------------------------------------------------------- rewards
    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        self._shaping.hide(self)  # TRL scores the user's functions alone (a round may follow a shown one)
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        rewards_per_func = self._shaping.append(self, rewards_per_func, completion_ids_list, gather, self._generation)
        if self._round is not None:  # a dynamic-sampling round (`_score_round`) reads its accuracy
            self._round.rewards_per_func = rewards_per_func
            if self._round.streamed:
                self._round.row_stats = self._row_statistics(rewards_per_func, completion_ids_list)
        return rewards_per_func

    def _row_statistics(self, rewards_per_func: torch.Tensor, completion_ids_list: list) -> dict[str, Any]:
        """A streamed wave's per-row figures for the step's metrics (`training.batch_metrics`), every process's."""
        device, ends = rewards_per_func.device, {*self.eos_token_ids, trl_seam.tokenizer(self).pad_token_id}
        tool_mask = None if self._generation.output is None else self._generation.output.tool_mask
        model_tokens = [sum(mask) for mask in tool_mask] if tool_mask else [len(ids) for ids in completion_ids_list]
        lengths = torch.tensor(model_tokens, device=device)  # as TRL counts them: tool results left out
        truncated = torch.tensor([not ids or ids[-1] not in ends for ids in completion_ids_list], device=device)
        stats = row_statistics(rewards_per_func, gather(lengths), gather(truncated))
        return {**stats, "names": list(self.reward_func_names), "weights": self.reward_weights.detach().cpu()}

    # -------------------------------------------------------------- micro-batches: balance, exact denominator
    def _get_dataloader(self, dataset, *args, **kwargs):  # TRL's loader, each process slicing one whole stream
        return super()._get_dataloader(streams.whole_stream(dataset, self.accelerator.num_processes), *args, **kwargs)

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        batches, num_items = super().get_batch_samples(epoch_iterator, num_batches, device)
        self._optimizer_steps.begin(trl_seam.micro_step(self), batches)  # before the step's first micro-step
        return batches, num_items

    def _prepare_inputs(self, generation_batch: dict[str, Any]) -> dict[str, Any]:
        if not self.model.training:
            return super()._prepare_inputs(generation_batch)
        return self._optimizer_steps.micro_batch(trl_seam.micro_step(self), self._generate_micro_batches)

    def _generate_micro_batches(self, step: int, generation_batch: Any) -> list[dict[str, Any]]:
        """The generation batch starting at micro-step `step`: generated and scored, shuffled and split into
        `steps_per_generation` micro-batches as TRL's `_prepare_inputs` does, then planned."""
        scored = self._generate_and_score_completions(generation_batch)
        return self._planner.plan(trl_seam.shuffle_and_split(scored, self.args.steps_per_generation))

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """With a token budget, all but the last part of the micro-batch are backpropagated here, without a sync;
        each part's loss weighs its share of the micro-batch (`StepPlanner.part_weights`)."""
        parts = self._planner.parts(inputs)
        (*parts, last), (*weights, last_weight) = parts, self._planner.part_weights(inputs, parts)
        earlier = 0.0
        for part, weight in zip(parts, weights, strict=True):
            loss = self._weighted_loss(model, part, return_outputs, num_items_in_batch) * weight
            backward_without_sync(self, model, loss, num_items_in_batch)
            earlier += loss.detach()
        return self._weighted_loss(model, last, return_outputs, num_items_in_batch) * last_weight + earlier

    def _compute_loss(self, model, inputs):
        """The policy loss of `loss_type` from the table in `dapo_trl.algorithm.losses`, with every term of TRL's
        (`training.policy_loss.PolicyLossStep`): replaces TRL's, so the function a reader finds is the one trained."""
        return self._policy_loss(model, inputs)

    def _weighted_loss(self, model, inputs, return_outputs, num_items_in_batch):
        """The loss of one pass (`_compute_loss`), its token count recorded for per-token metrics."""
        loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        tokens = self.accelerator.reduce(loss_mask(inputs).sum().float(), reduction="sum")
        self._token_metrics.record("train" if self.model.training else "eval", tokens.item())
        return loss

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        mode = "train" if self.model.training else "eval"
        self._token_metrics.apply(mode, trl_seam.metrics(self, mode))
        if mode == "eval":  # one of several eval sets: TRL's metrics under its name (eval_<set>_reward)
            evaluation.name_eval_metrics(self, trl_seam.metrics(self, mode))
        super().log(logs, start_time)

    # ----------------------------------------------------------------------------------- padding-free forwards
    def _get_per_token_logps_and_entropies(
        self,
        model,
        input_ids,
        attention_mask,
        logits_to_keep,
        batch_size=None,
        compute_entropy=False,
        compute_aux_loss=False,
        **multimodal,
    ):
        """Every training-phase forward goes through here (padding-free, sequence-parallel)."""
        flags = {"compute_entropy": compute_entropy, "compute_aux_loss": compute_aux_loss}
        logps, *rest = self._real_token_forward(
            model, input_ids, attention_mask, logits_to_keep, batch_size, flags, multimodal
        )
        if not torch.is_grad_enabled():  # TRL's old and reference log-probs: KL in the reward reuses them
            self._generation.record_forward(self, model, input_ids, attention_mask, logps)
        return (logps, *rest)

    def _build_sequence_parallel(self, args: DAPOConfig) -> SequenceParallel | None:
        if args.sequence_parallel_size == 1:
            return None
        size, config = args.sequence_parallel_size, self.model.config
        distributed = str(self.accelerator.distributed_type)
        attention = check_sequence_parallel(
            size, config, self.accelerator.num_processes, distributed, getattr(self, "aux_loss_enabled", False)
        )
        return SequenceParallel(size, config, attention)

    def _real_token_forward(self, model, input_ids, attention_mask, logits_to_keep, batch_size, flags, multimodal):
        """TRL's forward, fed real tokens only when `padding_free` is on (sharded across the sequence-parallel
        group when there is one)."""

        def padded_forward(ids: torch.Tensor, mask: torch.Tensor, keep: int):
            return super(DAPOTrainer, self)._get_per_token_logps_and_entropies(model, ids, mask, keep, **flags)

        if self._sequence_parallel is not None:
            return self._sequence_parallel_forward(
                model, input_ids, attention_mask, logits_to_keep, batch_size, flags, multimodal, padded_forward
            )
        if not self.args.padding_free or any(value is not None for value in multimodal.values()):
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size, **flags, **multimodal
            )

        def packed_forward(packed):
            entropy, aux = flags["compute_entropy"], flags["compute_aux_loss"]
            extra = {"output_router_logits": True} if aux else {}
            with self.accelerator.autocast():
                out = model(
                    input_ids=packed.input_ids,
                    position_ids=packed.position_ids,
                    labels=packed.labels,
                    fused_lm_head=True,
                    **extra,
                )
            return out.log_probs, out.entropy if entropy else None, out.aux_loss if aux else None

        return padding_free_per_token(
            input_ids,
            attention_mask,
            logits_to_keep,
            packed_forward=packed_forward if self._packing else None,
            padded_forward=padded_forward,
            max_tokens=self.args.max_tokens_per_microbatch,
            max_rows=batch_size,
            one_sequence=self._packing == "sequence",
            pad_token_id=trl_seam.tokenizer(self).pad_token_id,
            agree_count=self._agree_forwards,
            one_forward=self._one_forward and torch.is_grad_enabled(),
        )

    def _sequence_parallel_forward(
        self, model, input_ids, attention_mask, logits_to_keep, batch_size, flags, multimodal, padded_forward
    ):
        """The group's rows packed, each packed sequence sharded across the group (`training.sequence_parallel`)."""
        if any(value is not None for value in multimodal.values()):
            raise ValueError("sequence_parallel_size > 1 runs text-only models: image inputs cannot be sharded.")
        attention = getattr(self.accelerator.unwrap_model(model).config, "_attn_implementation", None)
        if attention != self._sequence_parallel.attention:
            raise ValueError(
                f"sequence parallelism was set up for {self._sequence_parallel.attention} attention, but a forward "
                f"runs a model with {attention!r}: load the reference model with the policy's attn_implementation."
            )

        def shard_forward(ids: torch.Tensor, positions: torch.Tensor, labels: torch.Tensor, attention: dict):
            with self.accelerator.autocast():
                out = model(input_ids=ids, position_ids=positions, shift_labels=labels, fused_lm_head=True, **attention)
            return out.log_probs, out.entropy if flags["compute_entropy"] else None

        return self._sequence_parallel.per_token(
            input_ids,
            attention_mask,
            logits_to_keep,
            shard_forward=shard_forward,
            padded_forward=padded_forward,
            max_tokens=self.args.max_tokens_per_microbatch,
            max_rows=batch_size,
            pad_token_id=trl_seam.tokenizer(self).pad_token_id,
            agree_count=self._agree_forwards,
            one_forward=self._one_forward and torch.is_grad_enabled(),
        )

    # ------------------------------------------------------------------------------------------------ tool use
    def _generate(self, prompts: list):
        """TRL's generation (and tool loop); then tool metrics, and prefetched executions nobody used are dropped."""
        training = self.model.training  # read first: TRL's paged generation leaves the model in train mode
        self._tool_runtime.begin_generation()
        try:
            output = trl_seam.GenerationOutput.of(super()._generate(prompts))
            self._generation = GenerationRecord(training, output)
        finally:
            self._tool_runtime.end_generation()
        if self.tools:
            pending = trl_seam.metrics(self, "train" if training else "eval")
            for name, value in self._tool_runtime.metrics(output.completions, self.accelerator).items():
                pending[name].append(value)
        return output

    def _generate_single_turn(self, prompt_ids, *args, **kwargs):
        prepared = None if self._round is None else self._round.take_prepared()
        if prepared is not None:  # a streamed wave's first turn: the engine sampled these rows (later turns: below)
            if len(prepared["completion_ids"]) != len(prompt_ids):
                raise RuntimeError(
                    f"streaming rollout prepared {len(prepared['completion_ids'])} completions for "
                    f"{len(prompt_ids)} prompts"
                )
            completion_ids, logprobs = prepared["completion_ids"], prepared["logprobs"]
        elif self._round is not None and self._round.next_turns is not None:  # colocated: on the engine's thread
            completion_ids, logprobs = self._round.next_turns(prompt_ids)
        else:
            completion_ids, logprobs = super()._generate_single_turn(prompt_ids, *args, **kwargs)
        self._tool_runtime.on_turn(prompt_ids, completion_ids)
        return completion_ids, logprobs

    # ---------------------------------------------------------------------------------------- dynamic sampling
    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        try:
            if not (self.model.training and self.args.filter_groups_enable):
                return super()._generate_and_score_completions(inputs)
            if self._rollout is None:
                batch, metrics = self._sampler.sample(inputs, self._score_round)
            else:
                self.publish_rollout_weights(self._rollout.generation)
                batch, metrics = self._rollout.sample(inputs, self._score_wave)
                if self._rollout.driver is not None:
                    wait = metrics.pop("rollout/trainer_wait_seconds")
                    metrics.update(driver_metrics(self._rollout.driver.take_metrics(), wait))
                else:
                    metrics.pop("rollout/trainer_wait_seconds")
            for name, value in metrics.items():
                trl_seam.metrics(self, "train")[name].append(value)
            # Every process holds the whole batch: with one optimizer step per generation, deal rows by token count.
            balance = self.args.padding_free and self.args.steps_per_generation == self.args.gradient_accumulation_steps
            weights = fed_tokens(batch).tolist()
            rows = process_rows(weights, self.accelerator.num_processes, balance)
            local = select_rows(batch, rows[self.accelerator.process_index])
            local["num_items_in_batch"] = self.accelerator.gather(loss_mask(local).sum()).sum()
            return local
        finally:
            self._shaping.hide(self)  # the user's reward lists again, once the batch is scored

    def _score_round(self, round_inputs: list[dict[str, Any]], scoring: RoundScoring | None = None) -> ScoredRound:
        """One TRL generation + scoring pass, gathered from every process, with the raw accuracy of each row. With
        carried surplus on, behaviour-policy log-probs are stored too: a carried group trains one step later, so its
        ratio must be against the policy that sampled it."""
        self._round = scoring = scoring or RoundScoring()
        try:
            output = super()._generate_and_score_completions(round_inputs)
            rewards_per_func = scoring.rewards_per_func  # TRL's gathered rewards of this round, (rows, funcs)
        finally:
            self._round = None
        check_regroupable(output)  # before any forward of the rows
        if self.args.filter_groups_carry_surplus and output.get("old_per_token_logps") is None:
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
        return ScoredRound(
            gather_rows(self.accelerator, output, trl_seam.tokenizer(self).pad_token_id),
            rewards_per_func[:, self.accuracy_reward_index],
            (rewards_per_func, self.reward_weights),  # the columns TRL just weighted (the shaping column shown)
            scoring.row_stats,
        )

    # -------------------------------------------------------------------------------------- streaming rollout
    def _score_wave(self, rows: list[dict[str, Any]], prepared: dict[str, list]) -> ScoredRound:
        """A streamed part of a round, scored as a round is (`_score_round`), its completions already sampled."""
        engine = self._colocated_engine()
        # Colocated, TRL's own generation would call the engine the stream is stepping on another thread.
        scoring = RoundScoring(prepared, None if engine is None else engine.generate_turns, streamed=True)
        pending = trl_seam.metrics(self, "train")
        before = {name: len(values) for name, values in pending.items() if batch_metrics.replaced(name)}
        scored = self._score_round(rows, scoring)
        for name, values in pending.items():  # per-pass figures: the step's own come from the rows it decided on
            if batch_metrics.replaced(name):
                del values[before.get(name, 0) :]
        return scored

    def _build_streaming_rollout(self, args: DAPOConfig) -> StreamingRollout:
        if type(self).build_rollout_engine is DAPOTrainer.build_rollout_engine and not args.use_vllm:
            raise ValueError(
                "rollout_streaming needs vLLM: pass --use_vllm true with --vllm_mode server (and the server's "
                "--vllm_server_host / --vllm_server_port) or --vllm_mode colocate."
            )
        self.check_off_policy_correction(args)
        # At train end only a colocated engine must be free (the caller may generate with it next).
        return build_streaming_rollout(self, args, self._sampler, lambda: self._wait_for_rollout_engine(server=False))

    def check_off_policy_correction(self, args: DAPOConfig) -> None:
        """rollout_max_staleness >= 1 trains rows sampled by older weights; TRL corrects them with the truncated
        importance weight (vllm_importance_sampling_*) only from vLLM's sampling log-probs, so another engine at
        k >= 1 would train them uncorrected: refused."""
        if args.rollout_max_staleness >= 1 and not args.use_vllm:
            raise ValueError(
                f"rollout_max_staleness={args.rollout_max_staleness} with an engine of your own "
                "(build_rollout_engine) would train stale rows without the off-policy correction: TRL computes the "
                "importance weight only from vLLM's log-probs. Stream from a vLLM server (--use_vllm true "
                "--vllm_mode server --vllm_weight_sync shared_storage), or set --rollout_max_staleness 0."
            )

    @property
    def colocated_rollout_engines(self) -> bool:
        """Whether streaming drives an engine on every process (colocated vLLM) rather than one for all (a server)."""
        return self.args.use_vllm and self.args.vllm_mode == "colocate"

    def build_rollout_engine(self, max_in_flight: int) -> GroupEngine:
        """The engine streaming dynamic sampling sends group requests to: the vLLM server of `vllm_server_base_url`
        / `vllm_server_host:port` (built on the main process only), or with colocated vLLM this process's in-process
        engine (built on every process: `colocated_rollout_engines`). Override to stream from another engine (main
        process only)."""
        args = self.args
        sampling = SamplingSettings(
            n=self.num_generations,
            max_tokens=args.max_completion_length,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k or 0,
            min_p=args.min_p or 0.0,
            repetition_penalty=args.repetition_penalty,
            extra=dict(args.generation_kwargs or {}),
        )
        if self.colocated_rollout_engines:
            return VLLMColocateEngine(trl_seam.vllm_backend(self).llm, sampling, args.vllm_request_timeout)
        base_url = args.vllm_server_base_url or f"http://{args.vllm_server_host}:{args.vllm_server_port}"
        local_root, server_root = rollout_weights_dirs(args)
        return VLLMServerEngine(
            base_url, sampling, max_in_flight, args.vllm_request_timeout, server_root, reload_server_weights, local_root
        )

    def publish_rollout_weights(self, version: int) -> None:
        """Make the current weights (`version` = generation batches trained so far) available to the engine.

        Synchronous streaming (rollout_max_staleness 0) loads them now, as rounds do (TRL's sync: NCCL or shared
        storage). With staleness k the trainer writes them to vllm_weight_sync_dir/v<version> and the engine
        loads the version each batch needs when it starts that batch; versions no batch can need are deleted.
        """
        lag, driver = self.args.rollout_max_staleness, self._rollout.driver
        if not self.args.use_vllm:  # an engine of your own (`build_rollout_engine`): it loads versions itself
            if driver is not None:
                driver.publish(version)
            return
        # The engine gets this batch's weights below: the later turns of a tool loop (TRL's generation, on the same
        # engine) must sample with them, so TRL must not sync the current ones.
        trl_seam.set_weights_loaded(self, True)
        if lag == 0:
            self._wait_for_rollout_engine()  # the trainer may use it only while no streamed request runs
            trl_seam.vllm_backend(self).sync_weights()
            if driver is not None:
                driver.loaded_externally(version)
            return
        local_root, _ = rollout_weights_dirs(self.args)
        trl_seam.vllm_backend(self).publish_weights(os.path.join(local_root, f"v{version}"))
        if driver is not None:
            prune_versions(local_root, keep_from=version - lag)  # this batch samples from version - lag
            driver.publish(version)

    def _rollout_engine(self) -> GroupEngine | None:
        """The engine this process's streaming driver sends groups to, if it has one."""
        return None if self._rollout is None or self._rollout.driver is None else self._rollout.driver.engine

    def _colocated_engine(self) -> VLLMColocateEngine | None:
        """This process's colocated vLLM engine when streaming drives one, else None."""
        engine = self._rollout_engine()
        return engine if isinstance(engine, VLLMColocateEngine) else None

    def _wait_for_rollout_engine(self, server: bool = True) -> None:
        """Return once the streamed requests withdrawn before are gone from the engine, before TRL uses it (its
        weight sync, its own generation): a colocated engine is not thread-safe, and a server (`server`) still
        running an aborted request would refuse TRL's prefix-cache reset, or sample with two weights versions."""
        engine = self._rollout_engine()
        if isinstance(engine, VLLMColocateEngine):
            engine.wait_idle()
        elif server and isinstance(engine, VLLMServerEngine):
            engine.wait_server_idle(recover_within=self._rollout.driver.recovery_timeout)

    # --------------------------------------------------------------------------------------------- validation
    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """TRL's evaluation (`super().evaluate`), plus avg@n / pass@k per data source when the eval rows carry a
        `solution`, sampled with the eval sampling parameters (through the tool loop with tools) and logged with
        TRL's metrics: `dapo_trl.training.evaluation.evaluate_with_validation`."""
        driver = None if self._rollout is None else self._rollout.driver
        if driver is not None:  # evaluation syncs and samples the current weights: nothing streamed may run
            driver.withdraw()
            driver.loaded_externally(None)
            trl_seam.set_weights_loaded(self, False)  # the engine may hold an older version: TRL syncs
            self._wait_for_rollout_engine()
        return evaluation.evaluate_with_validation(self, super().evaluate, eval_dataset, ignore_keys, metric_key_prefix)

    # ----------------------------------------------------------------------------------------- checkpointing
    def _checkpointed_state(self) -> dict[str, Any]:
        """{file: part} for the run state beyond TRL's: the prompt stream and carried groups, the KL coefficient."""
        rollout = {} if self._rollout is None else {ROLLOUT_STATE_FILE: self._rollout}
        return {**self._sampler.checkpoint_files(), **self._shaping.checkpoint_files(), **rollout}

    def train(self, resume_from_checkpoint: str | bool | None = None, *args, **kwargs):
        """TRL's training; `resume_from_checkpoint` may be `latest` (or `true`): the newest complete checkpoint in
        output_dir, or a fresh start when there is none. A checkpoint that is not complete is refused, naming what
        it lacks (`training.checkpoints`). Runs inside `training.run_guard`: a preemption signal saves and stops,
        a failure on any process stops every process with its message."""
        resume = checkpoints.resolve_resume(resume_from_checkpoint, self.args.output_dir)
        return self._guard.run(partial(super().train, resume, *args, **kwargs))

    @property
    def preempted(self) -> bool:
        """Whether the last `train()` stopped for a preemption signal (`preemption_signals`), after saving a complete
        checkpoint: the same run continues with `resume_from_checkpoint="latest"`."""
        return self._guard.preempted

    def _save_checkpoint(self, model, trial):
        """TRL's checkpoint, then DAPO's state, then (every process done) the completion record; older checkpoints
        are rotated away only once this one is complete."""
        folder, limit = trl_seam.checkpoint_folder(self, trial), self.args.save_total_limit
        self.args.save_total_limit = None  # Trainer would rotate before DAPO's state and the record are written
        try:
            super()._save_checkpoint(model, trial)
            for file, part in self._checkpointed_state().items() if self.args.should_save else ():
                torch.save(part.state_dict(), os.path.join(folder, file))
            if self._rollout is not None and self.args.should_save:  # the older weights a resumed run samples from
                save_rollout_versions(self.args, self._rollout, folder)
        except (OSError, RuntimeError) as exc:
            raise checkpoints.save_failure(folder, exc) from exc
        finally:
            self.args.save_total_limit = limit
        self.accelerator.wait_for_everyone()  # every process's files (shards, RNG states) are written
        if self.args.should_save:
            checkpoints.mark_complete(folder)
            checkpoints.rotate(os.path.dirname(folder), limit, self.state.best_model_checkpoint)

    def _load_optimizer_and_scheduler(self, checkpoint):
        with checkpoints.cpu_loads_unindexed(self.args.device):  # transformers 5.17 on CPU with several processes
            super()._load_optimizer_and_scheduler(checkpoint)
        for file, part in self._checkpointed_state().items() if checkpoint is not None else ():
            if not os.path.exists(path := os.path.join(checkpoint, file)):
                raise checkpoints.IncompleteCheckpointError(
                    f"{checkpoint} has no {file}, which this run's settings need to resume exactly (it was saved "
                    "with dynamic sampling, streaming or KL in the reward set otherwise): resume with the settings "
                    "it was saved with."
                )
            part.load_state_dict(torch.load(path, map_location="cpu"), self.accelerator.device)
        if self._rollout is not None and checkpoint is not None and self.accelerator.is_main_process:
            restore_rollout_versions(self.args, checkpoint)
