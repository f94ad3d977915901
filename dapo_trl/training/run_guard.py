"""What `DAPOTrainer.train` runs inside: preemption signals (`preemption`), Ctrl-C, and one process's failure reaching
every process (`fail_together`); on any failure or interrupt the streaming rollout stops sampling for the run."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from . import trl_seam
from .fail_together import FailTogether, launcher_store
from .preemption import Preemption, agreement, parse_signals
from .vllm_backends import abort_requests


class RunGuard:
    """Built with the trainer (its preemption callback is added there); `run(train)` calls `train()` guarded."""

    def __init__(self, trainer: Any):
        args, accelerator = trainer.args, trainer.accelerator
        self.trainer = trainer
        signals = parse_signals(args.preemption_signals)
        self.preemption = Preemption(
            signals,
            args.preemption_grace_seconds,
            agreement(accelerator),
            args.output_dir,
            on_interrupt=self.abort_requests,
        )
        trainer.add_callback(self.preemption)
        self.fail_together = FailTogether(
            accelerator.process_index,
            accelerator.num_processes,
            launcher_store(),
            on_peer_failure=self.withdraw_rollout,
        )

    @property
    def preempted(self) -> bool:
        return self.preemption.preempted

    def run(self, train: Callable[[], Any]) -> Any:
        try:
            return self.fail_together.run(train)
        except BaseException:
            self.withdraw_rollout()  # a failure or Ctrl-C: the engine stops sampling for this run now
            raise
        finally:
            self.preemption.restore_signals()

    def abort_requests(self) -> None:
        """Ctrl-C: TRL's server requests in flight fail at once (the rollout's are withdrawn as `run` unwinds)."""
        if self.trainer.args.use_vllm:
            abort_requests(trl_seam.vllm_backend(self.trainer))

    def withdraw_rollout(self) -> None:
        rollout = self.trainer._rollout
        if rollout is not None and rollout.driver is not None:
            rollout.driver.withdraw()
