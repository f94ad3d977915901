"""The streaming client (`VLLMServerEngine`) honours its server URL as TRL's client does for rounds: a path prefix (a
proxy mounting vLLM under `/proxy/vllm`) on every endpoint, and `https://` with its certificate checked. What it
cannot honour is refused naming the field and the fix. Local stub servers; no vLLM needed."""

import http.server
import json
import shutil
import ssl
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from dapo_trl.training.rollout.rollout_engine import GroupRequest, RequestSampling
from dapo_trl.training.rollout.server_engine import VLLMServerEngine
from dapo_trl.training.rollout.server_http import server_address as _server_address
from dapo_trl.training.rollout.vllm_server_api import reload_server_weights

GROUP, PREFIX = 4, "/proxy/vllm"
EXPECTED = [("GET", f"{PREFIX}/v1/models"), ("POST", f"{PREFIX}/v1/completions")]
EXPECTED += [("GET", f"{PREFIX}/metrics"), ("GET", f"{PREFIX}/health"), ("GET", f"{PREFIX}/is_paused")]


class PrefixedVLLM(http.server.BaseHTTPRequestHandler):
    """A vLLM server as a proxy exposes it under PREFIX: every path outside it is a 404. Records each request."""

    seen: list[tuple[str, str]] = []

    def do_GET(self) -> None:
        self.seen.append(("GET", self.path))
        routes = {
            f"{PREFIX}/v1/models": {"data": [{"id": "tiny"}]},
            f"{PREFIX}/health": {},
            f"{PREFIX}/metrics": "vllm:num_requests_running 0.0\nvllm:num_requests_waiting 0.0\n",
        }
        self._answer(*((200, routes[self.path]) if self.path in routes else (404, {"detail": "Not Found"})))

    def do_POST(self) -> None:
        raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        body = json.loads(raw) if raw else {}
        self.seen.append(("POST", self.path))
        if self.path == f"{PREFIX}/v1/completions":
            choice = {"token_ids": [5, 6, body["seed"] % 50], "logprobs": {"token_logprobs": [-0.1, -0.2, -0.3]}}
            self._answer(200, {"choices": [choice] * body["n"]})
        elif self.path == f"{PREFIX}/collective_rpc":
            self._answer(200, {})
        elif self.path == f"{PREFIX}/reset_prefix_cache":
            self._answer(200, {"success": True})
        else:
            self._answer(404, {"detail": "Not Found"})

    def _answer(self, status: int, payload: object) -> None:
        data = payload.encode() if isinstance(payload, str) else json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


def serve(tls: ssl.SSLContext | None = None) -> Iterator[http.server.ThreadingHTTPServer]:
    PrefixedVLLM.seen = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), PrefixedVLLM)
    if tls is not None:
        server.socket = tls.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def plain_server() -> Iterator[http.server.ThreadingHTTPServer]:
    yield from serve()


@pytest.fixture
def certificate(tmp_path: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 (and its key), made offline with the openssl command."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make a self-signed certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert)]
        + ["-days", "2", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True,
        capture_output=True,
    )
    return cert, key


@pytest.fixture
def tls_server(certificate: tuple[Path, Path]) -> Iterator[http.server.ThreadingHTTPServer]:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(*certificate)
    yield from serve(context)


def run_one_group(base_url: str) -> list[list[int]]:
    """Build the engine on `base_url` (it asks /v1/models), run one group, check the server is idle (/metrics)."""
    engine = VLLMServerEngine(base_url, RequestSampling(n=GROUP, max_tokens=8), 4, 10)
    try:
        answers, finished = [], threading.Event()
        engine.start(
            GroupRequest(("stream", 0), [7, 8], seed=11, version=0), lambda r, a: (answers.append(a), finished.set())
        )
        assert finished.wait(10)
        engine.wait_server_idle()
        engine.wait_available(5, poll=0.05)
    finally:
        engine.close()
    assert not isinstance(answers[0], BaseException), answers[0]
    return answers[0].completion_ids


def test_every_request_goes_under_the_urls_path(plain_server):
    port = plain_server.server_port
    completions = run_one_group(f"http://127.0.0.1:{port}{PREFIX}/")
    assert completions == [[5, 6, 11]] * GROUP
    assert set(PrefixedVLLM.seen) == set(EXPECTED)  # every endpoint the engine asked, all under the prefix
    reload_server_weights(f"http://127.0.0.1:{port}{PREFIX}", "/weights/v1", timeout=10)  # load_weights' reload
    assert PrefixedVLLM.seen[-2:] == [("POST", f"{PREFIX}/collective_rpc"), ("POST", f"{PREFIX}/reset_prefix_cache")]


def test_https_is_spoken_and_its_certificate_checked(tls_server, certificate, monkeypatch):
    url = f"https://127.0.0.1:{tls_server.server_port}{PREFIX}"
    monkeypatch.delenv("REQUESTS_CA_BUNDLE", raising=False)
    monkeypatch.delenv("CURL_CA_BUNDLE", raising=False)
    with pytest.raises(RuntimeError, match="certificate is not trusted.*set REQUESTS_CA_BUNDLE"):  # self-signed ...
        VLLMServerEngine(url, RequestSampling(n=GROUP, max_tokens=8), 4, 10)
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(certificate[0]))  # ... until it is trusted, as requests trusts it
    assert run_one_group(url) == [[5, 6, 11]] * GROUP
    assert set(PrefixedVLLM.seen) == set(EXPECTED)


def test_https_defaults_to_port_443_and_http_to_80():
    assert _server_address("https://proxy.example/vllm")[:3] == ("proxy.example", 443, "/vllm")
    assert _server_address("http://[::1]")[:3] == ("::1", 80, "")


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("ftp://127.0.0.1:8000", "must start with http:// or https://"),
        ("http://user:secret@127.0.0.1:8000", "has credentials"),
        ("http://127.0.0.1:8000/v1?key=1", "must not have a query string"),
    ],
)
def test_a_url_it_cannot_honour_is_refused_naming_the_field(url, message):
    with pytest.raises(ValueError, match=f"vllm_server_base_url=.*{message}"):
        VLLMServerEngine(url, RequestSampling(n=GROUP, max_tokens=8), 4, 10)
