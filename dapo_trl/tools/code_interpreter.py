"""ReTool's code interpreter as a TRL tool: the model writes Python, a sandbox runs it, the model reads the output.

TRL runs a batch's tool calls one after another. `CodeInterpreter.prefetch` lets the trainer start every call of a
generation turn at once (bounded by the sandbox's gate) as soon as the turn is decoded; TRL's own call then picks up
the finished result, so a batch of 512 x 16 rollouts does not wait for its programs in sequence.
"""

from __future__ import annotations

import threading
from collections import Counter, defaultdict, deque
from collections.abc import Callable
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor

from .sandbox_base import ExecutionResult, ExecutionStatus, Sandbox

TOOL_NAME = "code_interpreter"
DEFAULT_MAX_OUTPUT_CHARS = 1024


def truncate_middle(text: str, max_chars: int) -> str:
    """Keep the head and the tail (a traceback's last line, a loop's final value) and say how much was cut."""
    if len(text) <= max_chars:
        return text
    marker = f"\n...({len(text) - max_chars} characters truncated)...\n"
    keep = max(max_chars - len(marker), 2)
    return text[: keep // 2] + marker + text[len(text) - (keep - keep // 2) :]


def format_tool_output(result: ExecutionResult, max_chars: int = DEFAULT_MAX_OUTPUT_CHARS) -> str:
    """What the model reads: the program's stdout then stderr, and a plain error line when the sandbox stopped it."""
    if result.status is ExecutionStatus.SANDBOX_ERROR:
        return f"Error: the code could not be run ({result.message})."
    output = result.stdout
    if result.stderr:
        output += ("" if not output or output.endswith("\n") else "\n") + result.stderr
    output = truncate_middle(output, max_chars)
    if result.status in (ExecutionStatus.OK, ExecutionStatus.ERROR):
        return output if output.strip() else "(no output)"
    note = f"Error: {result.message}."
    return f"{output.rstrip()}\n{note}" if output.strip() else note


class CodeInterpreter:
    """The `code_interpreter` tool over a sandbox backend, with prefetching and per-batch outcome counts.

    Pass `interpreter.tool` in `DAPOTrainer(tools=[...])`; TRL builds the tool's schema from its name, type hints and
    docstring. `stats()` returns and resets the counts of consumed executions by status, which the trainer logs.
    """

    def __init__(self, sandbox: Sandbox, max_output_chars: int = DEFAULT_MAX_OUTPUT_CHARS) -> None:
        if max_output_chars < 64:
            raise ValueError(f"max_output_chars must be >= 64, got {max_output_chars}")
        self.sandbox = sandbox
        self.max_output_chars = max_output_chars
        self._executor = ThreadPoolExecutor(
            max_workers=sandbox.gate.max_concurrency, thread_name_prefix="code-interpreter"
        )
        self._pending: dict[str, deque[Future]] = defaultdict(deque)
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        self._seconds = 0.0
        self.tool = self._make_tool()

    def _make_tool(self) -> Callable[[str], str]:
        interpreter = self

        def code_interpreter(code: str) -> str:
            """Run Python code in a sandbox and return what it printed (stdout, then stderr).

            The value of a final bare expression is printed too, as in a notebook. Each call starts a fresh
            interpreter with no network; numpy and sympy can be imported. Execution stops after a time limit.

            Args:
                code: The Python source code to run.
            """
            return interpreter(code)

        code_interpreter.interpreter = interpreter  # type: ignore[attr-defined]
        return code_interpreter

    # ------------------------------------------------------------------------------------------------- calls
    def __call__(self, code: str) -> str:
        future = self._take_prefetched(code)
        if future is not None:
            try:
                result = future.result()
            except CancelledError:
                result = self.sandbox.run(code)
        else:
            result = self.sandbox.run(code)
        with self._lock:
            self._counts[result.status.value] += 1
            self._counts["calls"] += 1
            self._seconds += result.duration_s
        return format_tool_output(result, self.max_output_chars)

    def prefetch(self, code: str) -> None:
        """Start running `code` now; the next `__call__` with the same code takes this execution's result."""
        if not isinstance(code, str):
            return
        future = self._executor.submit(self.sandbox.run, code)
        with self._lock:
            self._pending[code].append(future)

    def _take_prefetched(self, code: str) -> Future | None:
        with self._lock:
            queue = self._pending.get(code)
            if not queue:
                return None
            future = queue.popleft()
            if not queue:
                del self._pending[code]
            return future

    def discard_prefetched(self) -> int:
        """Drop prefetched executions nobody asked for (calls TRL did not make); returns how many."""
        with self._lock:
            futures = [future for queue in self._pending.values() for future in queue]
            self._pending.clear()
        for future in futures:
            future.cancel()
        return len(futures)

    def stats(self) -> dict[str, float]:
        """Counts of consumed executions since the last call, by status, plus their total seconds; then reset."""
        with self._lock:
            counts = {status.value: float(self._counts.get(status.value, 0)) for status in ExecutionStatus}
            counts["calls"] = float(self._counts.get("calls", 0))
            counts["seconds"] = self._seconds
            self._counts.clear()
            self._seconds = 0.0
        return counts

    def close(self) -> None:
        self.discard_prefetched()
        self._executor.shutdown(wait=False, cancel_futures=True)
        self.sandbox.close()


def interpreter_of(tool: Callable) -> CodeInterpreter | None:
    """The `CodeInterpreter` behind a tool function made by it, else None."""
    interpreter = getattr(tool, "interpreter", None)
    return interpreter if isinstance(interpreter, CodeInterpreter) else None


def build_code_interpreter(
    backend: str = "local",
    *,
    url: str | None = None,
    timeout_s: float = 30.0,
    memory_mb: int = 1024,
    max_concurrency: int = 128,
    rate_limit: float | None = None,
    require_isolation: bool = False,
    max_output_chars: int = DEFAULT_MAX_OUTPUT_CHARS,
) -> CodeInterpreter:
    """The code interpreter over a local sandbox or a remote SandboxFusion service, with ReTool's defaults."""
    from .local_sandbox import LocalSandbox
    from .sandbox_base import SandboxLimits

    limits = SandboxLimits(timeout_s=timeout_s, memory_mb=memory_mb)
    if backend == "local":
        sandbox: Sandbox = LocalSandbox(limits, max_concurrency, rate_limit, require_isolation=require_isolation)
    elif backend == "remote":
        if not url:
            raise ValueError("sandbox='remote' needs sandbox_url, e.g. --sandbox_url http://sandbox-host:8080")
        from .remote import RemoteSandbox

        sandbox = RemoteSandbox(url, limits, max_concurrency, rate_limit)
    else:
        raise ValueError(f"sandbox={backend!r}: use 'local' (this machine) or 'remote' (a SandboxFusion service)")
    return CodeInterpreter(sandbox, max_output_chars=max_output_chars)
