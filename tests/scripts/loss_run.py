"""The trainer's DAPO loss on each process's share of one fixed batch, for the padded and the packed forward at
temperature 1 and 0.7; the test compares their mean with verl's DAPO objective over the whole batch. Then every
registered loss, each share cut into token-budget passes, with an entropy bonus: the test compares their mean with the
whole batch's loss less the processes' mean entropy bonus.

Run as `python loss_run.py OUT` (one process) or under `accelerate launch --multi_gpu --num_processes 2`. Writes
OUT/model (the tiny model), OUT/batch.pt (the whole batch) and OUT/loss_rank{R}.pt ({case: loss}).
"""

import sys
from pathlib import Path

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM

from dapo_trl import DAPOConfig, DAPOTrainer
from dapo_trl.builtin_models import build_tiny_model

ROWS, PROMPT_LEN, COMPLETION_LEN = 8, 5, 10
CASES = [(padding_free, temperature) for padding_free in (False, True) for temperature in (1.0, 0.7)]
# Every registered loss, each process's half cut into token-budget passes (about one row each), with an entropy bonus:
# the passes and processes together must give the loss of the whole batch on one process, less each process's bonus
# (coef x the mean entropy of its half's loss tokens).
BUDGET = 12
ENTROPY_COEF = 0.5
LOSS_SETTINGS = {"luspo": {"importance_sampling_level": "sequence"}, "cispo": {"epsilon_high": 1.3}}
EPSILON_LOW, EPSILON_HIGH, CLIP_RATIO_C = 0.2, 0.28, 1.5


def case_name(padding_free: bool, temperature: float) -> str:
    return f"{'packed' if padding_free else 'padded'}-t{temperature}"


def token_log_probs(model, batch: dict, temperature: float) -> torch.Tensor:
    """An independent forward: full logits of the plain model, divided by the temperature, log-softmax."""
    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    logits = model(input_ids=input_ids, attention_mask=attention).logits[:, PROMPT_LEN - 1 : -1] / temperature
    return torch.log_softmax(logits.float(), -1).gather(-1, batch["completion_ids"].unsqueeze(-1)).squeeze(-1)


def fixed_batch(model_dir: Path) -> dict:
    """Rows of different lengths (left-padded prompts, right-padded completions) whose old log-probs are the
    current ones plus noise, so both clip sides and dual-clip bind; the same on every process."""
    generator = torch.Generator().manual_seed(11)
    vocab = AutoModelForCausalLM.from_pretrained(model_dir).config.vocab_size
    lengths = torch.randint(1, COMPLETION_LEN + 1, (ROWS,), generator=generator)
    prompt_lengths = torch.randint(1, PROMPT_LEN + 1, (ROWS,), generator=generator)
    return {
        "prompt_ids": torch.randint(3, vocab, (ROWS, PROMPT_LEN), generator=generator),
        "prompt_mask": (torch.arange(PROMPT_LEN)[None, :] >= PROMPT_LEN - prompt_lengths[:, None]).long(),
        "completion_ids": torch.randint(3, vocab, (ROWS, COMPLETION_LEN), generator=generator),
        "completion_mask": (torch.arange(COMPLETION_LEN)[None, :] < lengths[:, None]).long(),
        "advantages": torch.randn(ROWS, generator=generator),
        "noise": 0.8 * torch.randn(ROWS, COMPLETION_LEN, generator=generator),
    }


def budget_case(loss_type: str) -> str:
    return f"budget-{loss_type}"


def trainer_for(out: Path, model_dir: Path, **settings) -> DAPOTrainer:
    """A trainer in training mode over the tiny model, its loss over half the fixed batch per process."""
    from dapo_trl.utils.transformers_compat import activation_checkpointing_kwargs

    config = DAPOConfig(
        output_dir=str(out / "run"),
        per_device_train_batch_size=ROWS // 2,
        num_generations=4,
        max_completion_length=COMPLETION_LEN,
        report_to="none",
        **activation_checkpointing_kwargs(False),
        apply_overlong_penalty=False,
        **{"epsilon": EPSILON_LOW, "epsilon_high": EPSILON_HIGH, **settings},
    )
    prompts = Dataset.from_list([{"prompt": "p", "solution": "1"}] * 8)
    trainer = DAPOTrainer(model=str(model_dir), args=config, train_dataset=prompts)
    trainer.current_gradient_accumulation_steps = 1
    trainer.model.train()
    return trainer


def process_inputs(trainer: DAPOTrainer, batch: dict, temperature: float) -> tuple[dict, torch.Tensor]:
    """This process's half of the batch, with old log-probs (the current ones plus noise) and every process's loss
    tokens as num_items_in_batch; and the whole batch's old log-probs."""
    with torch.no_grad():
        old = token_log_probs(trainer.model, batch, temperature) + batch["noise"]
    process, processes = trainer.accelerator.process_index, trainer.accelerator.num_processes
    share = slice(process * ROWS // processes, (process + 1) * ROWS // processes)
    inputs = {key: value[share] for key, value in batch.items() if key != "noise"}
    inputs["old_per_token_logps"] = old[share]
    inputs["num_items_in_batch"] = batch["completion_mask"].sum()
    return inputs, old


def main() -> None:
    out = Path(sys.argv[1])
    from script_args import leave_together

    from dapo_trl.algorithm.losses import POLICY_LOSSES

    model_dir = build_tiny_model(out / "model")
    batch = fixed_batch(model_dir)
    losses, trainer = {}, None
    for padding_free, temperature in CASES:
        settings = {"clip_ratio_c": CLIP_RATIO_C, "padding_free": padding_free, "temperature": temperature}
        trainer = trainer_for(out, model_dir, **settings)
        inputs, old = process_inputs(trainer, batch, temperature)
        losses[case_name(padding_free, temperature)] = trainer.compute_loss(trainer.model, inputs).item()
        torch.save(old, out / f"old_{case_name(padding_free, temperature)}.pt")
    for loss_type in POLICY_LOSSES:
        dual_clip = {"clip_ratio_c": CLIP_RATIO_C} if POLICY_LOSSES[loss_type].dual_clip else {}
        settings = {
            "padding_free": True,
            "max_tokens_per_microbatch": BUDGET,
            "entropy_coef": ENTROPY_COEF,
            **dual_clip,
        }
        trainer = trainer_for(out, model_dir, loss_type=loss_type, **settings, **LOSS_SETTINGS.get(loss_type, {}))
        inputs, old = process_inputs(trainer, batch, 1.0)
        (planned,) = trainer._planner.plan([inputs])
        assert planned["backward_passes"] > 1, planned["backward_passes"]  # the budget really splits
        planned["num_items_in_batch"] = inputs["num_items_in_batch"]
        losses[budget_case(loss_type)] = trainer.compute_loss(trainer.model, planned).item()
        torch.save(old, out / f"old_{budget_case(loss_type)}.pt")
    torch.save(batch, out / "batch.pt")
    torch.save(losses, out / f"loss_rank{trainer.accelerator.process_index}.pt")
    leave_together(trainer.accelerator)


if __name__ == "__main__":
    main()
