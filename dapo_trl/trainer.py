"""DAPOTrainer: TRL's GRPOTrainer with DAPO's reward shaping, exact token-level loss and dynamic sampling.

The trainer only orchestrates: every override calls `super()` but `_compute_loss`, which trains the loss of the
table in `dapo_trl.algorithm.losses` (`training.step.policy_loss`: bit for bit TRL's where TRL has the loss); every
private TRL name it touches is listed and checked in `dapo_trl.training.trl_seam`. The step machinery (dynamic
sampling, streaming, micro-batches, forwards, reward columns, exact denominators, checkpoints) is `dapo_trl.training`.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Any

import torch
from accelerate.utils import gather, gather_object
from trl import GRPOTrainer

from .builtin_models import resolve_builtin_model
from .config import DAPOConfig
from .moe.architecture import set_zero3_leaf_modules
from .rewards import dapo_math_reward
from .rewards.verl_default import check_dataset_sources
from .tools.runtime import ToolRuntime
from .training import trl_seam
from .training.faults import checkpoints
from .training.faults.run_guard import RunGuard
from .training.rollout import rollout_setup
from .training.rollout.rollout_engine import GroupEngine
from .training.rollout.rollout_stream import ROLLOUT_STATE_FILE
from .training.rollout.vllm_backends import backend_for
from .training.sampling import batch_metrics, evaluation, streams
from .training.sampling.dynamic_sampling import DynamicSampler, Process, ScoredRound, gather_rows, row_padding
from .training.sampling.old_logprobs import OldLogProbs
from .training.sampling.reference import build_reference_model, needs_own_reference
from .training.sampling.round_scoring import RoundScoring, complete_round_rows
from .training.sampling.shaping import GenerationRecord, ShapingColumns
from .training.step import steps
from .training.step.batching import (
    StepPlanner,
    TokenWeightedMetrics,
    backward_without_sync,
    loss_mask,
    process_share,
)
from .training.step.forwards import TokenForwards
from .training.step.policy_loss import PolicyLossStep
from .training.step.replayed_routing import (
    replayed_routing_for,
    replaying_round,
    routing_files,
    settle_routings,
    with_routings,
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
        model = resolve_builtin_model(model) if isinstance(model, str) else model  # "builtin:tiny" as on the CLI
        args = DAPOConfig.for_trainer(args, model)
        trl_seam.check_trl_classes(trl_seam.CLASS_NAMES + (trl_seam.WITH_VLLM if args.use_vllm else ()))
        env_factory = kwargs.get("environment_factory")
        with backend_for(args, model):
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
        self._old_logprobs = OldLogProbs(args)  # pi_old: TRL's scoring forward, or the engine's log-probs
        pad_token_id, router_aux_loss = trl_seam.tokenizer(self).pad_token_id, self.aux_loss_enabled
        set_zero3_leaf_modules(self.model, self.accelerator)  # MoE blocks gathered whole: no hang when routes differ
        self._forwards = TokenForwards(args, self.accelerator, self.model, pad_token_id, router_aux_loss)
        self._token_metrics = TokenWeightedMetrics()
        self._policy_loss = PolicyLossStep(self, self._get_per_token_logps_and_entropies)  # the loss table's
        self._planner = StepPlanner(args, self.accelerator, self.loss_type, self._forwards.group_passes)
        self._optimizer_steps = steps.OptimizerSteps(args, self.accelerator.device, self._planner.exact_denominator)
        self.add_callback(steps.SkipEmptySteps(self, self._optimizer_steps))  # a step without a loss token: no change
        self._guard = RunGuard(self)  # preemption, Ctrl-C, one process failing: `train` runs inside it
        if args.val_before_train:
            self.add_callback(evaluation.ValidateBeforeTraining(self))
        self.train_dataset = streams.trainable_prompts(self, self.train_dataset)  # overlong prompts dropped
        process = Process(self.accelerator.process_index, self.accelerator.num_processes, gather_object)
        padding, shuffle = row_padding(trl_seam.tokenizer(self).pad_token_id), self.shuffle_dataset
        self._sampler = DynamicSampler(
            args, self.train_dataset, self.num_generations, padding, process, shuffle, self._guard.preemption
        )
        self._replayed_routing = replayed_routing_for(self, self._forwards.router_hooks)  # after the sampler
        self._rollout = None
        if args.rollout_streaming:
            own_engine = type(self).build_rollout_engine is not DAPOTrainer.build_rollout_engine
            self._rollout = rollout_setup.build_streaming_rollout(self, args, self._sampler, own_engine)

    # ----------------------------------------------------------------------------------------------------- rewards
    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        self._shaping.hide(self)  # TRL scores the user's functions alone (a round may follow a shown one)
        with self._guard.scoring_rewards():  # a preemption interrupts the user's functions: a safe point
            rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        rewards_per_func = self._shaping.append(self, rewards_per_func, completion_ids_list, gather, self._generation)
        if self._round is not None:  # a dynamic-sampling round (`_score_round`) reads its accuracy
            self._round.rewards_per_func = rewards_per_func
            if self._round.streamed:
                self._round.row_stats = batch_metrics.streamed_row_statistics(
                    self, rewards_per_func, completion_ids_list, self._generation.output
                )
        return rewards_per_func

    # -------------------------------------------------------------- micro-batches: balance, exact denominator
    def _get_dataloader(self, dataset, *args, **kwargs):  # TRL's loader, each process slicing one whole stream
        return super()._get_dataloader(streams.whole_stream(dataset, self.accelerator.num_processes), *args, **kwargs)

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        if steps.resumed_at_max_steps(self.state, self.control):  # Trainer would train a step past max_steps
            return [], None
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
        self._guard.safe_point("before generating a batch")
        scored = self._generate_and_score_completions(generation_batch)
        micro_batches = trl_seam.shuffle_and_split(scored, self.args.steps_per_generation)
        # Routing replay: the shelves keep this batch's routings and those of the micro-batches still training.
        return self._planner.plan(settle_routings(self, micro_batches, self._optimizer_steps.in_use()))

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """With a token budget, all but the last part of the micro-batch are backpropagated here, without a sync;
        each part carries its share of the micro-batch, which weighs each of its loss terms (`StepPlanner.parts`)."""
        *parts, last = self._planner.parts(with_routings(self, inputs))  # routing replay: fetched as it trains
        self._policy_loss.begin_micro_batch(model, [*parts, last])  # the router loss's micro-batch, when split
        earlier = 0.0
        for part in parts:
            loss = self._weighted_loss(model, part, return_outputs, num_items_in_batch)
            backward_without_sync(self, model, loss, num_items_in_batch)
            earlier += loss.detach()
        return self._weighted_loss(model, last, return_outputs, num_items_in_batch) + earlier

    def _compute_loss(self, model, inputs):
        """The policy loss of `loss_type` from the table in `dapo_trl.algorithm.losses`, with every term of TRL's
        (`training.step.policy_loss.PolicyLossStep`): replaces TRL's, so what a reader finds there is what trains."""
        return self._policy_loss(model, inputs)

    def _weighted_loss(self, model, inputs, return_outputs, num_items_in_batch):
        """The loss of one pass (`_compute_loss`), its token count recorded for per-token metrics."""
        self._guard.safe_point("before a training forward")  # each micro-batch, and each part of one
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

    # ---------------------------------------------------------------------- forwards: padding-free, sharded
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
        """Every training forward goes through here (`training.step.forwards`: padding-free, sequence-parallel)."""
        skipped = self._old_logprobs.skipped_forward(model, self, input_ids, logits_to_keep)
        if skipped is not None:  # pi_old from the engine: TRL's scoring forward is not run
            return skipped
        flags = {"compute_entropy": compute_entropy, "compute_aux_loss": compute_aux_loss}
        trl_forward = partial(super()._get_per_token_logps_and_entropies, model)
        routing = None  # routing replay: the policy's forwards route as the engine did
        if self._replayed_routing is not None and self.accelerator.unwrap_model(model) is self.model:
            routing = self._replayed_routing.for_forward(input_ids, attention_mask)
        logps, *rest = self._forwards.per_token(
            model, trl_forward, input_ids, attention_mask, logits_to_keep, batch_size, flags, multimodal, routing
        )
        if not torch.is_grad_enabled():  # TRL's old and reference log-probs: KL in the reward reuses them
            self._generation.record_forward(self, model, input_ids, attention_mask, logps)
        return (logps, *rest)

    # ------------------------------------------------------------------------------------------------ tool use
    def _generate(self, prompts: list):
        """TRL's generation (and tool loop); then tool metrics, and prefetched executions nobody used are dropped."""
        training = self.model.training  # read first: TRL's paged generation leaves the model in train mode
        self._guard.interruptible_tools()
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
        turn = None if self._round is None else self._round.sampled_turn(prompt_ids)  # streamed: sampled already
        completion_ids, logprobs = turn or super()._generate_single_turn(prompt_ids, *args, **kwargs)
        self._guard.check_round(completion_ids)  # a server round aborted for a preemption: the step is abandoned
        self._tool_runtime.on_turn(prompt_ids, completion_ids)
        return completion_ids, logprobs

    # ---------------------------------------------------------------------------------------- dynamic sampling
    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        try:
            if not (self.model.training and (self.args.filter_groups_enable or self._rollout is not None)):
                return self._old_logprobs.score(self, partial(super()._generate_and_score_completions, inputs))
            if self._rollout is None:
                batch, metrics = self._sampler.sample(inputs, self._score_round)
            else:
                self.publish_rollout_weights(self._rollout.generation)
                batch, metrics = rollout_setup.sample_streamed(self._rollout, inputs, self._score_wave)
            for name, value in metrics.items():
                trl_seam.metrics(self, "train")[name].append(value)
            return process_share(batch, self.args, self.accelerator)  # every process holds the whole batch
        finally:
            self._shaping.hide(self)  # the user's reward lists again, once the batch is scored

    def _score_round(self, round_inputs: list[dict[str, Any]], scoring: RoundScoring | None = None) -> ScoredRound:
        """One TRL generation + scoring pass, gathered from every process, with the raw accuracy of each row. With
        carried surplus on, behaviour-policy log-probs are stored too: a carried group trains one step later, so its
        ratio must be against the policy that sampled it."""
        self._round = scoring = scoring or RoundScoring()
        with replaying_round(self, scoring) as replayed:  # routing replay: forwards route as the engine did
            try:
                with self._old_logprobs.scoring(self):
                    output = super()._generate_and_score_completions(round_inputs)
                rewards_per_func = scoring.rewards_per_func  # TRL's gathered rewards of this round, (rows, funcs)
            finally:
                self._round = None
            complete_round_rows(self, output, scoring, replayed)
        return ScoredRound(
            gather_rows(self.accelerator, output, trl_seam.tokenizer(self).pad_token_id),
            rewards_per_func[:, self.accuracy_reward_index],
            (rewards_per_func, self.reward_weights),  # the columns TRL just weighted (the shaping column shown)
            scoring.row_stats,
        )

    # -------------------------------------------------------------------------------------- streaming rollout
    def _score_wave(self, rows: list[dict[str, Any]], prepared: dict[str, list]) -> ScoredRound:
        """A streamed part of a round, scored as a round is (`_score_round`), its completions already sampled."""
        engine = rollout_setup.colocated_engine(self._rollout)
        # Colocated, TRL's own generation would call the engine the stream is stepping on another thread.
        scoring = RoundScoring.of_wave(prepared, None if engine is None else engine.generate_turns)
        with batch_metrics.per_pass_figures_dropped(trl_seam.metrics(self, "train")):  # the step's come from its rows
            return self._score_round(rows, scoring)

    @property
    def colocated_rollout_engines(self) -> bool:
        """Whether streaming drives an engine on every process (colocated vLLM) rather than one for all (a server)."""
        return self.args.use_vllm and self.args.vllm_mode == "colocate"

    def build_rollout_engine(self, max_in_flight: int) -> GroupEngine:
        """The engine streaming dynamic sampling sends group requests to: the vLLM server of `vllm_server_base_url`
        / `vllm_server_host:port` (built on the main process only), or with colocated vLLM this process's in-process
        engine (built on every process: `colocated_rollout_engines`). Override to stream from another engine (main
        process only)."""
        return rollout_setup.vllm_rollout_engine(self, max_in_flight)

    def publish_rollout_weights(self, version: int) -> None:
        """Make the current weights (`version` = generation batches trained so far) available to the engine
        (`rollout_setup.publish_weights`: now, or as a version the engine loads when a batch needs it)."""
        rollout_setup.publish_weights(self, self._rollout, version)

    # --------------------------------------------------------------------------------------------- validation
    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """TRL's evaluation (`super().evaluate`), plus avg@n / pass@k per data source when the eval rows carry a
        `solution`, sampled with the eval sampling parameters (through the tool loop with tools) and logged with
        TRL's metrics: `dapo_trl.training.sampling.evaluation.evaluate_with_validation`."""
        rollout_setup.release_engine(self, self._rollout)  # evaluation syncs and samples the current weights
        return evaluation.evaluate_with_validation(self, super().evaluate, eval_dataset, ignore_keys, metric_key_prefix)

    # ----------------------------------------------------------------------------------------- checkpointing
    def _checkpointed_state(self) -> dict[str, Any]:
        """{file: part} for the run state beyond TRL's: the prompt stream and carried groups, the KL coefficient."""
        rollout = {} if self._rollout is None else {ROLLOUT_STATE_FILE: self._rollout}
        return {**self._sampler.checkpoint_files(), **self._shaping.checkpoint_files(), **rollout}

    def _process_state(self) -> dict[str, Any]:
        """{file stem: part} for each process's own run state: a generation batch still in training."""
        return {steps.OPTIMIZER_STEPS_FILE: self._optimizer_steps, **routing_files(self._replayed_routing)}

    def train(self, resume_from_checkpoint: str | bool | None = None, *args, **kwargs):
        """TRL's training; `resume_from_checkpoint` may be `latest` (or `true`): the newest complete checkpoint in
        output_dir, or a fresh start when there is none. A checkpoint that is not complete is refused, naming what
        it lacks (`training.faults.checkpoints`). Runs inside `training.faults.run_guard`: a preemption signal saves
        and stops, a failure on any process stops every process with its message."""
        resume = checkpoints.resolve_resume(resume_from_checkpoint, self.args.output_dir)
        return self._guard.run(partial(super().train, resume, *args, **kwargs))

    @property
    def preempted(self) -> bool:
        """Whether the last `train()` stopped for a preemption signal (`preemption_signals`), after saving a complete
        checkpoint: the same run continues with `resume_from_checkpoint="latest"`."""
        return self._guard.preempted

    def _save_checkpoint(self, model, trial):
        """TRL's checkpoint, then DAPO's state, then (every process done) the completion record; older checkpoints
        are rotated away only once this one is complete (`training.faults.checkpoints`)."""
        folder = trl_seam.checkpoint_folder(self, trial)
        versions = partial(rollout_setup.save_rollout_versions, self.args, self._rollout)  # older weights, k >= 1
        with checkpoints.complete_save(self, folder, self._checkpointed_state, versions, self._process_state):
            super()._save_checkpoint(model, trial)

    def _load_optimizer_and_scheduler(self, checkpoint):
        with checkpoints.cpu_loads_unindexed(self.args.device):  # transformers 5.17 on CPU with several processes
            super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is not None:
            checkpoints.load_run_state(checkpoint, self._checkpointed_state(), self.accelerator.device)
            own, accelerator = self._process_state(), self.accelerator
            checkpoints.load_process_state(
                checkpoint, own, accelerator.process_index, accelerator.num_processes, accelerator.device
            )
            if self._optimizer_steps.resumed_micro_step is not None:
                trl_seam.set_micro_step(self, self._optimizer_steps.resumed_micro_step)
            if self._rollout is not None and self.accelerator.is_main_process:
                rollout_setup.restore_rollout_versions(self.args, checkpoint)
