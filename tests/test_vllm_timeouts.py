"""Timeouts on every request to a vLLM server, against real local HTTP servers (no vLLM needed).

TRL's client has no timeout beyond its first health check (TRL #6913): a hung or dead server would hang training.
"""

import time
from types import SimpleNamespace

import pytest
import requests

from dapo_trl.training.rollout import vllm_backends
from dapo_trl.training.rollout.vllm_backends import VLLMBackend, make_timeout_backend
from dapo_trl.training.rollout.vllm_server_api import VLLMServerError, VLLMServerUnavailable, add_timeouts
from dapo_trl.utils.http import TimeoutAdapter

from .helpers import StubServer


@pytest.fixture
def hanging_server():
    """A server that answers only after 10 s, longer than the client's timeout (cut short at teardown)."""
    with StubServer(lambda index, body: (200, {}, {}, 10.0)) as server:
        yield server.base_url


def trl_like_client() -> SimpleNamespace:
    """A session set up the way TRL's VLLMClient sets up its own (5 retries, back-off 2, POST retried)."""
    from requests.adapters import HTTPAdapter
    from urllib3.util.retry import Retry

    session = requests.Session()
    retry = Retry(
        total=5,
        read=5,
        connect=5,
        status=3,
        backoff_factor=2,
        status_forcelist=[500, 502, 503],
        allowed_methods=["POST", "GET"],
    )
    session.mount("http://", HTTPAdapter(max_retries=retry))
    return SimpleNamespace(session=session, base_url="http://127.0.0.1:8000", generate=lambda *args, **kwargs: None)


def test_hung_server_fails_within_the_timeout_naming_the_url(hanging_server):
    client = trl_like_client()
    add_timeouts(client, 0.5)
    start = time.monotonic()
    with pytest.raises(VLLMServerError, match=f"POST {hanging_server}/v1/completions") as raised:
        client.session.post(f"{hanging_server}/v1/completions", json={})
    assert time.monotonic() - start < 3  # no read retries: one timeout, not six plus back-off
    assert not isinstance(raised.value, VLLMServerUnavailable)  # slow, not gone: never waited for as a restart


def test_dead_server_fails_within_seconds():
    client = trl_like_client()
    add_timeouts(client, 5.0)
    start = time.monotonic()
    with pytest.raises(VLLMServerUnavailable, match="http://127.0.0.1:9/health"):  # may be restarting
        client.session.get("http://127.0.0.1:9/health")  # port 9 (discard): nothing listens
    assert time.monotonic() - start < 10  # two short connection retries instead of TRL's ~62 s of back-off


def test_nccl_backend_gets_timeouts_after_trls_own_init(monkeypatch):
    backend_class = make_timeout_backend(7.0)
    base = backend_class.__mro__[1]
    monkeypatch.setattr(base, "_init_vllm", lambda self: setattr(self, "vllm_client", trl_like_client()))
    backend = object.__new__(backend_class)
    backend.mode, backend.accelerator = "server", SimpleNamespace(is_main_process=True)
    backend._init_vllm()
    adapter = backend.vllm_client.session.get_adapter("http://127.0.0.1:8000")
    assert isinstance(adapter, TimeoutAdapter) and adapter.default_timeout == 7.0
    assert adapter.max_retries.read == 0


def test_the_backend_is_chosen_once_from_the_arguments(tmp_path, monkeypatch):
    """`VLLMBackend.of` reads every argument the choice needs; each mode and weight sync gets its class."""
    from .helpers import tiny_config

    server = tiny_config(
        tmp_path,
        use_vllm=True,
        vllm_mode="server",
        vllm_request_timeout=7.0,
        vllm_server_recovery_timeout=30.0,
        vllm_weight_sync="shared_storage",
        vllm_weight_sync_server_dir="/mnt/shared/weights",
    )
    choice = VLLMBackend.of(server)
    local = str(tmp_path / "vllm_weights")
    assert choice == VLLMBackend("server", "shared_storage", 7.0, 30.0, local, "/mnt/shared/weights")
    assert choice.backend_class().__name__ == "SharedStorageVLLMGeneration"
    server.vllm_weight_sync = "nccl"
    assert VLLMBackend.of(server).backend_class().__name__ == "TimeoutVLLMGeneration"
    assert VLLMBackend.of(tiny_config(tmp_path)).backend_class() is None  # transformers' generate
    colocate = tiny_config(tmp_path, use_vllm=True, vllm_mode="colocate")
    monkeypatch.setattr(vllm_backends, "vllm_runs_on_cpu", lambda: False)
    assert VLLMBackend.of(colocate).backend_class() is None  # GPUs: TRL's own
    monkeypatch.setattr(vllm_backends, "vllm_runs_on_cpu", lambda: True)
    assert VLLMBackend.of(colocate).backend_class().__name__ == "CPUColocateVLLMGeneration"


def test_an_interrupt_aborts_the_requests_waiting_on_a_hung_server(hanging_server):
    """`abort_requests` (Ctrl-C): requests TRL's client waits for in its worker threads fail at once, not after
    their timeout."""
    import threading

    from dapo_trl.training.rollout.vllm_server_api import abort_requests

    client = trl_like_client()
    add_timeouts(client, 60.0)
    failures = []

    def request() -> None:
        try:
            client.session.post(f"{hanging_server}/generate", json={})
        except VLLMServerError as error:
            failures.append(error)

    threads = [threading.Thread(target=request) for _ in range(3)]
    for thread in threads:
        thread.start()
    adapter = client.session.get_adapter("http://")
    while sum(getattr(c, "sock", None) is not None for c in list(adapter._connections)) < 3:  # all three sent
        time.sleep(0.01)
    started = time.monotonic()
    assert abort_requests(SimpleNamespace(vllm_client=client)) == 3
    for thread in threads:
        thread.join(10)
    assert time.monotonic() - started < 5 and len(failures) == 3
    assert abort_requests(SimpleNamespace()) == 0  # colocated vLLM: no client
