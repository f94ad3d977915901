"""Shared helpers for the end-to-end tests: launching scripts with one or two real processes."""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = Path(__file__).resolve().parent / "scripts"


def run_command(args: list[str], timeout: int = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run a command from the repo root, offline, failing the test with its output on a non-zero exit."""
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    full_env.update(env or {})
    result = subprocess.run(args, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0:
        raise AssertionError(
            f"{' '.join(args)} exited {result.returncode}\n{result.stdout[-4000:]}\n{result.stderr[-6000:]}"
        )
    return result


def python_command(script: str, *args: str, num_processes: int = 1) -> list[str]:
    """`python script` for one process; two real gloo processes through `accelerate launch --multi_gpu` otherwise.

    (`accelerate launch --cpu --num_processes 2` silently runs one process, so it would prove nothing.)
    """
    if num_processes == 1:
        return [sys.executable, script, *args]
    return [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--multi_gpu",
        "--num_processes",
        str(num_processes),
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "--main_process_port",
        str(29500 + os.getpid() % 1000),
        script,
        *args,
    ]
