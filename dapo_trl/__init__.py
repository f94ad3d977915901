"""DAPO (Decoupled Clip and Dynamic sAmpling Policy Optimization) for Hugging Face TRL.

The two public names load lazily, so light submodules (rewards, scoring workers, data) import without torch/TRL.
"""

from typing import TYPE_CHECKING, Any

__all__ = ["DAPOConfig", "DAPOTrainer"]
__version__ = "0.1.0"

if TYPE_CHECKING:
    from .config import DAPOConfig
    from .trainer import DAPOTrainer


def __getattr__(name: str) -> Any:
    if name == "DAPOConfig":
        from .config import DAPOConfig

        return DAPOConfig
    if name == "DAPOTrainer":
        from .trainer import DAPOTrainer

        return DAPOTrainer
    raise AttributeError(f"module 'dapo_trl' has no attribute {name!r}")
