"""Builds a trainer's streaming rollout: its driver and engine on the processes that generate, the rollout class for
where the engine runs (one server for all, or one engine per process), and the callback that stops it at train end;
and the trainer's dealings with that engine (its weights published, waiting until it is free).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from transformers import TrainerCallback

from .. import trl_seam
from ..sampling.dynamic_sampling import DynamicSampler
from .colocate_engine import VLLMColocateEngine
from .driver_stats import driver_metrics
from .rollout_driver import RolloutDriver
from .rollout_engine import GroupEngine, RequestSampling
from .rollout_stream import ColocatedStreamingRollout, ServerStreamingRollout, StreamingRollout
from .server_engine import VLLMServerEngine
from .vllm_server_api import ROLLOUT_WEIGHTS_FOLDER, prune_versions, reload_server_weights, shared_storage_dirs

if TYPE_CHECKING:
    from ...config import DAPOConfig


def build_streaming_rollout(
    trainer: Any, args: DAPOConfig, sampler: DynamicSampler, own_engine: bool
) -> StreamingRollout:
    """The streaming rollout of a DAPOTrainer (`rollout_streaming`), on every process.

    With a server only the main process builds a driver (its engine is `trainer.build_rollout_engine`); with
    colocated engines (`trainer.colocated_rollout_engines`) every process does. A failure to build one is raised on
    every process, so that none waits for the others in a collective. `own_engine`: the trainer overrides
    `build_rollout_engine` (an engine of the user's, which need not be vLLM).
    """
    if not own_engine and not args.use_vllm:
        raise ValueError(
            "rollout_streaming needs vLLM: pass --use_vllm true with --vllm_mode server (and the server's "
            "--vllm_server_host / --vllm_server_port) or --vllm_mode colocate."
        )
    check_off_policy_correction(args)
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
        held = held_bytes_bound(trainer, args, round_groups // args.filter_groups_oversample)
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
        except Exception as exc:  # noqa: BLE001 - raised on every process below, so none waits for the others
            error = f"{type(exc).__name__}: {exc}"
    errors = [error for error in sampler.process.gather_objects([error]) if error is not None]
    if errors:
        raise RuntimeError(f"streaming rollout: could not reach its engine: {errors[0]}")

    def tokenize(prompts: list[Any]) -> list[list[int]]:
        return trl_seam.tokenize_prompts(trainer, prompts)

    timing = {
        "staleness": args.rollout_max_staleness,
        "lookahead_rounds": args.rollout_lookahead_rounds,
        "wave_timeout": 2 * args.vllm_request_timeout + 60,
    }
    if colocated:
        rollout = ColocatedStreamingRollout(sampler, driver, tokenize, **timing)
    else:
        rollout = ServerStreamingRollout(
            sampler, driver, tokenize, _broadcaster(accelerator), **timing, scatter=_scatterer(accelerator)
        )
    if driver is not None:  # at train end only a colocated engine must be free (the caller may generate with it next)
        trainer.add_callback(CloseRollout(driver, partial(wait_for_engine, rollout, server=False)))
    return rollout


def check_off_policy_correction(args: DAPOConfig) -> None:
    """rollout_max_staleness >= 1 trains rows sampled by older weights; TRL corrects them with the truncated
    importance weight (vllm_importance_sampling_*) only from vLLM's sampling log-probs, so another engine at k >= 1
    would train them uncorrected: refused."""
    if args.rollout_max_staleness >= 1 and not args.use_vllm:
        raise ValueError(
            f"rollout_max_staleness={args.rollout_max_staleness} with an engine of your own "
            "(build_rollout_engine) would train stale rows without the off-policy correction: TRL computes the "
            "importance weight only from vLLM's log-probs. Stream from a vLLM server (--use_vllm true "
            "--vllm_mode server --vllm_weight_sync shared_storage), or set --rollout_max_staleness 0."
        )


def held_bytes_bound(trainer: Any, args: DAPOConfig, batch_groups: int) -> int:
    """What finished groups may hold for later waves before admission pauses: one batch at full length, every byte
    counted: int32 token ids and float32 log-probs (8 bytes a completion token), and with routing replay each
    token's routed experts (prompt tokens too, as the engine returns them; int32 as vLLM sends them, at most)."""
    rows = batch_groups * trainer.num_generations
    per_row = 8 * args.max_completion_length
    replayed = getattr(trainer, "_replayed_routing", None)
    if replayed is not None:
        tokens = args.max_completion_length + (args.max_prompt_length or args.max_completion_length)
        per_row += tokens * replayed.routing.layers * replayed.routing.top_k * 4
    return rows * per_row


def sample_streamed(rollout: StreamingRollout, inputs: list[dict[str, Any]], score_wave: Callable) -> tuple:
    """One generation batch from the stream, and its metrics (the driver's, on the process that has one)."""
    batch, metrics = rollout.sample(inputs, score_wave)
    wait = metrics.pop("rollout/trainer_wait_seconds")
    if rollout.driver is not None:
        metrics.update(driver_metrics(rollout.driver.take_metrics(), wait))
    return batch, metrics


def _broadcaster(accelerator: Any) -> Callable[[Any], Any]:
    """`broadcast(obj)`: the main process's object, on every process."""

    def broadcast(value: Any) -> Any:
        from accelerate.utils import broadcast_object_list

        box = [value]
        if accelerator.num_processes > 1:
            broadcast_object_list(box, from_process=0)
        return box[0]

    return broadcast


def _scatterer(accelerator: Any) -> Callable[[list[Any] | None], Any] | None:
    """`scatter(parts)`: the main process's `parts[p]` on process p (None with one process: nothing to send)."""
    if accelerator.num_processes == 1:
        return None

    def scatter(parts: list[Any] | None) -> Any:
        import torch.distributed as dist

        box: list[Any] = [None]
        dist.scatter_object_list(box, parts if accelerator.is_main_process else None, src=0)
        return box[0]

    return scatter


class CloseRollout(TrainerCallback):
    """Cancels what the streaming driver still runs when training ends (a later `train()` plans afresh), and waits
    until a colocated engine is free for the caller's own use."""

    def __init__(self, driver: RolloutDriver, wait_for_engine: Callable[[], None]):
        self.driver = driver
        self.wait_for_engine = wait_for_engine

    def on_train_end(self, args, state, control, **kwargs):
        self.driver.withdraw()
        self.wait_for_engine()


def vllm_rollout_engine(trainer: Any, max_in_flight: int) -> GroupEngine:
    """`DAPOTrainer.build_rollout_engine`'s default: the vLLM server's client, or this process's colocated engine."""
    args = trainer.args
    sampling = RequestSampling(
        n=trainer.num_generations,
        max_tokens=args.max_completion_length,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k or 0,
        min_p=args.min_p or 0.0,
        repetition_penalty=args.repetition_penalty,
        extra=dict(args.generation_kwargs or {}),
    )
    if trainer.colocated_rollout_engines:
        return VLLMColocateEngine(trl_seam.vllm_backend(trainer).llm, sampling, args.vllm_request_timeout)
    base_url = args.vllm_server_base_url or f"http://{args.vllm_server_host}:{args.vllm_server_port}"
    local_root, server_root = shared_storage_dirs(args)
    timeout = args.vllm_request_timeout
    return VLLMServerEngine(
        base_url,
        sampling,
        max_in_flight,
        timeout,
        server_root,
        reload_server_weights,
        local_root,
        in_flight_updates=args.rollout_in_flight_weight_updates,
        keep_kv_cache=args.rollout_in_flight_kv_cache == "keep",
        whole_answers=args.routing_replay,  # vLLM returns routed experts only in whole answers
        pause_timeout=args.ddp_timeout,  # a pause spans a weight transfer, which the process group bounds
    )


def publish_weights(trainer: Any, rollout: StreamingRollout, version: int) -> None:
    """Make the current weights (`version` = generation batches trained so far) available to the engine.

    Synchronous streaming (rollout_max_staleness 0) loads them now, as rounds do (TRL's sync: NCCL or shared
    storage). With staleness k the trainer writes them to vllm_weight_sync_dir/v<version> and the engine loads the
    version each batch needs when it starts that batch; versions no batch can need are deleted.
    """
    staleness, driver = trainer.args.rollout_max_staleness, rollout.driver
    if not trainer.args.use_vllm:  # an engine of your own (`build_rollout_engine`): it loads versions itself
        if driver is not None:
            driver.publish(version)
        return
    # The engine gets this batch's weights below: the later turns of a tool loop (TRL's generation, on the same
    # engine) must sample with them, so TRL must not sync the current ones.
    trl_seam.set_weights_loaded(trainer, True)
    if staleness == 0:
        wait_for_engine(rollout)  # the trainer may use it only while no streamed request runs
        trl_seam.vllm_backend(trainer).sync_weights()
        if driver is not None:
            driver.loaded_externally(version)
        return
    if trainer.args.vllm_weight_sync == "nccl":  # in-flight weight updates: TRL's transfer under the kept requests
        sync_in_flight(trainer, driver, version)
        return
    local_root, _ = shared_storage_dirs(trainer.args)
    trl_seam.vllm_backend(trainer).publish_weights(os.path.join(local_root, f"v{version}"))
    if driver is not None:
        prune_versions(local_root, keep_from=version - staleness)  # this batch samples from version - staleness
        driver.publish(version)


def sync_in_flight(trainer: Any, driver: RolloutDriver | None, version: int) -> None:
    """In-flight weight updates over NCCL (every process): the main process's driver pauses the server with its
    requests kept, every process takes part in TRL's weight transfer (ZeRO-3 gathers, the main process sends), and
    the driver marks the new version in the running answers and resumes them. NCCL sends only the current weights,
    which is what in-flight updates load: the newest version."""
    if driver is not None:
        driver.hold_for_sync()
    try:
        trl_seam.vllm_backend(trainer).sync_weights()
    except BaseException as exc:
        if driver is not None:  # the run stops with this error; it leaves no paused server, nor a driver waiting
            driver.sync_failed(exc)
        raise
    if driver is not None:
        driver.synced(version)


def streamed_engine(rollout: StreamingRollout | None) -> GroupEngine | None:
    """The engine this process's streaming driver sends groups to, if it has one."""
    return None if rollout is None or rollout.driver is None else rollout.driver.engine


def colocated_engine(rollout: StreamingRollout | None) -> VLLMColocateEngine | None:
    """This process's colocated vLLM engine when streaming drives one, else None."""
    engine = streamed_engine(rollout)
    return engine if isinstance(engine, VLLMColocateEngine) else None


def wait_for_engine(rollout: StreamingRollout | None, server: bool = True) -> None:
    """Return once the streamed requests withdrawn before are gone from the engine, before TRL uses it (its weight
    sync, its own generation): a colocated engine is not thread-safe, and a server (`server`) still running an
    aborted request would refuse TRL's prefix-cache reset, or sample with two weights versions."""
    engine = streamed_engine(rollout)
    if isinstance(engine, VLLMColocateEngine):
        engine.wait_idle()
    elif server and isinstance(engine, VLLMServerEngine):
        engine.wait_server_idle(recover_within=rollout.driver.recovery_timeout)


def release_engine(trainer: Any, rollout: StreamingRollout | None) -> None:
    """Before the trainer samples the current weights itself (evaluation): withdraw what streaming runs, and let TRL
    sync the weights (the engine may hold an older version)."""
    driver = None if rollout is None else rollout.driver
    if driver is not None:
        driver.withdraw()
        driver.loaded_externally(None)
        trl_seam.set_weights_loaded(trainer, False)
        wait_for_engine(rollout)


def save_rollout_versions(args: DAPOConfig, rollout: Any, checkpoint: str | Path) -> None:
    """Copy the weights versions the next batches sample from (older than the checkpoint's own) into it (none
    without a streaming rollout)."""
    import shutil

    if rollout is None:
        return
    root, _ = shared_storage_dirs(args)
    for version in range(max(0, rollout.generation - rollout.staleness), rollout.generation):
        source = Path(root) / f"v{version}"
        if source.is_dir():
            shutil.copytree(source, Path(checkpoint) / ROLLOUT_WEIGHTS_FOLDER / f"v{version}", dirs_exist_ok=True)


def restore_rollout_versions(args: DAPOConfig, checkpoint: str | Path) -> None:
    """Put a checkpoint's saved weights versions back where the server loads them from."""
    import shutil

    saved = Path(checkpoint) / ROLLOUT_WEIGHTS_FOLDER
    root, _ = shared_storage_dirs(args)
    for source in saved.glob("v*") if saved.is_dir() else ():
        shutil.copytree(source, Path(root) / source.name, dirs_exist_ok=True)
