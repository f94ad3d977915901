"""`RemoteSandbox`: runs model-written Python on a SandboxFusion service (bytedance/SandboxFusion) over HTTP.

Use it instead of `LocalSandbox` when the code is untrusted and the volume is large: the programs then run on
separate machines, in the service's own containers, so a kernel exploit or a resource-hungry program cannot reach
the trainer, and the sandbox scales apart from the GPUs. It needs nothing of the trainer's OS (no Linux namespaces
or cgroups).

Each call is one `POST {base_url}/run_code`. The code sent is this package's runner (`_runner.py`, the program
`LocalSandbox` runs too) and the model's code goes on its stdin, so both backends behave alike: the value of a final
bare expression is printed, and a traceback shows only the model's own `<code>` frames.
"""

from __future__ import annotations

import logging
import signal
from typing import Any

import requests

from ..utils.http import RETRY_STATUSES, HTTPClient, RequestFailed, RetryPolicy, run_code_url
from .sandbox_base import (
    RUNNER_SOURCE,
    ExecutionResult,
    ExecutionStatus,
    Sandbox,
    SandboxLimits,
    last_line,
    signal_name,
)

logger = logging.getLogger(__name__)

MAX_DELAY_S = 30.0  # the longest wait before one retry, Retry-After included
CONNECT_TIMEOUT_S = 10.0


class _Fatal(Exception):
    """A reply that a retry would not mend."""


class RemoteSandbox(Sandbox):
    """Runs each call on a SandboxFusion service; see the module docstring for when to prefer it.

    Args:
        base_url: the service's URL, e.g. "http://127.0.0.1:8080" (a trailing "/run_code" is accepted).
        limits: `timeout_s` is sent as `run_timeout` (and `compile_timeout`), `memory_mb` as `memory_limit_MB`;
            `max_code_bytes` is checked before sending and `max_output_bytes` applied to the reply. The service
            enforces the rest by its own configuration.
        max_concurrency / rate_limit: calls in flight at once and starts per second, across all threads (the gate).
        request_timeout: seconds to wait for the reply; default `limits.timeout_s + 10`.
        max_retries / backoff_s: retries after a connection error, HTTP 429, 502, 503 or 504, waiting
            `backoff_s * 2**attempt` (with jitter, at most 30 s, at least what a Retry-After header asks). A retry
            runs the program again from scratch, which is harmless. Other 4xx and 5xx are not retried, nor is a read
            timeout: the program may have run for its whole time already, the service should have answered
            TimeLimitExceeded by then, and retrying would multiply the delay of the training step. A read timeout
            is a SANDBOX_ERROR (the service is overloaded or stuck, not the program at fault).
        language: the service's language for the runner, which is Python source ("python").
        session: a `requests.Session` to use (its proxies, TLS and auth settings); default a fresh one with a
            connection pool of `max_concurrency`, closed by `close()`.

    Replies map to statuses thus: run Finished with exit code 0: OK; non-zero: ERROR ("exit code N"), or MEMORY if
    stderr ends in MemoryError, or KILLED for a signal (a negative code, or 128 + N as a shell reports it; SIGKILL
    may be the memory limit); TimeLimitExceeded: TIMEOUT; a run status Error or a top-level SandboxError:
    SANDBOX_ERROR with the service's message. stdout + stderr past `max_output_bytes` are cut to their head and the
    status is OUTPUT_LIMIT (the program itself ran to its end). `layers` is ["remote"].

    No network failure raises out of `run`: it returns SANDBOX_ERROR naming the URL and the error, so the training
    step goes on.
    """

    def __init__(
        self,
        base_url: str,
        limits: SandboxLimits | None = None,
        max_concurrency: int = 128,
        rate_limit: float | None = None,
        *,
        request_timeout: float | None = None,
        max_retries: int = 3,
        backoff_s: float = 1.0,
        language: str = "python",
        session: requests.Session | None = None,
    ) -> None:
        super().__init__(limits, max_concurrency, rate_limit)
        self.url = run_code_url(base_url)
        if request_timeout is not None and not request_timeout > 0:
            raise ValueError(f"RemoteSandbox request_timeout must be > 0 seconds, got {request_timeout!r}")
        if not isinstance(max_retries, int) or max_retries < 0:
            raise ValueError(f"RemoteSandbox max_retries must be an integer >= 0, got {max_retries!r}")
        if not backoff_s >= 0:
            raise ValueError(f"RemoteSandbox backoff_s must be >= 0, got {backoff_s!r}")
        self.request_timeout = float(request_timeout if request_timeout is not None else self.limits.timeout_s + 10)
        self.max_retries = max_retries
        self.backoff_s = float(backoff_s)
        self.language = language
        policy = RetryPolicy(
            max_retries=max_retries,
            backoff_s=self.backoff_s,
            retry_statuses=RETRY_STATUSES,
            retry_read_timeouts=False,  # the program may have run already; the service should have said so
            max_delay_s=MAX_DELAY_S,
        )
        self.http = HTTPClient(policy, session=session, pool_maxsize=max_concurrency)
        self.session = self.http.session

    def __repr__(self) -> str:
        return (
            f"RemoteSandbox(url={self.url!r}, max_concurrency={self.gate.max_concurrency}, "
            f"request_timeout={self.request_timeout}, max_retries={self.max_retries})"
        )

    def close(self) -> None:
        self.http.close()

    # ------------------------------------------------------------------------------------------ one call
    def request_body(self, code: str) -> dict[str, Any]:
        """The SandboxFusion `run_code` request for `code`: the runner as the program, the code on its stdin."""
        return {
            "code": RUNNER_SOURCE,
            "language": self.language,
            "compile_timeout": float(self.limits.timeout_s),
            "run_timeout": float(self.limits.timeout_s),
            "memory_limit_MB": int(self.limits.memory_mb),
            "stdin": code,
            "files": {},
            "fetch_files": [],
        }

    def _execute(self, code: str) -> ExecutionResult:
        timeout = (min(CONNECT_TIMEOUT_S, self.request_timeout), self.request_timeout)
        try:
            response = self.http.request("POST", self.url, timeout=timeout, json=self.request_body(code))
        except RequestFailed as failure:
            if failure.read_timeout:
                return self._failure(f"no reply within request_timeout={self.request_timeout:g} s (not retried)")
            retries_ran_out = f" (after {failure.attempts} attempts)" if failure.retryable else ""
            return self._failure(failure.describe(detail_chars=300) + retries_ran_out)
        try:
            payload = response.json()
        except ValueError:  # requests' JSONDecodeError
            return self._failure(f"the reply is not JSON: {response.text[:200]!r}")
        try:
            return self._classify(payload)
        except _Fatal as fatal:
            return self._failure(str(fatal))

    def _failure(self, error: str) -> ExecutionResult:
        message = f"sandbox service at {self.url} failed: {error}"
        logger.warning(message)
        return ExecutionResult(ExecutionStatus.SANDBOX_ERROR, message=message, layers=["remote"])

    # ------------------------------------------------------------------------------------------ outcome
    def _classify(self, payload: Any) -> ExecutionResult:
        """An ExecutionResult from a SandboxFusion reply (the mapping is in `RemoteSandbox`'s docstring)."""
        if not isinstance(payload, dict) or "status" not in payload:
            raise _Fatal(f"the reply is not a SandboxFusion run_code result: {str(payload)[:200]!r}")
        limits = self.limits
        top = payload.get("status")
        command = payload.get("run_result") or payload.get("compile_result")
        if not isinstance(command, dict):
            command = {}
        stdout, stderr, overflow = _truncate(
            _text(command.get("stdout")), _text(command.get("stderr")), limits.max_output_bytes
        )
        code = command.get("return_code")
        code = code if isinstance(code, int) and not isinstance(code, bool) else None
        result = ExecutionResult(ExecutionStatus.OK, stdout, stderr, exit_code=code, layers=["remote"])
        run_status = command.get("status")
        server_message = _text(payload.get("message")).strip()
        if top == "SandboxError" or run_status == "Error":
            result.status = ExecutionStatus.SANDBOX_ERROR
            detail = server_message or last_line(stderr) or "no message"
            result.message = f"sandbox service at {self.url} reported SandboxError: {detail}"
        elif top not in ("Success", "Failed"):
            raise _Fatal(f"the reply has an unknown status {top!r}")
        elif run_status == "TimeLimitExceeded":
            result.status = ExecutionStatus.TIMEOUT
            result.message = f"timed out after {limits.timeout_s:g} s"
        elif overflow:
            result.status = ExecutionStatus.OUTPUT_LIMIT
            result.message = f"output exceeded {limits.max_output_bytes} bytes; only its head is kept"
        elif run_status != "Finished" or code is None:
            result.status = ExecutionStatus.SANDBOX_ERROR
            result.message = (
                f"sandbox service at {self.url} returned no exit status (status {top!r}, run status {run_status!r}"
                + (f": {server_message})" if server_message else ")")
            )
        elif code != 0 and last_line(stderr).startswith("MemoryError"):
            result.status = ExecutionStatus.MEMORY
            result.message = f"memory limit of {limits.memory_mb} MB exceeded (MemoryError)"
        elif code < 0 or 128 < code <= 128 + 64:
            result.status = ExecutionStatus.KILLED
            result.signal = -code if code < 0 else code - 128
            result.message = f"the program was killed by {signal_name(result.signal)}"
            if result.signal == signal.SIGKILL:
                result.message += f" (possibly for exceeding the memory limit of {limits.memory_mb} MB)"
        elif code != 0:
            result.status = ExecutionStatus.ERROR
            result.message = f"exit code {code}"
        return result


def _text(value: Any) -> str:
    return "" if value is None else value if isinstance(value, str) else str(value)


def _truncate(stdout: str, stderr: str, cap: int) -> tuple[str, str, bool]:
    """stdout then stderr, kept to `cap` UTF-8 bytes in all (the head); whether anything was cut."""
    out, err = stdout.encode("utf-8", "replace"), stderr.encode("utf-8", "replace")
    if len(out) + len(err) <= cap:
        return stdout, stderr, False
    out = out[:cap]
    err = err[: cap - len(out)]
    return out.decode("utf-8", "ignore"), err.decode("utf-8", "ignore"), True
