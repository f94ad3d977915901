"""The interface every code sandbox implements, and what one run returns.

Model code is hostile by default: it must not reach the host or the trainer. Two backends implement `Sandbox`:
`LocalSandbox` (local_sandbox.py: namespaces, an unprivileged uid, cgroups and rlimits on this machine) and
`RemoteSandbox` (remote.py: a SandboxFusion service on other machines). Both send the same runner (_runner.py), so the
last-expression and traceback behaviour are the same wherever the code runs.
"""

from __future__ import annotations

import abc
import enum
import logging
import math
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

from .gate import ExecutionGate

# Every sandbox module logs under this one name, the one users configure.
logger = logging.getLogger("dapo_trl.tools.sandbox")

RUNNER_SOURCE = (Path(__file__).resolve().parent / "_runner.py").read_text(encoding="utf-8")


class SandboxUnavailable(RuntimeError):
    """The sandbox cannot run Python, or not with the isolation required of it: raised, never a per-call result."""


class ExecutionStatus(str, enum.Enum):
    OK = "ok"
    ERROR = "error"  # the program raised or exited non-zero
    TIMEOUT = "timeout"  # wall clock or CPU time limit
    MEMORY = "memory"  # memory limit
    OUTPUT_LIMIT = "output_limit"  # printed more than the cap; stopped
    KILLED = "killed"  # died from a signal (segfault, abort...)
    SANDBOX_ERROR = "sandbox_error"  # the sandbox itself failed (not the program's fault)


@dataclass
class ExecutionResult:
    status: ExecutionStatus
    stdout: str = ""
    stderr: str = ""
    exit_code: int | None = None
    signal: int | None = None
    duration_s: float = 0.0
    message: str = ""  # what the sandbox says about the run, e.g. "timed out after 30 s"
    layers: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.status is ExecutionStatus.OK


@dataclass(frozen=True)
class SandboxLimits:
    """Per-call limits. Defaults follow the ReTool recipe (30 s, 1 GB) plus the bounds it leaves implicit."""

    timeout_s: float = 30.0
    memory_mb: int = 1024
    cpu_time_s: float | None = None  # default: the timeout + 1 s
    max_processes: int = 64
    max_output_bytes: int = 1 << 20  # stdout + stderr; the program is stopped past it
    max_file_mb: int = 128
    disk_mb: int = 256  # each private tmpfs (/tmp, where the working directory lives, and /dev/shm ...)
    open_files: int = 256
    max_code_bytes: int = 1 << 20

    def __post_init__(self) -> None:
        positive = {
            "timeout_s": self.timeout_s,
            "memory_mb": self.memory_mb,
            "max_processes": self.max_processes,
            "max_output_bytes": self.max_output_bytes,
            "max_file_mb": self.max_file_mb,
            "disk_mb": self.disk_mb,
            "open_files": self.open_files,
            "max_code_bytes": self.max_code_bytes,
        }
        for name, value in positive.items():
            if not value or value <= 0:
                raise ValueError(f"SandboxLimits.{name} must be > 0, got {value!r}")
        if self.memory_mb < 64:
            raise ValueError(f"SandboxLimits.memory_mb={self.memory_mb} is too small to start Python; use >= 64")

    @property
    def cpu_seconds(self) -> int:
        return math.ceil(self.cpu_time_s if self.cpu_time_s is not None else self.timeout_s + 1)


class Sandbox(abc.ABC):
    """A backend that runs Python source and returns what happened; every call passes one shared gate."""

    def __init__(self, limits: SandboxLimits | None, max_concurrency: int, rate_limit: float | None) -> None:
        self.limits = limits or SandboxLimits()
        self.gate = ExecutionGate(max_concurrency, rate_limit)

    def run(self, code: str) -> ExecutionResult:
        if not isinstance(code, str):
            return ExecutionResult(ExecutionStatus.ERROR, message=f"code must be a string, got {type(code).__name__}")
        if len(code.encode("utf-8", errors="replace")) > self.limits.max_code_bytes:
            return ExecutionResult(
                ExecutionStatus.ERROR, message=f"code is longer than {self.limits.max_code_bytes} bytes"
            )
        with self.gate.admit():
            start = time.monotonic()
            try:
                result = self._execute(code)
            except SandboxUnavailable:
                raise
            except Exception as error:  # noqa: BLE001 - a broken sandbox must not end the training step
                logger.exception("sandbox call failed")
                result = ExecutionResult(ExecutionStatus.SANDBOX_ERROR, message=f"{type(error).__name__}: {error}")
            result.duration_s = time.monotonic() - start
            return result

    @abc.abstractmethod
    def _execute(self, code: str) -> ExecutionResult: ...

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release what the backend holds (cgroup directories, sessions)."""


def last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


def signal_name(number: int) -> str:
    try:
        name = signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
    described = {"SIGSEGV": "a segmentation fault", "SIGABRT": "an abort", "SIGBUS": "a bus error"}
    return f"{described.get(name, name)} ({name})"
