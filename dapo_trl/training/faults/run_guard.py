"""What `DAPOTrainer.train` runs inside: preemption signals (`preemption`), Ctrl-C, and one process's failure reaching
every process (`fail_together`); on any failure or interrupt the streaming rollout stops sampling for the run. A step
abandoned for a preemption (`StepAbandoned`, raised on every process at the same safe point) ends here: the last
completed step is saved and `train()` returns."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import torch
from transformers.trainer_utils import TrainOutput

from .. import trl_seam
from ..rollout.vllm_server_api import abort_requests
from .fail_together import FailTogether, launcher_store
from .preemption import (
    Preemption,
    SignalRelay,
    StepAbandoned,
    StepEndState,
    agreement,
    is_abandoned_round,
    parse_signals,
)
from .user_code import interruptible_tool

logger = logging.getLogger(__name__)
RELEASE_WAIT_SECONDS = 10.0  # at train()'s end, how long a weight load in progress may take to resume the server


class RunGuard:
    """Built with the trainer (its preemption callback is added there); `run(train)` calls `train()` guarded."""

    def __init__(self, trainer: Any):
        args, accelerator = trainer.args, trainer.accelerator
        self.trainer = trainer
        store = launcher_store()
        self.preemption = Preemption(
            parse_signals(args.preemption_signals),
            args.preemption_grace_seconds,
            agreement(accelerator),
            args.output_dir,
            on_interrupt=self.abort_requests,
            on_give_up=partial(self.release_server, "the preemption grace period ran out"),
            snapshot=self.snapshot,
            relay=SignalRelay(accelerator.process_index, store if accelerator.num_processes > 1 else None),
            num_processes=accelerator.num_processes,
        )
        trainer.add_callback(self.preemption)
        self._interruptible_tool = partial(
            interruptible_tool, region=self.preemption.interruptible, requested=self.preemption.requested
        )
        client = getattr(getattr(trainer, "vllm_generation", None), "vllm_client", None)  # server mode, main process
        progress = getattr(client, "generation_progress", None)  # `watch_generation`'s: a round aborts when signalled
        if progress is not None:
            progress.abandon_when = self.preemption.requested
        self.fail_together = FailTogether(
            accelerator.process_index,
            accelerator.num_processes,
            store,
            on_peer_failure=self.withdraw_rollout,
        )

    @property
    def preempted(self) -> bool:
        return self.preemption.preempted

    def run(self, train: Callable[[], Any]) -> Any:
        try:
            return self.fail_together.run(partial(self._train_or_stop, train))
        except BaseException:
            self.withdraw_rollout()  # a failure or Ctrl-C: the engine stops sampling for this run now
            raise
        finally:
            self.preemption.restore_signals()
            self.release_server("train() ended", wait=RELEASE_WAIT_SECONDS)

    def _train_or_stop(self, train: Callable[[], Any]) -> Any:
        try:
            return train()
        except StepAbandoned as abandoned:  # every process, at the same safe point
            return self._stop(abandoned)

    def interruptible_tools(self) -> None:
        """A tool call (a sandbox, a search, a remote service, an environment's method) never holds a preemption
        past its grace: the tools of this batch's tables, which TRL builds before its generation, are wrapped."""
        trl_seam.wrap_tool_tables(self.trainer, self._interruptible_tool)

    def safe_point(self, where: str) -> None:
        """A point of a training step that every process reaches in the same order (`Preemption.safe_point`)."""
        if self.trainer.model.training:
            self.preemption.safe_point(where)

    @contextlib.contextmanager
    def scoring_rewards(self) -> Iterator[None]:
        """Within the block TRL scores a batch's rewards with the user's functions (a judge, a sandbox, a remote
        service may take minutes): a preemption signal interrupts them, and every process agrees before TRL gathers
        the rewards, abandoning the step together (`Preemption.user_code`). Reward models (`nn.Module`) run
        forwards, whose collectives under ZeRO-3 cannot be interrupted on one process alone: with one, the block
        is plain and the step is abandoned at the next safe point, as before."""
        trainer = self.trainer
        if not trainer.model.training or any(isinstance(func, torch.nn.Module) for func in trainer.reward_funcs):
            yield
            return
        with self.preemption.user_code("while scoring rewards") as finished, trl_seam.before_reward_gather(finished):
            yield

    def check_round(self, completion_ids: list) -> None:
        """After TRL's generation round, on every process: a round the main process abandoned for a preemption
        (`watch_generation`: every process got its `AbandonedRound` markers from TRL's broadcast) abandons the step."""
        if is_abandoned_round(completion_ids):
            self.preemption.abandon("during a generation round")

    # ------------------------------------------------------------------------------ the last completed step
    def snapshot(self) -> StepEndState:
        """At a step's end (where a periodic checkpoint is written): what the next step changes before its end."""
        trainer = self.trainer
        state = trainer.state
        counters = {
            "total_flos": state.total_flos,
            "current_flos": trainer.current_flos,
            "num_input_tokens_seen": state.num_input_tokens_seen,
        }
        return StepEndState.capture(
            state.global_step, trainer._checkpointed_state(), trainer._process_state(), counters
        )

    def _stop(self, abandoned: StepAbandoned) -> TrainOutput:
        """Drop the abandoned step's work and write the checkpoint of the last completed step, unless it exists
        (written already, or the one this run resumed from; a run stopped in its first step has none: requeued, it
        starts fresh, as this one did); then end `train()` as transformers does."""
        trainer, preemption, state = self.trainer, self.preemption, self.trainer.state
        rollout = trainer._rollout
        ahead = {} if rollout is None else rollout.groups_ahead()  # generated ahead, as far as they got: kept
        self.withdraw_rollout()  # the abandoned groups are regenerated by key and seed on resume
        trainer.model_wrapped.zero_grad()  # the abandoned micro-batches' gradients
        if trainer.is_deepspeed_enabled:  # ZeRO accumulates in its own partitions, and counts micro-steps
            trainer.model_wrapped.optimizer.zero_grad()
        if state.global_step > preemption.saved_step:
            started = time.monotonic()
            self._restore(preemption.step_end)
            if rollout is not None:  # as a periodic checkpoint keeps them (in-flight weight updates)
                rollout.keep_ahead(ahead)
            trainer._save_checkpoint(trainer.model_wrapped, None)
            trainer.control = trainer.callback_handler.on_save(trainer.args, state, trainer.control)
            saved = f"checkpoint-{state.global_step} written in {time.monotonic() - started:.1f} s"
        else:
            saved = f"nothing newer than checkpoint-{state.global_step}" if state.global_step else "no step completed"
        preemption.preempted = True
        signalled = (
            f"{preemption.abandoned_at - preemption.signalled_at:.1f} s after this process's signal"
            if preemption.received
            else "for another process's signal"
        )
        logger.warning(
            "preempted: abandoned optimizer step %d %s, %s; %s",
            state.global_step + 1,
            abandoned.where,
            signalled,
            saved,
        )
        trainer.control = trainer.callback_handler.on_train_end(trainer.args, state, trainer.control)
        trainer.is_in_train = False
        return TrainOutput(state.global_step, float("nan"), {})

    def _restore(self, step_end: StepEndState | None) -> None:
        """The last completed step's RNG states, run state and counters, as its checkpoint would have held them."""
        trainer = self.trainer
        if step_end is None or step_end.step != trainer.state.global_step:
            raise RuntimeError(f"no snapshot of the end of step {trainer.state.global_step} to save")
        step_end.restore(trainer._checkpointed_state(), trainer._process_state(), trainer.accelerator.device)
        trainer.state.total_flos = step_end.counters["total_flos"]
        trainer.state.num_input_tokens_seen = step_end.counters["num_input_tokens_seen"]
        trainer.current_flos = step_end.counters["current_flos"]

    # ------------------------------------------------------------------------------------------- interrupts
    def abort_requests(self) -> None:
        """Ctrl-C: TRL's server requests in flight fail at once (the rollout's are withdrawn as `run` unwinds)."""
        if self.trainer.args.use_vllm:
            abort_requests(trl_seam.vllm_backend(self.trainer))

    def withdraw_rollout(self) -> None:
        """The engine stops sampling for this run (a failure, Ctrl-C, another process's failure, a preemption), and
        a server it holds paused is resumed."""
        rollout = self.trainer._rollout
        if rollout is not None and rollout.driver is not None:
            try:
                rollout.driver.withdraw()
            finally:
                self.release_server("the run is stopping")

    def release_server(self, why: str, wait: float = 0.0) -> None:
        """Resume the vLLM server if the rollout's engine left it paused (between `/pause` and `/resume`: a weight
        update cut short), so that no exit path leaves it queueing every request behind the pause. `wait`: seconds
        a load still running on the driver's thread may take to resume it itself (the end of `train()`)."""
        rollout = self.trainer._rollout
        engine = None if rollout is None or rollout.driver is None else rollout.driver.engine
        release = getattr(engine, "release_pause", None)
        if release is not None:
            release(why, wait)
