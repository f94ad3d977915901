"""The run's configuration: `DAPOConfig` (GRPOConfig with DAPO's defaults and knobs, `dapo_config`), the checks that
name a bad field and its fix (`checks`), the fields derived from others and from the platform (`derived`), and the
reference page docs/config.md written from the fields by concern (`groups`, `reference`:
`python -m dapo_trl.config.reference`)."""

from .dapo_config import DEFAULT_LOSS_TYPE, DAPOConfig, loss_type_help

__all__ = ["DEFAULT_LOSS_TYPE", "DAPOConfig", "loss_type_help"]
