"""A vLLM server's HTTP API as this package calls it: every request bounded by a timeout and its failure named by
method and URL (`VLLMServerError`; `VLLMServerUnavailable` when the server cannot be reached, which may be a restart);
TRL's own client given the same bounds (`add_timeouts`, TRL #6913); and the weights a dev-mode server reloads from
shared storage (`save_weights`, `reload_server_weights`, the version folders of the streaming rollout).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import requests
import torch
import urllib3

from ...utils.http import HTTPClient, RequestFailed, RetryPolicy, TimeoutAdapter
from .rollout_engine import EngineUnavailable

if TYPE_CHECKING:
    from ...config import DAPOConfig

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


# ------------------------------------------------------------------------ weight versions of the streaming rollout
ROLLOUT_WEIGHTS_FOLDER = "rollout_weights"


def shared_storage_dirs(args: DAPOConfig) -> tuple[str, str]:
    """(as the trainer writes it, as the server reads it): the shared-storage folder of the weights the server
    reloads; the streaming rollout keeps its versions v<n> under it."""
    local = args.vllm_weight_sync_dir or os.path.join(args.output_dir, "vllm_weights")
    return local, args.vllm_weight_sync_server_dir or local


def prune_versions(root: str | Path, keep_from: int) -> None:
    """Delete weights versions below `keep_from` (no batch can sample from them any more)."""
    for path in Path(root).glob("v*"):
        if path.name[1:].isdigit() and int(path.name[1:]) < keep_from:
            shutil.rmtree(path, ignore_errors=True)
