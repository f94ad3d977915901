"""One DAPO optimizer step on a fixed global batch; saves the parameter update and the rows each micro-batch held.

Run as `python denominator_run.py OUT K S [key=value DAPOConfig overrides]` (one process) or under
`accelerate launch --multi_gpu --num_processes 2`.
With plain SGD (lr 1, no clipping, no decay) the update is minus the gradient, which the test compares with a
reference gradient of paper Eq. 11 computed on the rows of the same optimizer step.
"""

import json
import os
import sys
from pathlib import Path

import torch
from datasets import Dataset

from dapo_trl import DAPOConfig, DAPOTrainer
from dapo_trl.builtin_models import build_tiny_model
from dapo_trl.utils.transformers_compat import activation_checkpointing_kwargs

GLOBAL_ROWS = 16
PROMPT_LEN = 6
MAX_COMPLETION = 12


def fixed_global_batch(vocab_size: int) -> dict[str, torch.Tensor]:
    """A deterministic batch with very different prompt and completion lengths (TRL's padding: prompts on the left,
    completions on the right), so every normaliser choice differs, and tool replies masked out of a few rows."""
    generator = torch.Generator().manual_seed(1234)
    lengths = torch.randint(1, MAX_COMPLETION + 1, (GLOBAL_ROWS,), generator=generator)
    prompt_lengths = torch.randint(1, PROMPT_LEN + 1, (GLOBAL_ROWS,), generator=generator)
    tool_mask = torch.ones(GLOBAL_ROWS, MAX_COMPLETION, dtype=torch.long)
    tool_mask[::3, 2:5] = 0  # a tool reply inside every third completion: attended, never trained
    return {
        "prompt_ids": torch.randint(3, vocab_size, (GLOBAL_ROWS, PROMPT_LEN), generator=generator),
        "prompt_mask": (torch.arange(PROMPT_LEN)[None, :] >= PROMPT_LEN - prompt_lengths[:, None]).long(),
        "completion_ids": torch.randint(3, vocab_size, (GLOBAL_ROWS, MAX_COMPLETION), generator=generator),
        "completion_mask": (torch.arange(MAX_COMPLETION)[None, :] < lengths[:, None]).long(),
        "tool_mask": tool_mask,
        "advantages": torch.randn(GLOBAL_ROWS, generator=generator),
        "row_index": torch.arange(GLOBAL_ROWS),
    }


class FixedBatchTrainer(DAPOTrainer):
    """Replaces generation with a slice of the fixed batch; records which rows each micro-batch trained on.

    Each row carries the index of the generation it came from; with `zero_first_generation`, the first generation's
    advantages are all zero (its optimizer step then changes nothing under plain SGD, but its tokens still count).
    """

    generations = 0
    zero_first_generation = False

    def _generate_and_score_completions(self, inputs):
        batch = fixed_global_batch(self.model.config.vocab_size)
        batch["generation"] = torch.full((GLOBAL_ROWS,), self.generations)
        if self.zero_first_generation and self.generations == 0:
            batch["advantages"] = torch.zeros(GLOBAL_ROWS)
        self.generations += 1
        local_rows = len(inputs)
        start = self.accelerator.process_index * local_rows
        local = {key: value[start : start + local_rows] for key, value in batch.items()}
        local["num_items_in_batch"] = torch.tensor(-1.0)  # poisoned: the trainer must recompute it
        return local

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        self.recorded_rows.append(inputs["row_index"].tolist())
        self.recorded_generations.append(inputs["generation"].tolist())
        self.recorded_items.append(float(inputs["num_items_in_batch"]))
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


def full_parameters(model) -> dict[str, torch.Tensor]:
    """A full copy of every parameter, gathering ZeRO-3 shards (a collective: every rank calls it)."""
    parameters = dict(model.named_parameters())
    if not hasattr(next(iter(parameters.values())), "ds_numel"):
        return {name: p.detach().clone() for name, p in parameters.items()}
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(parameters.values()), modifier_rank=None):
        return {name: p.detach().clone() for name, p in parameters.items()}


def main() -> None:
    out, accumulation, steps_per_generation = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    # Imported here: run as a script from tests/scripts, while the tests import this module for its batch.
    from script_args import leave_together, parse_overrides

    overrides = parse_overrides(sys.argv[4:])
    zero_first_generation = overrides.pop("zero_first_generation", False)
    model_dir = build_tiny_model(out / "model")
    per_device = GLOBAL_ROWS // (int(os.environ.get("WORLD_SIZE", "1")) * steps_per_generation)
    settings = dict(
        output_dir=str(out / "run"),
        per_device_train_batch_size=per_device,
        gradient_accumulation_steps=accumulation,
        steps_per_generation=steps_per_generation,
        num_generations=2,
        max_completion_length=MAX_COMPLETION,
        apply_overlong_penalty=False,
        optim="sgd",
        learning_rate=1.0,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=0.0,
        max_steps=1,
        **activation_checkpointing_kwargs(False),
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        seed=0,
    )
    config = DAPOConfig(**{**settings, **overrides})
    prompts = Dataset.from_list([{"prompt": "p", "solution": "1"}] * 64)
    trainer = FixedBatchTrainer(model=str(model_dir), args=config, train_dataset=prompts)
    trainer.recorded_rows, trainer.recorded_generations, trainer.recorded_items = [], [], []
    trainer.zero_first_generation = zero_first_generation
    before = full_parameters(trainer.model)
    trainer.train()
    model = trainer.accelerator.unwrap_model(trainer.model)
    parameters = dict(model.named_parameters())
    if hasattr(next(iter(parameters.values())), "ds_numel"):  # DeepSpeed ZeRO-3: prove the weights are sharded
        shards = {
            "local_numel": sum(p.numel() for p in parameters.values()),
            "total_numel": sum(p.ds_numel for p in parameters.values()),
        }
        (out / f"zero3_rank{trainer.accelerator.process_index}.json").write_text(json.dumps(shards))
    after = full_parameters(model)
    delta = {name: after[name] - before[name] for name in after}
    # "rows": the micro-batches of the first optimizer step; "micro_batches": every micro-step's (generation, row)
    # pairs and the num_items_in_batch TRL's loss got.
    rank = trainer.accelerator.process_index
    micro_batches = [
        {"rows": list(zip(generations, rows, strict=True)), "num_items": items}
        for generations, rows, items in zip(
            trainer.recorded_generations, trainer.recorded_rows, trainer.recorded_items, strict=True
        )
    ]
    torch.save(
        {
            "rows": trainer.recorded_rows[:accumulation],
            "micro_batches": micro_batches,
            "sharded_forwards": getattr(trainer._forwards.sequence_parallel, "sharded_forwards", 0),
        },
        out / f"rows_rank{rank}.pt",
    )
    if trainer.accelerator.is_main_process:
        torch.save(delta, out / "delta.pt")
        (out / "log_history.json").write_text(json.dumps(trainer.state.log_history))
    leave_together(trainer.accelerator)


if __name__ == "__main__":
    main()
