"""RemoteSandbox against a real SandboxFusion-like HTTP server on 127.0.0.1, started and stopped by each test."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from dapo_trl.tools.remote import RemoteSandbox, run_code_url
from dapo_trl.tools.sandbox import RUNNER_SOURCE, ExecutionStatus, SandboxLimits

from .helpers import StubServer, clear_proxies, closed_port, fusion_execute, fusion_reply


def finished(code: int = 0, stdout: str = "", stderr: str = "") -> dict:
    run = {"status": "Finished", "execution_time": 0.01, "return_code": code, "stdout": stdout, "stderr": stderr}
    return fusion_reply(run, "Success" if code == 0 else "Failed")


def canned(*replies, delay: float = 0.0):
    """Replies in turn (the last repeats): a dict is a 200 JSON body, an int that HTTP status."""

    def behaviour(index, body):
        reply = replies[min(index, len(replies) - 1)]
        if isinstance(reply, int):
            return reply, {"detail": f"stub error {reply}"}, {"Retry-After": "0"} if reply in (429, 503) else {}, 0.0
        return 200, reply, {}, delay

    return behaviour


def fusion_server(behaviour=fusion_execute) -> StubServer:
    """A `/run_code` stub: `behaviour(index, body) -> (status, JSON body, headers, delay_s)`."""
    return StubServer(behaviour)


def sandbox(url: str, **kwargs) -> RemoteSandbox:
    options = {"limits": SandboxLimits(timeout_s=5.0), "max_retries": 2, "backoff_s": 0.01}
    options.update(kwargs)
    return RemoteSandbox(url, **options)


@pytest.fixture(autouse=True)
def _loopback_only(monkeypatch):
    clear_proxies(monkeypatch)


# -- construction ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "base_url,url",
    [
        ("http://127.0.0.1:8080", "http://127.0.0.1:8080/run_code"),
        ("http://127.0.0.1:8080/", "http://127.0.0.1:8080/run_code"),
        ("http://127.0.0.1:8080/run_code", "http://127.0.0.1:8080/run_code"),
        (" https://sandbox.internal/prefix/run_code/ ", "https://sandbox.internal/prefix/run_code"),
    ],
)
def test_run_code_url(base_url, url):
    assert run_code_url(base_url) == url


@pytest.mark.parametrize("base_url", ["", "127.0.0.1:8080", "ftp://host", "http://", "http://h:port", "http://h?a=1"])
def test_malformed_url_is_rejected(base_url):
    with pytest.raises(ValueError, match=r"sandbox_url=.*e\.g\. 'http://127\.0\.0\.1:8080'"):
        RemoteSandbox(base_url)


def test_other_arguments_are_checked():
    with pytest.raises(ValueError, match="max_retries"):
        RemoteSandbox("http://127.0.0.1:1", max_retries=-1)
    with pytest.raises(ValueError, match="request_timeout"):
        RemoteSandbox("http://127.0.0.1:1", request_timeout=0)
    assert RemoteSandbox("http://127.0.0.1:1", SandboxLimits(timeout_s=7)).request_timeout == 17


# -- real execution -------------------------------------------------------------------------------------------


def test_programs_run_like_the_local_backend():
    limits = SandboxLimits(timeout_s=5.0, memory_mb=512)
    with fusion_server() as server:
        box = sandbox(server.base_url, limits=limits)
        value = box.run("x = 20\nx + 1 + 1")
        printed = box.run("print('hi ✓')")
        failed = box.run("def f():\n    return 1 / 0\n\nf()")
    assert value.status is ExecutionStatus.OK and value.stdout == "22\n" and value.layers == ["remote"]
    assert printed.ok and printed.stdout == "hi ✓\n" and printed.exit_code == 0
    assert failed.status is ExecutionStatus.ERROR and failed.message == "exit code 1"
    lines = failed.stderr.strip().splitlines()
    assert lines[-1] == "ZeroDivisionError: division by zero"
    frames = [line for line in lines if line.lstrip().startswith("File ")]
    assert len(frames) == 2 and all('File "<code>"' in line for line in frames)
    assert "return 1 / 0" in failed.stderr

    body = server.requests[0]["body"]
    assert server.requests[0]["path"] == "/run_code"
    assert body["code"] == RUNNER_SOURCE and body["stdin"] == "x = 20\nx + 1 + 1"
    assert body["language"] == "python" and body["run_timeout"] == 5.0 and body["memory_limit_MB"] == 512
    assert body["files"] == {} and body["fetch_files"] == []


def test_slow_program_times_out():
    with fusion_server() as server:
        result = sandbox(server.base_url, limits=SandboxLimits(timeout_s=0.5)).run("import time\ntime.sleep(5)")
    assert result.status is ExecutionStatus.TIMEOUT and result.message == "timed out after 0.5 s"
    assert len(server.requests) == 1


def test_segfault_is_killed():
    with fusion_server() as server:
        result = sandbox(server.base_url).run("import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)")
    assert result.status is ExecutionStatus.KILLED and result.signal == 11
    assert "segmentation fault" in result.message


# -- canned replies -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "reply,status,message",
    [
        (finished(3), ExecutionStatus.ERROR, "exit code 3"),
        (finished(1, stderr="Traceback ...\nMemoryError\n"), ExecutionStatus.MEMORY, "memory limit of 1024 MB"),
        (finished(139), ExecutionStatus.KILLED, "segmentation fault (SIGSEGV)"),
        (finished(-9), ExecutionStatus.KILLED, "SIGKILL) (possibly for exceeding the memory limit"),
        (
            fusion_reply(
                {"status": "Error", "return_code": None, "stdout": "", "stderr": "spawn failed"}, "SandboxError"
            ),
            ExecutionStatus.SANDBOX_ERROR,
            "SandboxError: spawn failed",
        ),
        (
            fusion_reply(None, "SandboxError", "no executor available"),
            ExecutionStatus.SANDBOX_ERROR,
            "no executor available",
        ),
        (fusion_reply(None, "Failed"), ExecutionStatus.SANDBOX_ERROR, "returned no exit status"),
        ({"unexpected": 1}, ExecutionStatus.SANDBOX_ERROR, "not a SandboxFusion run_code result"),
    ],
)
def test_reply_mapping(reply, status, message):
    with fusion_server(canned(reply)) as server:
        result = sandbox(server.base_url).run("pass")
    assert result.status is status and message in result.message, result.message
    assert len(server.requests) == 1


def test_output_past_the_cap_keeps_its_head():
    limits = SandboxLimits(max_output_bytes=100)
    with fusion_server(canned(finished(0, stdout="é" * 80, stderr="tail"))) as server:
        result = sandbox(server.base_url, limits=limits).run("pass")
    assert result.status is ExecutionStatus.OUTPUT_LIMIT and "100 bytes" in result.message
    assert result.stdout == "é" * 50 and result.stderr == ""


def test_unavailable_then_success_is_retried():
    with fusion_server(canned(503, 503, finished(0, stdout="ok\n"))) as server:
        result = sandbox(server.base_url).run("pass")
    assert result.ok and result.stdout == "ok\n"
    assert len(server.requests) == 3


def test_retry_after_is_honoured():
    def behaviour(index, body):
        if index == 0:
            return 429, {"detail": "slow down"}, {"Retry-After": "0.3"}, 0.0
        return 200, finished(0), {}, 0.0

    with fusion_server(behaviour) as server:
        start = time.monotonic()
        result = sandbox(server.base_url).run("pass")
    assert result.ok and len(server.requests) == 2 and time.monotonic() - start >= 0.3


def test_retries_run_out():
    with fusion_server(canned(502)) as server:
        result = sandbox(server.base_url, max_retries=2).run("pass")
    assert result.status is ExecutionStatus.SANDBOX_ERROR
    assert server.base_url in result.message and "HTTP 502" in result.message and "after 3 attempts" in result.message
    assert len(server.requests) == 3


def test_client_error_is_not_retried():
    with fusion_server(canned(400)) as server:
        result = sandbox(server.base_url).run("pass")
    assert result.status is ExecutionStatus.SANDBOX_ERROR
    assert "HTTP 400" in result.message and f"{server.base_url}/run_code" in result.message
    assert len(server.requests) == 1


def test_read_timeout_is_not_retried():
    with fusion_server(canned(finished(0), delay=5.0)) as server:
        start = time.monotonic()
        result = sandbox(server.base_url, request_timeout=0.3).run("pass")
        elapsed = time.monotonic() - start
    assert result.status is ExecutionStatus.SANDBOX_ERROR and "request_timeout=0.3 s" in result.message
    assert len(server.requests) == 1 and elapsed < 2


def test_closed_port_fails_fast():
    url = f"http://127.0.0.1:{closed_port()}"
    start = time.monotonic()
    result = sandbox(url, max_retries=2, backoff_s=0.01).run("1")
    assert result.status is ExecutionStatus.SANDBOX_ERROR
    assert url in result.message and "ConnectionError" in result.message and "after 3 attempts" in result.message
    assert time.monotonic() - start < 3


# -- concurrency ----------------------------------------------------------------------------------------------


def test_gate_bounds_requests_in_flight():
    with fusion_server(canned(finished(0, stdout="ok\n"), delay=0.2)) as server:
        box = sandbox(server.base_url, max_concurrency=4)
        with ThreadPoolExecutor(max_workers=16) as pool:
            results = list(pool.map(box.run, [f"{i}" for i in range(16)]))
        box.close()
    assert all(r.ok for r in results) and len(server.requests) == 16
    assert server.peak_in_flight <= 4 and box.gate.peak_in_flight <= 4
    assert box.gate.peak_in_flight == 4  # the cap was reached, so the bound was tested
