"""Two DAPO steps with vLLM in colocate mode (the engine lives in the trainer's process); check each weight sync.

Usage: python vllm_colocate_run.py OUT MODEL_DIR [key=value DAPOConfig overrides...]
On vLLM-CPU run it with VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CPU_OMP_THREADS_BIND=nobind VLLM_CPU_KVCACHE_SPACE=1.
After every weight sync, the in-process engine's log-probabilities of a fixed token sequence (prompt_logprobs) are
compared with the trainer model's; the gaps go to OUT/sync_checks.json with the log history. Exit 1 if a gap after a
sync exceeds 1e-5 or a gap before a later sync does not (the weights did not move).
"""

import json
import sys
import time
from pathlib import Path

import torch
from datasets import Dataset
from trl.models import unwrap_model_for_generation

from dapo_trl import DAPOConfig, DAPOTrainer
from dapo_trl.vllm_sync import engine_sequence_logprobs, model_sequence_logprobs

TOLERANCE = 1e-5
CHECK_TEXT = "What is 12 plus 7? First, 12 + 7 = 19.\nAnswer: 19"


def parity_reward(completion_ids, **kwargs) -> list[float]:
    """+1 / -1 by the parity of the completion's token-id sum: random-looking, so groups have spread (or not)."""
    return [1.0 if sum(ids) % 2 == 0 else -1.0 for ids in completion_ids]


def parse_value(text: str):
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return {"true": True, "false": False, "none": None}.get(text.lower(), text)


def main() -> None:
    out, model_dir = Path(sys.argv[1]), sys.argv[2]
    overrides = {k: parse_value(v) for k, v in (arg.split("=", 1) for arg in sys.argv[3:])}
    out.mkdir(parents=True, exist_ok=True)
    settings = dict(
        output_dir=str(out / "run"),
        use_vllm=True,
        vllm_mode="colocate",
        vllm_gpu_memory_utilization=0.3,
        vllm_max_model_length=256,
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=16,
        max_steps=2,
        learning_rate=1e-2,  # large, so each step visibly moves the weights the engine must pick up
        filter_groups_enable=True,
        max_filter_gen_batches=2,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        seed=0,
    )
    settings.update(overrides)
    rows = [{"prompt": f"What is {i} plus {i % 7}?", "solution": str(i + i % 7)} for i in range(64)]
    trainer = DAPOTrainer(
        model=model_dir,
        reward_funcs=parity_reward,
        args=DAPOConfig(**settings),
        train_dataset=Dataset.from_list(rows),
    )
    token_ids = trainer.processing_class(CHECK_TEXT).input_ids
    backend = trainer.vllm_generation
    print(f"[colocate] backend {type(backend).__name__}, engine dtype {backend.llm.llm_engine.model_config.dtype}")
    checks = []
    original_sync = backend.sync_weights

    def gap_to_engine() -> float:
        served = engine_sequence_logprobs(backend.llm, token_ids)[1:]
        with unwrap_model_for_generation(trainer.model_wrapped, trainer.accelerator) as model:
            was_training = model.training
            model.eval()
            local = model_sequence_logprobs(model, token_ids)
            model.train(was_training)
        return max(abs(a - b) for a, b in zip(served, local, strict=True))

    def checked_sync():
        before = gap_to_engine()  # the engine still has the previous weights
        start = time.monotonic()
        original_sync()
        seconds = time.monotonic() - start
        after = gap_to_engine()
        checks.append(
            {
                "global_step": trainer.state.global_step,
                "gap_before_sync": before,
                "gap_after_sync": after,
                "sync_seconds": seconds,
            }
        )
        print(
            f"[sync check] step {trainer.state.global_step}: gap before {before:.3g}, after {after:.3g}, "
            f"sync {seconds:.3f} s",
            flush=True,
        )

    backend.sync_weights = checked_sync
    start = time.monotonic()
    trainer.train()
    train_seconds = time.monotonic() - start
    checked_sync()  # the weights after the last step
    result = {
        "train_seconds": train_seconds,
        "backend": type(backend).__name__,
        "checks": checks,
        "log_history": trainer.state.log_history,
        "tolerance": TOLERANCE,
    }
    if trainer.accelerator.is_main_process:
        (out / "sync_checks.json").write_text(json.dumps(result, indent=2, default=float))
    worst = max(check["gap_after_sync"] for check in checks)
    moved = [check["gap_before_sync"] for check in checks[1:]]
    print(f"train {train_seconds:.1f} s; worst gap after sync {worst:.3g}; gaps before sync {moved}")
    sys.exit(0 if worst <= TOLERANCE and all(gap > TOLERANCE for gap in moved) else 1)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
