"""Shared helpers for the end-to-end tests: launching scripts with one or several real processes."""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = Path(__file__).resolve().parent / "scripts"


def offline_environment(extra: dict | None = None) -> dict:
    """Offline, quiet, and with DeepSpeed's compiled C++ op (~20 s on first use) cached across runs."""
    cache = os.environ.get("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "dapo_trl" / "torch_extensions"))
    return {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "TORCH_EXTENSIONS_DIR": cache,
        **(extra or {}),
    }


def run_command(args: list[str], timeout: int = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run a command from the repo root, offline, failing the test with its output on a non-zero exit."""
    result = subprocess.run(
        args, cwd=REPO, env=offline_environment(env), capture_output=True, text=True, timeout=timeout
    )
    if result.returncode != 0:
        raise AssertionError(
            f"{' '.join(args)} exited {result.returncode}\n{result.stdout[-4000:]}\n{result.stderr[-6000:]}"
        )
    return result


def python_command(script: str, *args: str, num_processes: int = 1, deepspeed_config: str | None = None) -> list[str]:
    """`python script` for one process; real gloo processes through `accelerate launch` otherwise.

    Several processes use `--multi_gpu` (`accelerate launch --cpu --num_processes 2` silently runs one process,
    so it would prove nothing), or `--use_deepspeed` with the given DeepSpeed config file.
    """
    if num_processes == 1 and deepspeed_config is None:
        return [sys.executable, script, *args]
    backend = ["--use_deepspeed", "--deepspeed_config_file", deepspeed_config] if deepspeed_config else ["--multi_gpu"]
    port = str(29500 + os.getpid() % 1000)
    return [sys.executable, "-m", "accelerate.commands.launch", *backend, "--num_processes", str(num_processes),
            "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", port,
            script, *args]  # fmt: skip
