"""`dapo_trl.tools.sandbox`: the sandbox interface (`sandbox_base`) and the local backend (`local_sandbox`) under one
import path, as users import them (`from dapo_trl.tools.sandbox import LocalSandbox, SandboxLimits`).

Imports run one way: this module imports both; neither imports it.
"""

from .local_sandbox import LocalSandbox
from .sandbox_base import (
    RUNNER_SOURCE,
    ExecutionResult,
    ExecutionStatus,
    Sandbox,
    SandboxLimits,
    SandboxUnavailable,
)

__all__ = [
    "RUNNER_SOURCE",
    "ExecutionResult",
    "ExecutionStatus",
    "LocalSandbox",
    "Sandbox",
    "SandboxLimits",
    "SandboxUnavailable",
]
