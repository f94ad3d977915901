"""Train a few DAPO steps with dynamic sampling on prompts of known difficulty; dump what was trained.

Prompts are "easy k" (always correct), "hard k" (always wrong) or "mixed k" (alternately right and wrong within a
group), so exactly the mixed groups have spread. Usage (one process or under accelerate launch):
  python dynamic_sampling_run.py OUT PER_DEVICE_BATCH MAX_STEPS [key=value DAPOConfig overrides...]
Writes OUT/trained_rank{r}.jsonl (prompts and advantages of every trained micro-batch), OUT/prompts_seen.jsonl
(every prompt generated for, per step and round) and OUT/log_history.json.
"""

import json
import os
import sys
from pathlib import Path

import torch
from datasets import Dataset
from script_args import leave_together, parse_overrides
from transformers import TrainerCallback

from dapo_trl import DAPOConfig, DAPOTrainer
from dapo_trl.tiny_model import build_tiny_model

NUM_GENERATIONS = 4


def difficulty_dataset(mixed_share: float, size: int = 60) -> Dataset:
    rows = []
    for i in range(size):
        kind = "mixed" if i < mixed_share * size else ("easy" if i % 2 else "hard")
        rows.append({"prompt": f"{kind} {i}", "solution": "1"})
    return Dataset.from_list(rows)


def known_difficulty_reward(prompts, completions, trainer_state=None, **kwargs) -> list[float]:
    """+1 for easy, -1 for hard, and for mixed prompts +1 / -1 by row parity (groups are contiguous, even size)."""
    out = Path(os.environ["DS_OUT"])
    rank = int(os.environ.get("RANK", "0"))
    with open(out / f"prompts_seen_rank{rank}.jsonl", "a") as f:
        f.write(json.dumps({"step": trainer_state.global_step, "prompts": prompts}) + "\n")
    rewards = []
    for index, prompt in enumerate(prompts):
        kind = prompt.split()[0]
        rewards.append(1.0 if kind == "easy" else -1.0 if kind == "hard" else (1.0 if index % 2 == 0 else -1.0))
    return rewards


class RecordingTrainer(DAPOTrainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        prompts = self.processing_class.batch_decode(inputs["prompt_ids"], skip_special_tokens=True)
        with open(Path(os.environ["DS_OUT"]) / f"trained_rank{self.accelerator.process_index}.jsonl", "a") as f:
            record = {
                "step": self.state.global_step,
                "prompts": prompts,
                "advantages": inputs["advantages"].tolist(),
                "active_tokens": inputs["completion_mask"].sum(dim=1).tolist(),
            }
            f.write(json.dumps(record) + "\n")
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


class CrashAfterSave(TrainerCallback):
    """Simulates a crash: the process dies right after writing the checkpoint of step `step`."""

    def __init__(self, step: int):
        self.step = step

    def on_save(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            os._exit(3)


def main() -> None:
    out, per_device, max_steps = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    overrides = parse_overrides(sys.argv[4:])
    mixed_share = overrides.pop("mixed_share", 0.25)
    resume = overrides.pop("resume", None)
    crash_after = overrides.pop("crash_after_save", None)
    out.mkdir(parents=True, exist_ok=True)
    os.environ["DS_OUT"] = str(out)
    settings = dict(
        output_dir=str(out / "run"),
        per_device_train_batch_size=per_device,
        num_generations=NUM_GENERATIONS,
        max_completion_length=8,
        max_steps=max_steps,
        filter_groups_enable=True,
        max_filter_gen_batches=0,
        apply_overlong_penalty=False,
        gradient_checkpointing=False,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        seed=0,
    )
    settings.update(overrides)
    trainer = RecordingTrainer(
        model=str(build_tiny_model(out.parent / "tiny")),
        reward_funcs=known_difficulty_reward,
        args=DAPOConfig(**settings),
        train_dataset=difficulty_dataset(mixed_share),
    )
    if crash_after is not None:
        trainer.add_callback(CrashAfterSave(crash_after))
    trainer.train(resume_from_checkpoint=resume)
    if trainer.accelerator.is_main_process:
        (out / "log_history.json").write_text(json.dumps(trainer.state.log_history))
        if not trainer.is_deepspeed_enabled:  # ZeRO-3 shards would need gathering
            model = trainer.accelerator.unwrap_model(trainer.model)
            torch.save({name: p.detach().cpu() for name, p in model.named_parameters()}, out / "final_params.pt")
    leave_together(trainer.accelerator)


if __name__ == "__main__":
    main()
