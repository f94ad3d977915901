"""DAPO (Decoupled Clip and Dynamic sAmpling Policy Optimization) for Hugging Face TRL."""

from .config import DAPOConfig
from .trainer import DAPOTrainer

__all__ = ["DAPOConfig", "DAPOTrainer"]
__version__ = "0.1.0"
