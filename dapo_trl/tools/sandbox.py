"""Where model-written Python runs. Model code is hostile by default: it must not reach the host or the trainer.

`LocalSandbox` runs each call in its own process tree, on Linux, with these layers (each used where the OS allows
it; a missing one is logged once as a warning, or is an error with `require_isolation=True`):

- mount, PID, network, IPC and UTS namespaces: the program sees only its own processes, has no network but an
  isolated loopback, gets private size-limited tmpfs over /tmp, /var/tmp, /dev/shm and /run/lock, and sees home
  directories (/root, /home) as empty, except the Python installation, re-exposed read-only;
- an unprivileged uid of its own per concurrent call (when the trainer runs as root), no supplementary groups, no
  capabilities, no_new_privs (setuid binaries cannot raise privileges);
- cgroups (v1, or v2 where delegated): total memory and process count of the whole tree;
- resource limits: address space (memory), CPU time, processes, file size, open files, no core dumps;
- a clean environment (none of the trainer's variables), a fresh working directory removed afterwards, a
  wall-clock deadline after which the whole tree is killed, and an output cap.

It is not a virtual machine: it shares the host kernel, can read world-readable files outside the masked homes,
and a kernel exploit defeats it. For untrusted code at scale, run `RemoteSandbox` against a SandboxFusion service
on separate machines.
"""

from __future__ import annotations

import abc
import enum
import json
import logging
import math
import os
import queue
import selectors
import shutil
import signal
import site
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from .gate import ExecutionGate

logger = logging.getLogger(__name__)

_HERE = Path(__file__).resolve().parent
LAUNCHER_SOURCE = (_HERE / "_launcher.py").read_text(encoding="utf-8")
RUNNER_SOURCE = (_HERE / "_runner.py").read_text(encoding="utf-8")

SETUP_FAILURE_EXIT = 125
DEFAULT_MASK_PATHS = ("/root", "/home")
# Layers whose absence weakens the boundary in a way the user must know about.
EXPECTED_LAYERS = (
    "pid_namespace",
    "network_namespace",
    "mount_namespace",
    "private_tmp",
    "cgroup:memory",
    "cgroup:pids",
)


class SandboxUnavailable(RuntimeError):
    """The sandbox cannot give the isolation that was required of it."""


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


# --------------------------------------------------------------------------------------------------- cgroups
class _Cgroups:
    """Per-call memory and pids cgroups under the trainer's own cgroup, v1 or delegated v2; absent if not writable."""

    def __init__(self, limits: SandboxLimits) -> None:
        self.limits = limits
        self.parents: dict[str, Path] = {}
        self.version = 0
        try:
            self._discover()
        except OSError as error:
            logger.debug("cgroups unavailable: %s", error)
            self.parents = {}

    def _discover(self) -> None:
        own = {}
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            for controller in controllers.split(",") if controllers else [""]:
                own[controller] = path
        root = Path("/sys/fs/cgroup")
        v1 = {c: root / c for c in ("memory", "pids") if (root / c / "cgroup.procs").exists() and c in own}
        if v1:
            self.version = 1
            for controller, mount in v1.items():
                parent = mount / own[controller].lstrip("/") / "dapo-sandbox"
                parent.mkdir(exist_ok=True)
                self.parents[controller] = parent
        elif (root / "cgroup.controllers").exists() and "" in own:
            self.version = 2
            parent = root / own[""].lstrip("/") / "dapo-sandbox"
            parent.mkdir(exist_ok=True)
            wanted = {"memory", "pids"} & set((parent / "cgroup.controllers").read_text().split())
            (parent / "cgroup.subtree_control").write_text(" ".join(f"+{c}" for c in sorted(wanted)))
            for controller in wanted:
                self.parents[controller] = parent

    def create(self) -> list[tuple[Path, list[str]]]:
        """Fresh cgroup directories with the limits written, each with the controllers it enforces."""
        name = uuid.uuid4().hex[:12]
        made: dict[Path, list[str]] = {}
        for controller, parent in sorted(self.parents.items()):
            path = parent / name
            try:
                if path not in made:
                    path.mkdir()
                    made[path] = []
                self._limit(controller, path)
                made[path].append(controller)
            except OSError as error:
                logger.debug("cgroup %s: %s", controller, error)
        return list(made.items())

    def _limit(self, controller: str, path: Path) -> None:
        memory = str(self.limits.memory_mb << 20)
        if self.version == 1 and controller == "memory":
            (path / "memory.limit_in_bytes").write_text(memory)
            if (path / "memory.memsw.limit_in_bytes").exists():
                (path / "memory.memsw.limit_in_bytes").write_text(memory)
        elif self.version == 1 and controller == "pids":
            (path / "pids.max").write_text(str(self.limits.max_processes))
        elif self.version == 2:
            if (path / "memory.max").exists():
                (path / "memory.max").write_text(memory)
                if (path / "memory.swap.max").exists():
                    (path / "memory.swap.max").write_text("0")
            if (path / "pids.max").exists():
                (path / "pids.max").write_text(str(self.limits.max_processes))

    @staticmethod
    def hit_memory_limit(paths: list[Path]) -> bool:
        for path in paths:
            for name in ("memory.failcnt", "memory.memsw.failcnt"):
                if (path / name).exists() and int((path / name).read_text().strip() or 0) > 0:
                    return True
            events = path / "memory.events"
            if events.exists():
                counts = dict(line.split() for line in events.read_text().splitlines() if line.strip())
                if int(counts.get("oom_kill", 0)) > 0:
                    return True
        return False

    @staticmethod
    def destroy(paths: list[Path]) -> None:
        for path in paths:
            for _ in range(100):
                try:
                    pids = [int(p) for p in (path / "cgroup.procs").read_text().split()]
                except OSError:
                    pids = []
                for pid in pids:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                try:
                    path.rmdir()
                    break
                except OSError:
                    time.sleep(0.01)
            else:
                logger.warning("could not remove sandbox cgroup %s", path)


# ------------------------------------------------------------------------------------------------------ local
def _uid_base(count: int) -> int:
    """A block of `count` uids mapped in this (possibly user-namespaced) container, used by nothing else."""
    preferred = [400_000, 60_000 - count]
    try:
        ranges = [tuple(map(int, line.split())) for line in Path("/proc/self/uid_map").read_text().splitlines()]
    except OSError:
        ranges = [(0, 0, 1 << 32)]
    for base in preferred:
        if any(inner <= base and base + count <= inner + length for inner, _, length in ranges):
            return base
    raise SandboxUnavailable(f"no block of {count} free uids is mapped in this container (/proc/self/uid_map)")


def _is_under(path: str, parent: str) -> bool:
    return path == parent or path.startswith(parent.rstrip("/") + "/")


def interpreter_paths(python: str) -> list[str]:
    """Directories the sandboxed interpreter must read: its prefixes, its executable's real home, site-packages."""
    paths = {sys.prefix, sys.base_prefix, sys.exec_prefix, os.path.dirname(os.path.realpath(python))}
    paths.update(site.getsitepackages())
    paths.update(p for p in sys.path if p and os.path.isdir(p))
    return sorted({os.path.realpath(p) for p in paths} | {os.path.abspath(p) for p in paths})


class LocalSandbox(Sandbox):
    """Runs each call as a fresh, isolated process tree on this machine (see the module docstring)."""

    def __init__(
        self,
        limits: SandboxLimits | None = None,
        max_concurrency: int = 128,
        rate_limit: float | None = None,
        *,
        require_isolation: bool = False,
        mask_paths: tuple[str, ...] | None = None,
        use_namespaces: bool = True,
        python: str | None = None,
        work_root: str | None = None,
    ) -> None:
        super().__init__(limits, max_concurrency, rate_limit)
        if not sys.platform.startswith("linux"):
            raise SandboxUnavailable("LocalSandbox needs Linux; use RemoteSandbox (a SandboxFusion service) instead.")
        self.require_isolation = require_isolation
        self.use_namespaces = use_namespaces
        self.python = python or sys.executable
        self.work_root = work_root
        self.is_root = os.geteuid() == 0
        self._uids: queue.SimpleQueue[int] = queue.SimpleQueue()
        if self.is_root:
            base = _uid_base(max_concurrency)
            for uid in range(base, base + max_concurrency):
                self._uids.put(uid)
        masks = [p for p in (mask_paths if mask_paths is not None else DEFAULT_MASK_PATHS) if os.path.isdir(p)]
        self.mask_paths = [os.path.realpath(p) for p in masks]
        exposed = [p for p in interpreter_paths(self.python) if any(_is_under(p, m) for m in self.mask_paths)]
        exposed = [p for p in exposed if os.path.isdir(p)]
        self.expose_paths = [p for p in exposed if not any(q != p and _is_under(p, q) for q in exposed)]
        self._cgroups = _Cgroups(self.limits)
        self._warned = False
        self._lock = threading.Lock()

    # ------------------------------------------------------------------------------------------ one call
    def _config(self, workdir: str, uid: int | None, status_fd: int, cgroups: list[tuple[Path, list[str]]]) -> dict:
        limits = self.limits
        return {
            "status_fd": status_fd,
            "workdir": workdir,
            "uid": uid,
            "gid": uid,
            "python": self.python,
            "runner": RUNNER_SOURCE,
            "namespaces": self.use_namespaces,
            "cgroups": [[str(path / "cgroup.procs"), controllers] for path, controllers in cgroups],
            "mask_paths": self.mask_paths,
            "expose_paths": self.expose_paths,
            "memory_bytes": limits.memory_mb << 20,
            "cpu_seconds": limits.cpu_seconds,
            "file_bytes": limits.max_file_mb << 20,
            "disk_bytes": limits.disk_mb << 20,
            "open_files": limits.open_files,
            "max_processes": limits.max_processes,
            # RLIMIT_NPROC counts every process of the real uid: exact with our own uid, wrong for a shared one.
            "limit_processes": uid is not None,
            "env": {
                "PATH": "/usr/local/bin:/usr/bin:/bin",
                "HOME": workdir,
                "TMPDIR": workdir,
                "LANG": "C.UTF-8",
                "LC_ALL": "C.UTF-8",
                "OPENBLAS_NUM_THREADS": "1",
                "OMP_NUM_THREADS": "1",
                "MKL_NUM_THREADS": "1",
                "MPLBACKEND": "Agg",
            },
        }

    def _execute(self, code: str) -> ExecutionResult:
        uid = self._uids.get() if self.is_root else None
        workdir = tempfile.mkdtemp(prefix="dapo-sandbox-", dir=self.work_root)
        cgroups = self._cgroups.create()
        status_read, status_write = os.pipe()
        try:
            os.chmod(workdir, 0o700)
            if uid is not None:
                os.chown(workdir, uid, uid)
            config = self._config(workdir, uid, status_write, cgroups)
            process = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", LAUNCHER_SOURCE, json.dumps(config)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                pass_fds=(status_write,),
                start_new_session=True,
                env={},
                cwd="/",
            )
            os.close(status_write)
            status_write = -1
            threading.Thread(target=_feed, args=(process.stdin, code.encode("utf-8", "replace")), daemon=True).start()
            stdout, stderr, timed_out, overflow = self._collect(process)
            self._kill_tree(process)
            record = _read_record(status_read)
            if uid is not None and "pid_namespace" not in (record or {}).get("layers", []):
                _kill_uid(uid)  # without a PID namespace, leftovers that left the process group keep our uid
            memory_hit = _Cgroups.hit_memory_limit([path for path, _ in cgroups])
        finally:
            os.close(status_read)
            if status_write >= 0:
                os.close(status_write)
            _Cgroups.destroy([path for path, _ in cgroups])
            shutil.rmtree(workdir, ignore_errors=True)
            if uid is not None:
                self._uids.put(uid)
        result = self._classify(record, stdout, stderr, timed_out, overflow, memory_hit)
        self._check_layers(result.layers, record)
        return result

    def _collect(self, process: subprocess.Popen) -> tuple[bytes, bytes, bool, bool]:
        """Read stdout and stderr until both close, the deadline passes, or the output cap is hit."""
        deadline = time.monotonic() + self.limits.timeout_s
        cap = self.limits.max_output_bytes
        chunks: dict[int, list[bytes]] = {process.stdout.fileno(): [], process.stderr.fileno(): []}
        total = 0
        timed_out = overflow = False
        exited_at = None
        with selectors.DefaultSelector() as selector:
            for stream in (process.stdout, process.stderr):
                os.set_blocking(stream.fileno(), False)
                selector.register(stream.fileno(), selectors.EVENT_READ)
            while selector.get_map():
                now = time.monotonic()
                if now >= deadline:
                    timed_out = True
                    break
                if exited_at is None and process.poll() is not None:
                    exited_at = now
                if exited_at is not None and now - exited_at > 0.5:
                    break  # the program is gone; only leftovers it forked hold the pipes (no PID namespace)
                for key, _ in selector.select(timeout=min(0.1, deadline - now)):
                    data = os.read(key.fd, 65536)
                    if not data:
                        selector.unregister(key.fd)
                        continue
                    keep = data[: max(0, cap - total)]
                    chunks[key.fd].append(keep)
                    total += len(data)
                    if total > cap:
                        overflow = True
                        break
                if overflow:
                    break
        return b"".join(chunks[process.stdout.fileno()]), b"".join(chunks[process.stderr.fileno()]), timed_out, overflow

    @staticmethod
    def _kill_tree(process: subprocess.Popen) -> None:
        """Stop the launcher, which kills init and so the PID namespace; then kill whatever is left in its group."""
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=2)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        process.wait()
        for stream in (process.stdin, process.stdout, process.stderr):
            try:
                stream.close()
            except OSError:
                pass

    # ------------------------------------------------------------------------------------------ outcome
    def _classify(
        self, record: dict | None, stdout: bytes, stderr: bytes, timed_out: bool, overflow: bool, memory_hit: bool
    ) -> ExecutionResult:
        limits = self.limits
        record = record or {}
        out = stdout.decode("utf-8", errors="replace")
        err = stderr.decode("utf-8", errors="replace")
        exit_code, sig = record.get("exit_code"), record.get("signal")
        result = ExecutionResult(
            ExecutionStatus.OK, out, err, exit_code=exit_code, signal=sig, layers=record.get("layers", [])
        )
        if record.get("setup_error") or (exit_code == SETUP_FAILURE_EXIT and "sandbox setup failed" in err):
            result.status = ExecutionStatus.SANDBOX_ERROR
            result.message = f"sandbox setup failed: {record.get('setup_error') or err.strip()}"
            if "Permission denied" in err and self.python in err:
                result.message += (
                    f" (the unprivileged sandbox user cannot run {self.python} without a mount namespace to expose it:"
                    " install Python where every user can read it, or pass LocalSandbox(python=...))"
                )
        elif timed_out:
            result.status = ExecutionStatus.TIMEOUT
            result.message = f"timed out after {limits.timeout_s:g} s"
        elif overflow:
            result.status = ExecutionStatus.OUTPUT_LIMIT
            result.message = f"output exceeded {limits.max_output_bytes} bytes; the program was stopped"
        elif sig == signal.SIGXCPU:
            result.status = ExecutionStatus.TIMEOUT
            result.message = f"CPU time limit of {limits.cpu_seconds} s exceeded"
        elif memory_hit and (sig == signal.SIGKILL or exit_code):
            result.status = ExecutionStatus.MEMORY
            result.message = f"memory limit of {limits.memory_mb} MB exceeded"
        elif exit_code and _last_line(err).startswith("MemoryError"):
            result.status = ExecutionStatus.MEMORY
            result.message = f"memory limit of {limits.memory_mb} MB exceeded (MemoryError)"
        elif sig is not None:
            result.status = ExecutionStatus.KILLED
            result.message = f"the program was killed by {_signal_name(sig)}"
        elif exit_code is None:
            result.status = ExecutionStatus.SANDBOX_ERROR
            result.message = "the sandbox ended without reporting the program's status"
        elif exit_code != 0:
            result.status = ExecutionStatus.ERROR
            result.message = f"exit code {exit_code}"
        return result

    def _check_layers(self, layers: list[str], record: dict | None) -> None:
        if self._warned or not record or record.get("setup_error"):
            return
        missing = [layer for layer in EXPECTED_LAYERS if layer not in layers]
        if self.is_root and "unprivileged_user" not in layers:
            missing.append("unprivileged_user")
        notes = record.get("warnings", [])
        with self._lock:
            if self._warned:
                return
            self._warned = True
        if not missing and not notes:
            logger.info("code sandbox isolation: %s", ", ".join(layers))
            return
        message = (
            f"code sandbox runs without: {', '.join(missing) or 'nothing'}"
            + (f" ({'; '.join(notes)})" if notes else "")
            + ". Model code is less contained than documented; for hostile code at scale use a remote sandbox."
        )
        critical = {"pid_namespace", "network_namespace", "mount_namespace", "unprivileged_user"} & set(missing)
        if self.require_isolation and critical:
            raise SandboxUnavailable(message + " (require_isolation=True)")
        logger.warning(message)

    def isolation(self) -> list[str]:
        """The isolation layers in force, found by running an empty program."""
        result = self.run("pass")
        if result.status is ExecutionStatus.SANDBOX_ERROR:
            raise SandboxUnavailable(result.message)
        return result.layers


def _feed(stdin, data: bytes) -> None:
    try:
        stdin.write(data)
        stdin.close()
    except (BrokenPipeError, OSError, ValueError):
        pass


def _read_record(fd: int) -> dict | None:
    os.set_blocking(fd, False)
    try:
        data = os.read(fd, 1 << 16)
    except BlockingIOError:
        return None
    try:
        return json.loads(data.decode().splitlines()[0]) if data else None
    except (ValueError, IndexError):
        return None


def _kill_uid(uid: int) -> None:
    """Kill every process of `uid`: a helper takes the uid and signals all it can (kill -1), itself included."""
    subprocess.run(
        [
            sys.executable,
            "-I",
            "-S",
            "-c",
            f"import os\nos.setgroups([])\nos.setresgid({uid},{uid},{uid})\nos.setresuid({uid},{uid},{uid})\n"
            "os.kill(-1, 9)",
        ],
        env={},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        check=False,
    )


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


def _signal_name(number: int) -> str:
    try:
        name = signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
    described = {"SIGSEGV": "a segmentation fault", "SIGABRT": "an abort", "SIGBUS": "a bus error"}
    return f"{described.get(name, name)} ({name})"
