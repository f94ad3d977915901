"""Builds a trainer's streaming rollout: its driver and engine on the processes that generate, the rollout class for
where the engine runs (one server for all, or one engine per process), and the callback that stops it at train end.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from transformers import TrainerCallback

from . import trl_seam
from .rollout_driver import RolloutDriver
from .rollout_stream import ColocatedStreamingRollout, ServerStreamingRollout, StreamingRollout
from .sampling import DynamicSampler


def build_streaming_rollout(
    trainer: Any, args: Any, sampler: DynamicSampler, wait_for_engine: Callable[[], None]
) -> StreamingRollout:
    """The streaming rollout of a DAPOTrainer (`rollout_streaming`), on every process.

    With a server only the main process builds a driver (its engine is `trainer.build_rollout_engine`); with
    colocated engines (`trainer.colocated_rollout_engines`) every process does. A failure to build one is raised on
    every process, so that none waits for the others in a collective.
    """
    if getattr(trainer, "environment_factories", None):
        raise ValueError(
            "rollout_streaming does not run TRL environments (environment_factory) yet: turn it off, or pass the "
            "environment's tools as tools=[...] (the tool loop streams)."
        )
    accelerator, colocated = trainer.accelerator, trainer.colocated_rollout_engines
    round_groups = (
        args.per_device_train_batch_size
        * args.steps_per_generation
        * accelerator.num_processes
        * args.filter_groups_oversample
        // trainer.num_generations
    )
    driver, error = None, None
    in_flight = args.rollout_max_in_flight_groups or round_groups
    if accelerator.is_main_process or colocated:
        # Finished groups held for later waves: at most one batch at full length (int32 ids + float32 log-probs).
        held = round_groups * trainer.num_generations * args.max_completion_length // args.filter_groups_oversample
        try:
            backend = trl_seam.vllm_backend(trainer) if args.use_vllm else None
            reload_external = getattr(backend, "reload_synced_weights", None)  # shared-storage sync, server mode
            # A restarted server has no NCCL communicator with the trainer: only shared storage can reload it.
            nccl = args.use_vllm and args.vllm_weight_sync == "nccl"
            recovery = 0.0 if nccl else args.vllm_server_recovery_timeout
            driver = RolloutDriver(
                trainer.build_rollout_engine(in_flight),
                in_flight,
                None if colocated else held,
                recovery,
                reload_external,
            )
            trainer.add_callback(CloseRollout(driver, wait_for_engine))
        except Exception as exc:  # noqa: BLE001 - raised on every process below, so none waits for the others
            error = f"{type(exc).__name__}: {exc}"
    errors = [error for error in sampler.process.gather_objects([error]) if error is not None]
    if errors:
        raise RuntimeError(f"streaming rollout: could not reach its engine: {errors[0]}")

    def tokenize(prompts: list[Any]) -> list[list[int]]:
        return trl_seam.tokenize_prompts(trainer, prompts)

    timing = {
        "lag": args.rollout_max_staleness,
        "lookahead_rounds": args.rollout_lookahead_rounds,
        "wave_timeout": 2 * args.vllm_request_timeout + 60,
    }
    if colocated:
        return ColocatedStreamingRollout(sampler, driver, tokenize, **timing)
    return ServerStreamingRollout(sampler, driver, tokenize, _broadcaster(accelerator), **timing)


def _broadcaster(accelerator: Any) -> Callable[[Any], Any]:
    """`broadcast(obj)`: the main process's object, on every process."""

    def broadcast(value: Any) -> Any:
        from accelerate.utils import broadcast_object_list

        box = [value]
        if accelerator.num_processes > 1:
            broadcast_object_list(box, from_process=0)
        return box[0]

    return broadcast


class CloseRollout(TrainerCallback):
    """Cancels what the streaming driver still runs when training ends (a later `train()` plans afresh), and waits
    until a colocated engine is free for the caller's own use."""

    def __init__(self, driver: RolloutDriver, wait_for_engine: Callable[[], None]):
        self.driver = driver
        self.wait_for_engine = wait_for_engine

    def on_train_end(self, args, state, control, **kwargs):
        self.driver.withdraw()
        self.wait_for_engine()
