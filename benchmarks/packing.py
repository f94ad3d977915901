"""Padding-free training: tokens fed per real token, training-phase time and peak memory, vs TRL's GRPOTrainer.

What is measured
----------------
A scripted rollout (TRL's `rollout_func`, no generation) returns completions whose lengths follow either a long
tail (log-normal, median L_max / 5, sigma 0.9, capped at L_max: mean about L_max / 4, the shape of DAPO's
responses) or a uniform mix (1..L_max). Token ids are random non-special ids; a completion shorter than L_max ends
with EOS. The reward gives every group spread (+1 / -1 alternating), so dynamic sampling keeps every group in one
round and the three trainers train on the same rows:

- `GRPOTrainer` (TRL 1.16, `loss_type="dapo"`, same batch and clip settings),
- `DAPOTrainer` with `padding_free=False` (TRL's padded micro-batches),
- `DAPOTrainer` with `padding_free=True` (the default: rows balanced by tokens, packed per forward).

Every model forward of the run is a training-phase forward (policy loss, plus old log-probs since
steps_per_generation = 2 x gradient_accumulation_steps): a hook on the input embeddings counts the tokens each
forward feeds and the real (non-pad) ones among them. `time/step` is the median of TRL's `step_time` over the
optimizer steps after the first, `real tokens / s` the real tokens of all forwards over the summed step times;
peak memory is the process's peak RSS on CPU (each configuration runs in its own process) or
`torch.cuda.max_memory_allocated` on CUDA.

Run from the repository root:

    python benchmarks/packing.py                                   # CPU, built-in tiny model, L_max 512
    python benchmarks/packing.py --quick           # L_max 64, long tail, 2 steps, in this process: the suite's check
    python benchmarks/packing.py --device cuda --model qwen2.5-0.5b --max-lengths 4096 16384 --dtype bf16 \\
        --mixes long-tail --batch 8 --accumulation 2 --gradient-checkpointing
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

TRAINERS = ("GRPOTrainer", "DAPOTrainer packing off", "DAPOTrainer packing on")


def completion_lengths(mix: str, count: int, max_length: int, seed: int) -> list[int]:
    import random

    rng = random.Random(seed)
    if mix == "uniform":
        return [rng.randint(1, max_length) for _ in range(count)]
    median = max_length / 5
    return [max(1, min(max_length, round(rng.lognormvariate(0.0, 0.9) * median))) for _ in range(count)]


def run_one(trainer_name: str, options: dict[str, Any]) -> dict[str, float]:
    """One configuration, in this process: returns fed / real tokens, step time and peak memory."""
    import torch
    from common import build_model, peak_memory_mb, quiet
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from dapo_trl import DAPOConfig, DAPOTrainer
    from dapo_trl.utils.transformers_compat import activation_checkpointing_kwargs

    quiet()
    work = Path(options["work"])
    model_path, tokenizer = build_model(options["model"], work, options["dtype"])
    max_length, mix, generations = options["max_length"], options["mix"], options["num_generations"]
    special = set(tokenizer.all_special_ids)
    normal_ids = [i for i in range(min(len(tokenizer), 700)) if i not in special]
    calls = {"count": 0}

    def rollout(prompts: list, trainer: Any) -> dict[str, list]:
        calls["count"] += 1
        lengths = completion_lengths(mix, len(prompts), max_length, seed=calls["count"])
        generator = torch.Generator().manual_seed(calls["count"])
        prompt_ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
        completions = []
        for length in lengths:
            picks = torch.randint(len(normal_ids), (length,), generator=generator).tolist()
            ids = [normal_ids[i] for i in picks]
            if length < max_length:
                ids[-1] = tokenizer.eos_token_id
            completions.append(ids)
        return {"prompt_ids": prompt_ids, "completion_ids": completions, "logprobs": None}

    def spread_reward(completions: list, **kwargs: Any) -> list[float]:
        return [1.0 if i % 2 == 0 else -1.0 for i in range(len(completions))]

    prompts = [f"Compute {a} plus {a + 3} and give the answer." for a in range(64)]
    dataset = Dataset.from_list([{"prompt": p, "solution": "0"} for p in prompts])
    common = dict(
        output_dir=str(work / "out" / trainer_name.replace(" ", "_")),
        per_device_train_batch_size=options["batch"],
        gradient_accumulation_steps=options["accumulation"],
        steps_per_generation=2 * options["accumulation"],
        num_generations=generations,
        max_completion_length=max_length,
        max_steps=options["steps"],
        learning_rate=1e-6,
        loss_type="dapo",
        epsilon_high=0.28,
        report_to="none",
        logging_steps=1,
        save_strategy="no",
        seed=0,
        bf16=options["dtype"] == "bf16",
        use_cpu=options["device"] == "cpu",
        **activation_checkpointing_kwargs(options["gradient_checkpointing"]),
        disable_tqdm=True,
        model_init_kwargs={"attn_implementation": options["attn"]},
    )
    if trainer_name == "GRPOTrainer":
        trainer_class, config = GRPOTrainer, GRPOConfig(**common)
    else:
        packing = trainer_name.endswith("on")
        config = DAPOConfig(**common, padding_free=packing, max_filter_gen_batches=1)
        trainer_class = DAPOTrainer
    trainer = trainer_class(
        model=model_path,
        reward_funcs=spread_reward,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        rollout_func=rollout,
    )
    counts = {"fed": 0, "real": 0}
    pad_id = tokenizer.pad_token_id

    def count_tokens(module: Any, args: tuple) -> None:
        (input_ids,) = args
        counts["fed"] += input_ids.numel()
        counts["real"] += int((input_ids != pad_id).sum())

    trainer.model.get_input_embeddings().register_forward_pre_hook(count_tokens)
    if options["device"] == "cuda":
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    step_times = [log["step_time"] for log in trainer.state.log_history if "step_time" in log]
    peak_mb = peak_memory_mb(options["device"])
    return {
        "fed_per_real": counts["fed"] / max(counts["real"], 1),
        "real_tokens": counts["real"],
        "step_time": statistics.median(step_times[1:] or step_times),
        "tokens_per_s": counts["real"] / max(sum(step_times), 1e-9),
        "peak_mb": peak_mb,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="L_max 64, the long tail only, 8 rows, 2 steps, every run in this process: a check, no figure",
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--model", choices=("tiny", "qwen2.5-0.5b"), default="tiny")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--max-lengths", type=int, nargs="+", default=[512])
    parser.add_argument("--mixes", nargs="+", default=["long-tail", "uniform"], choices=("long-tail", "uniform"))
    parser.add_argument("--batch", type=int, default=32, help="per_device_train_batch_size (rows): 4 prompts x 8")
    parser.add_argument("--accumulation", type=int, default=4)
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps per run (the first is not timed)")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--attn", default="sdpa", help="attn_implementation: sdpa, eager, flex_attention, ...")
    parser.add_argument("--work", default=None, help="folder for models and outputs (default: a temp dir)")
    parser.add_argument("--run-one", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.max_lengths, args.mixes, args.batch, args.accumulation, args.steps = [64], ["long-tail"], 8, 1, 2
    if args.run_one:
        print(json.dumps(run_one(args.run_one, json.loads(os.environ["PACKING_BENCH_OPTIONS"]))))
        return 0
    work = Path(args.work or tempfile.mkdtemp(prefix="packing-bench-"))
    layout = f"batch={args.batch} x accumulation={args.accumulation}, steps_per_generation={2 * args.accumulation}"
    print(
        f"device={args.device} model={args.model} dtype={args.dtype} attention={args.attn} {layout} "
        f"generations={args.num_generations}"
    )
    columns = (
        "L_max",
        "mix",
        "trainer",
        "fed / real tokens",
        "real tokens",
        "real tokens / s",
        "time / step (s)",
        "vs GRPO",
        "peak MB",
    )
    print("| " + " | ".join(columns) + " |")
    print("|---|---|---|---|---|---|---|---|---|")
    failed = False
    for max_length in args.max_lengths:
        for mix in args.mixes:
            baseline = None
            for trainer_name in TRAINERS:
                options = {
                    "work": str(work),
                    "model": args.model,
                    "dtype": args.dtype,
                    "device": args.device,
                    "max_length": max_length,
                    "mix": mix,
                    "batch": args.batch,
                    "accumulation": args.accumulation,
                    "num_generations": args.num_generations,
                    "steps": args.steps,
                    "gradient_checkpointing": args.gradient_checkpointing,
                    "attn": args.attn,
                }
                if args.quick:  # every run in this process: one interpreter start, peak memory not per run
                    with contextlib.redirect_stdout(sys.stderr):  # TRL's per-step log lines
                        result = run_one(trainer_name, options)
                else:
                    env = {**os.environ, "PACKING_BENCH_OPTIONS": json.dumps(options)}
                    command = [sys.executable, __file__, "--run-one", trainer_name]
                    done = subprocess.run(command, env=env, capture_output=True, text=True)
                    if done.returncode != 0:
                        print(f"| {max_length} | {mix} | {trainer_name} | failed: {done.stderr.strip()[-300:]} |")
                        failed = True
                        continue
                    result = json.loads(done.stdout.strip().splitlines()[-1])
                baseline = baseline or result["step_time"]
                print(
                    f"| {max_length} | {mix} | {trainer_name} | {result['fed_per_real']:.2f} | "
                    f"{result['real_tokens']} | {result['tokens_per_s']:.0f} | {result['step_time']:.2f} | "
                    f"{result['step_time'] / baseline:.2f} | "
                    f"{result['peak_mb']:.0f} |",
                    flush=True,
                )
    if args.quick:
        print("(--quick: every run in one process, so peak MB is not each run's own)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
