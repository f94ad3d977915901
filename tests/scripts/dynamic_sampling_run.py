"""Train a few DAPO steps with dynamic sampling on prompts of known difficulty; dump what was trained.

Prompts are "easy k" (always correct), "hard k" (always wrong) or "mixed k" (alternately right and wrong within a
group), so exactly the mixed groups have spread. Usage (one process or under accelerate launch):
  python dynamic_sampling_run.py OUT PER_DEVICE_BATCH MAX_STEPS [key=value DAPOConfig overrides...]
Script options among the overrides: mixed_share, resume, crash_after_save; preempt_at_step=N (SIGTERM to this
process in the middle of optimizer step N + 1, on rank preempt_rank, default 0, from inside preempt_during: `round`,
the first call of the reward function (scoring the step's first dynamic-sampling round), or `training`, the step's
first training forward (micro-batch 0): the run abandons the step, saves checkpoint-N and stops);
slow_reward_at_step=N with slow_reward_seconds=S (the reward sleeps S seconds in optimizer step N + 1, on every
process, after any preempt_during=round signal: a reward that holds the step);
kill_while_writing=checkpoint-N/FILE (SIGKILL halfway through writing that file with torch.save),
sigterm_while_writing=checkpoint-N/FILE (SIGTERM as that file is written);
iterable=true (the train set as a
3-shard datasets.IterableDataset); reward=ids (mixed prompts are right when their completion's token ids sum to an
even number, plus a second reward `id_shaping` = 0.1 x (sum of ids mod 7), so shaped rewards vary within groups);
constant_from_step=N (every reward is -1 from optimizer step N on: nothing to keep);
snapshots=true (weights and optimizer state saved at the start and after every optimizer step);
skip_empty=false (without DAPOTrainer's empty-step skipping, as a control);
lora=R (a LoRA adapter of rank R, alpha 2R, on every linear layer: PEFT training).
Writes OUT/trained_rank{r}.jsonl (prompts, completion ids, advantages, active tokens and num_items_in_batch of every
trained micro-batch), OUT/prompts_seen.jsonl (every prompt generated for, per step and round) and
OUT/log_history.json.
"""

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
from accelerate import PartialState
from datasets import Dataset
from denominator_run import full_parameters
from script_args import leave_together, parse_overrides
from transformers import TrainerCallback

from dapo_trl import DAPOConfig, DAPOTrainer
from dapo_trl.builtin_models import build_tiny_model
from dapo_trl.training.step.replayed_routing import with_routings
from dapo_trl.training.step.steps import SkipEmptySteps
from dapo_trl.utils.transformers_compat import activation_checkpointing_kwargs

NUM_GENERATIONS = 4
SCRIPT_OPTIONS = {"constant_from_step": None, "reward": "parity"}
PREEMPT = {
    "preempt_at_step": None,
    "preempt_rank": 0,
    "preempt_during": "round",
    "slow_reward_at_step": None,
    "slow_reward_seconds": 0.0,
}


def difficulty_dataset(mixed_share: float, size: int = 60) -> Dataset:
    rows = []
    for i in range(size):
        kind = "mixed" if i < mixed_share * size else ("easy" if i % 2 else "hard")
        rows.append({"prompt": f"{kind} {i}", "solution": "1"})
    return Dataset.from_list(rows)


def known_difficulty_reward(prompts, completions, completion_ids, trainer_state=None, **kwargs) -> list[float]:
    """+1 for easy, -1 for hard, and for mixed prompts +1 / -1 by row parity (groups are contiguous, even size), or
    by the parity of the completion's id sum with reward=ids."""
    out = Path(os.environ["DS_OUT"])
    rank = int(os.environ.get("RANK", "0"))
    with open(out / f"prompts_seen_rank{rank}.jsonl", "a") as f:
        f.write(json.dumps({"step": trainer_state.global_step, "prompts": prompts}) + "\n")
    preempt_here("round", trainer_state.global_step, rank)
    if trainer_state.global_step == PREEMPT["slow_reward_at_step"]:
        time.sleep(PREEMPT["slow_reward_seconds"])  # a judge or a remote reward service that takes its time
    constant_from = SCRIPT_OPTIONS["constant_from_step"]
    if constant_from is not None and trainer_state.global_step >= constant_from:
        return [-1.0] * len(prompts)
    rewards = []
    for index, (prompt, ids) in enumerate(zip(prompts, completion_ids, strict=True)):
        kind = (prompt if isinstance(prompt, str) else prompt[-1]["content"]).split()[0]  # text or chat prompts
        parity = sum(ids) if SCRIPT_OPTIONS["reward"] == "ids" else index
        rewards.append(1.0 if kind == "easy" else -1.0 if kind == "hard" else (1.0 if parity % 2 == 0 else -1.0))
    return rewards


def id_shaping(completion_ids, **kwargs) -> list[float]:
    return [0.1 * (sum(ids) % 7) for ids in completion_ids]


class RecordingTrainer(DAPOTrainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        inputs = with_routings(self, inputs)  # routing replay: fetched here, so the record holds them
        prompts = self.processing_class.batch_decode(inputs["prompt_ids"], skip_special_tokens=True)
        with open(Path(os.environ["DS_OUT"]) / f"trained_rank{self.accelerator.process_index}.jsonl", "a") as f:
            masks = inputs["completion_mask"].bool()
            record = {
                "step": self.state.global_step,
                "prompts": prompts,
                "completion_ids": [
                    ids[mask].tolist() for ids, mask in zip(inputs["completion_ids"], masks, strict=True)
                ],
                "advantages": inputs["advantages"].tolist(),
                "active_tokens": inputs["completion_mask"].sum(dim=1).tolist(),
                "num_items": float(inputs["num_items_in_batch"]),
            }
            for name in ("old_per_token_logps", "sampling_per_token_logps", "dapo_proximal_lag"):  # pi_old's source
                if name in inputs:
                    record[name] = [row[mask].tolist() for row, mask in zip(inputs[name], masks, strict=True)]
            if "dapo_scored_at_step" in inputs:
                record["dapo_scored_at_step"] = inputs["dapo_scored_at_step"].tolist()
            if "completion_routed_experts" in inputs:  # routing replay: each row's replayed completion routing
                routings = inputs["completion_routed_experts"]
                record["routings"] = [
                    routing[mask.cpu()].tolist() for routing, mask in zip(routings, masks, strict=True)
                ]
                record["routing_device"] = str(routings.device)  # a micro-batch's routing stays in host memory
            f.write(json.dumps(record) + "\n")
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


class Snapshots(TrainerCallback):
    """Saves the weights and the optimizer state before training and after every optimizer step (one process)."""

    def __init__(self, out: Path):
        self.out = out

    def save(self, name: str, model, optimizer) -> None:
        state = {key: value.clone() if torch.is_tensor(value) else value for key, value in _flat(optimizer).items()}
        params = {key: value.detach().clone() for key, value in model.named_parameters()}
        torch.save({"params": params, "optimizer": state}, self.out / f"snapshot_{name}.pt")

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        self.save("start", model, optimizer)

    def on_step_end(self, args, state, control, model=None, optimizer=None, **kwargs):
        self.save(str(state.global_step), model, optimizer)


def _flat(optimizer) -> dict:
    """Every per-parameter optimizer state entry (exp_avg, exp_avg_sq, step) under one flat key."""
    return {
        f"{index}.{key}": value
        for index, entries in optimizer.state_dict()["state"].items()
        for key, value in entries.items()
    }


class CrashAfterSave(TrainerCallback):
    """Simulates a crash: the process dies right after writing the checkpoint of step `step`."""

    def __init__(self, step: int):
        self.step = step

    def on_save(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            # Every process has returned from its save, so the main one has written the whole checkpoint; without
            # this the launcher can kill it mid-write when another process dies first.
            PartialState().wait_for_everyone()
            os._exit(3)


def preempt_here(point: str, global_step: int, rank: int) -> None:
    """SIGTERM to this process, once, at the `preempt_during` point of optimizer step `preempt_at_step` + 1."""
    if (PREEMPT["preempt_during"], PREEMPT["preempt_at_step"], PREEMPT["preempt_rank"]) == (point, global_step, rank):
        PREEMPT["preempt_at_step"] = None
        os.kill(os.getpid(), signal.SIGTERM)


def preempt_in_training_forwards(trainer) -> None:
    """preempt_during=training: the signal comes from a hook on the policy's first training forward of the step."""

    def forward(module, args) -> None:
        if torch.is_grad_enabled() and trainer.model.training:
            preempt_here("training", trainer.state.global_step, trainer.accelerator.process_index)

    trainer.model.register_forward_pre_hook(forward)


def signal_while_writing(target: str, sig: signal.Signals) -> None:
    """While torch.save writes `target` (checkpoint-N/FILE), the process gets `sig`: SIGKILL halfway through the file
    (a kill -9 mid-save), SIGTERM before it (a preemption mid-save)."""
    real_save = torch.save

    def save(obj, path, *args, **kwargs):
        if not str(path).endswith(target):
            return real_save(obj, path, *args, **kwargs)
        if sig != signal.SIGKILL:
            os.kill(os.getpid(), sig)
            return real_save(obj, path, *args, **kwargs)
        real_save(obj, path, *args, **kwargs)
        data = Path(path).read_bytes()
        Path(path).write_bytes(data[: len(data) // 2])
        os.kill(os.getpid(), signal.SIGKILL)

    torch.save = save


def main() -> None:
    out, per_device, max_steps = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    overrides = parse_overrides(sys.argv[4:])
    mixed_share = overrides.pop("mixed_share", 0.25)
    resume = overrides.pop("resume", None)
    crash_after = overrides.pop("crash_after_save", None)
    if target := overrides.pop("kill_while_writing", None):
        signal_while_writing(target, signal.SIGKILL)
    if target := overrides.pop("sigterm_while_writing", None):
        signal_while_writing(target, signal.SIGTERM)
    for option in PREEMPT:
        PREEMPT[option] = overrides.pop(option, PREEMPT[option])
    iterable = overrides.pop("iterable", False)
    snapshots = overrides.pop("snapshots", False)
    skip_empty = overrides.pop("skip_empty", True)
    lora = overrides.pop("lora", None)
    for option in SCRIPT_OPTIONS:
        SCRIPT_OPTIONS[option] = overrides.pop(option, SCRIPT_OPTIONS[option])
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
        **activation_checkpointing_kwargs(False),
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        seed=0,
    )
    settings.update(overrides)
    dataset = difficulty_dataset(mixed_share)
    trainer = RecordingTrainer(
        model=str(build_tiny_model(out.parent / "tiny")),
        reward_funcs=[known_difficulty_reward, id_shaping]
        if SCRIPT_OPTIONS["reward"] == "ids"
        else known_difficulty_reward,
        args=DAPOConfig(**settings),
        train_dataset=dataset.to_iterable_dataset(num_shards=3) if iterable else dataset,
        peft_config=lora_config(lora),
    )
    if snapshots and trainer.accelerator.is_main_process:
        trainer.add_callback(Snapshots(out))
    if not skip_empty:
        trainer.remove_callback(SkipEmptySteps)
    if crash_after is not None:
        trainer.add_callback(CrashAfterSave(crash_after))
    preempt_in_training_forwards(trainer)
    trainer.train(resume_from_checkpoint=resume)
    final = full_parameters(trainer.accelerator.unwrap_model(trainer.model))  # ZeRO-3 shards gathered on every rank
    # forwards run with sequence parallelism
    sharded = getattr(trainer._forwards.sequence_parallel, "sharded_forwards", 0)
    (out / f"sharded_forwards_rank{trainer.accelerator.process_index}.txt").write_text(str(sharded))
    (out / f"preempted_rank{trainer.accelerator.process_index}.txt").write_text(str(trainer.preempted))
    if trainer.accelerator.is_main_process:
        (out / "log_history.json").write_text(json.dumps(trainer.state.log_history))
        torch.save({name: p.cpu() for name, p in final.items()}, out / "final_params.pt")
    leave_together(trainer.accelerator)


def lora_config(rank: int | None):
    if rank is None:
        return None
    from peft import LoraConfig

    return LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear", task_type="CAUSAL_LM")


if __name__ == "__main__":
    main()
