"""Tools the policy can call during generation, and the sandboxes that run model-written code."""

from .gate import ExecutionGate, TokenBucket
from .local_sandbox import LocalSandbox
from .sandbox_base import ExecutionResult, ExecutionStatus, Sandbox, SandboxLimits, SandboxUnavailable

__all__ = [
    "ExecutionGate",
    "ExecutionResult",
    "ExecutionStatus",
    "LocalSandbox",
    "Sandbox",
    "SandboxLimits",
    "SandboxUnavailable",
    "TokenBucket",
]
