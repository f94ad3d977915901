"""The local sandbox: model-written Python, hostile by default, run on this machine without reaching the host.

`LocalSandbox` runs each call in its own process tree, on Linux, with these layers (each used where the OS allows
it; a missing one is logged once as a warning, or is an error with `require_isolation=True`):

- mount, PID, network, IPC and UTS namespaces: the program sees only its own processes, has no network but an
  isolated loopback, gets private size-limited tmpfs over /tmp, /var/tmp, /dev/shm and /run/lock, and sees home
  directories (/root, /home) as empty; the interpreter's own directories are bound back read-only wherever they
  live (interpreter_paths.py), and a probe run at construction fails loudly if Python still cannot start;
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

import json
import logging
import os
import queue
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from .cgroups import Cgroups
from .interpreter_paths import closed_to_others, hidden_dirs, interpreter_dirs, resolve_python
from .sandbox_base import (
    RUNNER_SOURCE,
    ExecutionResult,
    ExecutionStatus,
    Sandbox,
    SandboxLimits,
    SandboxUnavailable,
    last_line,
    signal_name,
)

logger = logging.getLogger("dapo_trl.tools.sandbox")

LAUNCHER_SOURCE = (Path(__file__).resolve().parent / "_launcher.py").read_text(encoding="utf-8")

SETUP_FAILURE_EXIT = 125
DEFAULT_MASK_PATHS = ("/root", "/home")
PRIVATE_PATHS = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")  # each gets a private tmpfs, /tmp first
# Layers whose absence weakens the boundary in a way the user must know about.
EXPECTED_LAYERS = (
    "pid_namespace",
    "network_namespace",
    "mount_namespace",
    "private_tmp",
    "cgroup:memory",
    "cgroup:pids",
)
PROBE = "print(1)"


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
        self.python = resolve_python(python)
        self.work_root = work_root
        self.is_root = os.geteuid() == 0
        self._uids: queue.SimpleQueue[int] = queue.SimpleQueue()
        if self.is_root:
            base = _uid_base(max_concurrency)
            for uid in range(base, base + max_concurrency):
                self._uids.put(uid)
        masks = [p for p in (mask_paths if mask_paths is not None else DEFAULT_MASK_PATHS) if os.path.isdir(p)]
        self.mask_paths = [os.path.realpath(p) for p in masks]
        self.expose_paths = hidden_dirs(interpreter_dirs(self.python), [*PRIVATE_PATHS, *self.mask_paths])
        self._cgroups = Cgroups(self.limits)
        self._warned = False
        self._lock = threading.Lock()
        self._probe()

    def _probe(self) -> None:
        """Run one tiny program through the real launcher now, so that a sandbox that cannot start Python (an
        interpreter it cannot reach, a missing library) fails here once, clearly, and not as every call's error."""
        result = self._execute(PROBE)
        if result.ok and result.stdout == "1\n":
            return
        notes = [result.message or f"{PROBE!r} printed {result.stdout!r}"]
        if last_line(result.stderr) not in notes[0]:
            notes.append(last_line(result.stderr))
        where = ""
        if "mount_namespace" in result.layers:
            hidden = ", ".join([*PRIVATE_PATHS, *self.mask_paths])
            shown = ", ".join(self.expose_paths) or "none of them"
            where = f" Inside, {hidden} are hidden except the interpreter's own directories ({shown})."
        closed = closed_to_others(self.expose_paths) if self.is_root else []
        if closed:  # e.g. a venv made in a `mktemp -d` folder (mode 700): the sandbox user cannot enter it
            where += f" Other users cannot enter {', '.join(closed)}: `chmod o+rx` it (as `python -m venv` leaves it)."
        raise SandboxUnavailable(
            f"LocalSandbox cannot start Python {self.python} inside its sandbox: {'; '.join(notes)}.{where} Pass "
            "LocalSandbox(python=...) an interpreter the sandbox can run (e.g. /usr/bin/python3, or a conda or virtual "
            "environment under /opt), or create the virtual environment elsewhere."
        )

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
            "private_paths": PRIVATE_PATHS,
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
            memory_hit = Cgroups.hit_memory_limit([path for path, _ in cgroups])
        finally:
            os.close(status_read)
            if status_write >= 0:
                os.close(status_write)
            Cgroups.destroy([path for path, _ in cgroups])
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
            detail = record.get("setup_error") or err.strip().removeprefix("sandbox setup failed: ")
            result.message = f"sandbox setup failed: {detail}"
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
        elif exit_code and last_line(err).startswith("MemoryError"):
            result.status = ExecutionStatus.MEMORY
            result.message = f"memory limit of {limits.memory_mb} MB exceeded (MemoryError)"
        elif sig is not None:
            result.status = ExecutionStatus.KILLED
            result.message = f"the program was killed by {signal_name(sig)}"
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
