"""Long responses: peak memory and real tokens per second against response length, DAPOTrainer vs TRL's GRPOTrainer,
and the memory split of Ulysses sequence parallelism on two processes.

What is measured
----------------
`curve` (the default): for each response length L (doubling), one process trains `--steps` optimizer steps of
`--rows` rows whose completions are exactly L tokens (a scripted rollout, TRL's `rollout_func`: no generation; the
reward gives every group spread, so every row trains) with activation checkpointing, on a random-init model of the
chosen config. Each (trainer, L) runs in its own process. Memory is `torch.cuda.max_memory_allocated` on CUDA; on
CPU, the most RSS rises during a training micro-step (see `--sp-split`), beside the process's peak RSS. `real
tokens / s` counts the tokens of every training-phase forward (policy loss and old log-probs) over the summed step
times; a run that raises out-of-memory prints `OOM`, and the table ends
with the longest L each trainer trained.

`--sp-split`: DAPOTrainer on two gloo CPU processes (`accelerate launch --multi_gpu --num_processes 2`), one row of
L tokens per process, `max_tokens_per_microbatch` = L / 2, without activation checkpointing, at
`sequence_parallel_size` 1 and 2, two optimizer steps. Printed per process, in RSS above its level when the call
starts: what a training forward keeps for the backward (its activations), the forward's peak (with its temporaries,
which grow slower than the row: measured on this model without SP, 528 MB at both 4k and 8k tokens), a training
micro-step's peak (forwards, backwards, gradients); and the peak RSS. With SP = 2 each process holds half of each
long row. On CPU the child processes run with a fixed glibc mmap threshold so that RSS follows live tensors
(`LIVE_RSS`).

`benchmarks/gpu_check.py` runs this script's `--run-one` on one GPU with long-tailed response lengths, padding-free
and padded, and with its attention probe (`common.ForwardProbe`) read: which forwards ran packed, which kernels ran.

Run from the repository root:

    python benchmarks/long_context.py                                           # CPU, scaled down
    python benchmarks/long_context.py --quick                 # tiny model, 128 tokens, 1 step: the suite's check
    python benchmarks/long_context.py --sp-split                                # SP memory split, 2 CPU processes
    python benchmarks/long_context.py --device cuda --model qwen2.5-1.5b --dtype bf16 \\
        --lengths 2048 4096 8192 16384 32768 65536 --attn flash_attention_2      # one GPU: the curve at SP 1
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
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import MODELS, build_model  # noqa: E402

TRAINERS = ("GRPOTrainer", "DAPOTrainer")
# glibc keeps freed memory for reuse and raises its mmap threshold as large blocks come and go, so RSS would hold
# the freed activations of an earlier pass; a fixed 64 KiB threshold returns every large block on free, and RSS
# follows the live tensors (measured: the rise of each pass repeats to 1%).
LIVE_RSS = {"MALLOC_MMAP_THRESHOLD_": "65536"}


def memory_status_mb(field: str) -> float:
    """VmRSS (now) or VmHWM (peak since the last `reset_peak_rss`) of this process, from /proc/self/status."""
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith(field + ":"))
    return int(line.split()[1]) / 1024


def reset_peak_rss() -> None:
    """Linux: the peak RSS (VmHWM) restarts from the current RSS."""
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")


def run_one(trainer_name: str, options: dict[str, Any]) -> dict[str, Any]:
    """One configuration in this process (or in each of the launched processes)."""
    import torch
    from common import ForwardProbe, peak_memory_mb, quiet
    from datasets import Dataset
    from packing import completion_lengths
    from trl import GRPOConfig, GRPOTrainer

    from dapo_trl import DAPOConfig, DAPOTrainer
    from dapo_trl.utils.transformers_compat import activation_checkpointing_kwargs

    quiet()
    work = Path(options["work"])
    model_path, tokenizer = build_model(options["model"], work, options["dtype"])
    length = options["length"]
    special = set(tokenizer.all_special_ids)
    normal_ids = [i for i in range(min(len(tokenizer), 700)) if i not in special]

    calls = {"count": 0}

    def rollout(prompts: list, trainer: Any) -> dict[str, list]:
        prompt_ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
        if options.get("mix", "exact") == "exact":  # exactly `length` tokens, no EOS
            generator = torch.Generator().manual_seed(len(prompts))
            picks = torch.randint(len(normal_ids), (len(prompts), length), generator=generator).tolist()
            completions = [[normal_ids[i] for i in row] for row in picks]
            return {"prompt_ids": prompt_ids, "completion_ids": completions, "logprobs": None}
        # "long-tail": packing.py's log-normal lengths, the first row exactly `length` (the padded width); the same
        # rows for every trainer (seeded by the call), shorter rows ending with EOS
        calls["count"] += 1
        lengths = [length, *completion_lengths("long-tail", len(prompts) - 1, length, seed=calls["count"])]
        generator = torch.Generator().manual_seed(calls["count"])
        completions = []
        for size in lengths:
            ids = [normal_ids[i] for i in torch.randint(len(normal_ids), (size,), generator=generator).tolist()]
            if size < length:
                ids[-1] = tokenizer.eos_token_id
            completions.append(ids)
        return {"prompt_ids": prompt_ids, "completion_ids": completions, "logprobs": None}

    rank = int(os.environ.get("RANK", "0"))

    def spread_reward(completions: list, **kwargs: Any) -> list[float]:  # +1 / -1 alternating over all processes
        return [1.0 if (i + rank * len(completions)) % 2 == 0 else -1.0 for i in range(len(completions))]

    dataset = Dataset.from_list([{"prompt": f"Question {i}: add {i} and {i + 1}.", "solution": "0"} for i in range(64)])
    common = dict(
        output_dir=str(work / "out" / trainer_name),
        per_device_train_batch_size=options["rows"],
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_generations=2,
        max_completion_length=length,
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
        **activation_checkpointing_kwargs(options["checkpointing"]),
        disable_tqdm=True,
        model_init_kwargs={"attn_implementation": options["attn"]},
    )
    if trainer_name == "GRPOTrainer":
        trainer_class, config = GRPOTrainer, GRPOConfig(**common)
    else:
        trainer_class = DAPOTrainer
        config = DAPOConfig(
            **common,
            max_filter_gen_batches=1,
            apply_overlong_penalty=False,
            padding_free=options.get("padding_free", True),
            sequence_parallel_size=options.get("sequence_parallel_size", 1),
            max_tokens_per_microbatch=options.get("budget"),
        )
    trainer = trainer_class(
        model=model_path,
        reward_funcs=spread_reward,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        rollout_func=rollout,
    )
    counts = {"real": 0, "fed": 0}
    step_tokens: dict[int, int] = {}  # real tokens per optimizer step
    pad_id = tokenizer.pad_token_id

    def count_tokens(module: Any, args: tuple) -> None:
        real = int((args[0] != pad_id).sum())
        counts["real"] += real
        counts["fed"] += args[0].numel()
        step = trainer.state.global_step
        step_tokens[step] = step_tokens.get(step, 0) + real

    trainer.model.get_input_embeddings().register_forward_pre_hook(count_tokens)
    rises: dict[str, list[float]] = {"forward": [], "kept": [], "micro_step": []}

    def measured(function: Any, kind: str) -> Any:
        """`function`, recording how far RSS rises above its level when it is called, at most and on return (CPU)."""

        def call(*args: Any, **kwargs: Any) -> Any:
            reset_peak_rss()
            start = memory_status_mb("VmRSS")
            try:
                return function(*args, **kwargs)
            finally:
                rises[kind].append(memory_status_mb("VmHWM") - start)
                if kind == "forward":  # what the forward keeps for the backward: its activations
                    rises["kept"].append(memory_status_mb("VmRSS") - start)

        return call

    if options["device"] == "cpu":  # each model forward (a shard, with SP), each micro-step (forwards + backwards)
        model = trainer.accelerator.unwrap_model(trainer.model)
        model.forward = measured(model.forward, "forward")
        trainer.training_step = measured(trainer.training_step, "micro_step")
    probe = ForwardProbe(options["attn"])  # which forwards ran packed, which attention kernels ran
    probe.watch(trainer.accelerator.unwrap_model(trainer.model))
    if options["device"] == "cuda":
        torch.cuda.reset_peak_memory_stats()
    try:
        with contextlib.closing(probe.open()):
            trainer.train()
    except torch.OutOfMemoryError:
        return {"oom": True}
    step_times = [log["step_time"] for log in trainer.state.log_history if "step_time" in log]
    peak_mb = peak_memory_mb(options["device"])
    timed = step_times[1:] or step_times  # the first step warms kernels and allocator up
    timed_tokens = sum(tokens for step, tokens in step_tokens.items() if step >= len(step_times) - len(timed))
    forwards = getattr(trainer, "_forwards", None)
    return {
        "oom": False,
        "peak_mb": peak_mb,
        "forward_rise_mb": max(rises["forward"], default=None),
        "kept_mb": max(rises["kept"], default=None),
        "micro_step_rise_mb": max(rises["micro_step"], default=None),
        "step_time": statistics.median(step_times[1:] or step_times),
        "tokens_per_s": counts["real"] / max(sum(step_times), 1e-9),
        "timed_tokens_per_s": timed_tokens / max(sum(timed), 1e-9),
        "real_tokens": counts["real"],
        "fed_per_real": counts["fed"] / max(counts["real"], 1),
        "steps": len(step_times),
        "packing_mode": getattr(forwards, "packing", None),  # DAPOTrainer's choice: sequence, bins or None
        "peak_reserved_mb": torch.cuda.max_memory_reserved() / 2**20 if options["device"] == "cuda" else None,
        **probe.summary(),
    }


def curve(args: argparse.Namespace, work: Path) -> bool:
    """The memory / throughput table; False when a run failed other than by running out of memory."""
    print(
        f"device={args.device} model={args.model} dtype={args.dtype} attention={args.attn} rows={args.rows} "
        f"steps={args.steps} activation checkpointing=on"
    )
    memory = "peak GPU MB" if args.device == "cuda" else "micro-step rise MB"
    print(
        f"| response tokens | trainer | {memory} | peak MB | real tokens / s (timed steps) | time / step (s) "
        "| DAPO / GRPO memory |"
    )
    print("|---|---|---|---|---|---|---|")
    longest = dict.fromkeys(TRAINERS, 0)
    failed = False
    for length in args.lengths:
        peaks = {}
        for trainer_name in TRAINERS:
            options = {
                "work": str(work),
                "model": args.model,
                "dtype": args.dtype,
                "device": args.device,
                "length": length,
                "rows": args.rows,
                "steps": args.steps,
                "checkpointing": True,
                "attn": args.attn,
            }
            if args.quick:  # every run in this process: one interpreter start, memory columns not per run
                with contextlib.redirect_stdout(sys.stderr):  # TRL's per-step log lines
                    result = run_one(trainer_name, options)
            else:
                env = {**os.environ, "LONG_CONTEXT_OPTIONS": json.dumps(options), **LIVE_RSS}
                done = subprocess.run(
                    [sys.executable, __file__, "--run-one", trainer_name], env=env, capture_output=True, text=True
                )
                lines = done.stdout.strip().splitlines()
                if done.returncode != 0 or not lines:
                    oom = "out of memory" in done.stderr.lower() or done.returncode in (-9, 137)
                    print(f"| {length} | {trainer_name} | {'OOM' if oom else 'failed: ' + done.stderr[-200:]} |")
                    failed = failed or not oom
                    continue
                result = json.loads(lines[-1])
            if result["oom"]:
                print(f"| {length} | {trainer_name} | OOM | | | | |", flush=True)
                continue
            longest[trainer_name] = length
            used = result["peak_mb"] if args.device == "cuda" else result["micro_step_rise_mb"]
            peaks[trainer_name] = used
            ratio = f"{peaks['DAPOTrainer'] / peaks['GRPOTrainer']:.2f}" if len(peaks) == 2 else ""
            print(
                f"| {length} | {trainer_name} | {used:.0f} | {result['peak_mb']:.0f} | "
                f"{result['timed_tokens_per_s']:.0f} | {result['step_time']:.2f} | {ratio} |",  # not the warm-up
                flush=True,
            )
    print("longest response trained: " + ", ".join(f"{name} {tokens}" for name, tokens in longest.items()))
    if args.quick:
        print("(--quick: every run in one process, so the memory columns are not each run's own)")
    return not failed


def sp_split(args: argparse.Namespace, work: Path) -> bool:
    """The SP 1 vs 2 memory table; False when a launch failed."""
    length = args.sp_length
    print(
        f"DAPOTrainer, 2 gloo CPU processes, one row of {length} response tokens per process, model={args.model}, "
        f"max_tokens_per_microbatch={length // 2}, no activation checkpointing"
    )
    columns = (
        "sequence_parallel_size",
        "process",
        "activations kept MB",
        "forward peak MB",
        "forward + backward MB",
        "peak RSS MB",
        "time / step (s)",
    )
    print("| " + " | ".join(columns) + " |")
    print("|---|---|---|---|---|---|---|")
    rises, failed = {}, False
    for size in (1, 2):
        out = work / f"sp{size}"
        out.mkdir(parents=True, exist_ok=True)
        options = {
            "work": str(work),
            "model": args.model,
            "dtype": "fp32",
            "device": "cpu",
            "length": length,
            "rows": 1,
            "steps": 2,
            "checkpointing": False,
            "attn": "sdpa",
            "sequence_parallel_size": size,
            "budget": length // 2,
            "out": str(out),
        }
        build_model(args.model, work, "fp32")  # once, before the processes start
        env = {**os.environ, "LONG_CONTEXT_OPTIONS": json.dumps(options), **LIVE_RSS}
        port = str(29500 + os.getpid() % 1000)
        command = [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--multi_gpu",
            "--num_processes",
            "2",
            "--num_machines",
            "1",
            "--mixed_precision",
            "no",
            "--dynamo_backend",
            "no",
            "--main_process_port",
            port,
            __file__,
            "--run-one",
            "DAPOTrainer",
        ]
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            print(f"| {size} | failed: {done.stderr.strip()[-400:]} |")
            failed = True
            continue
        for rank in range(2):
            result = json.loads((out / f"rank{rank}.json").read_text())
            measures = ("kept_mb", "forward_rise_mb", "micro_step_rise_mb")
            rises[size, rank] = [result[name] for name in measures]
            print(
                f"| {size} | {rank} | "
                + " | ".join(f"{result[name]:.0f}" for name in measures)
                + f" | {result['peak_mb']:.0f} | {result['step_time']:.1f} |",
                flush=True,
            )
    if len(rises) == 4:
        kept, forward, step = ([max(rises[size, r][i] for r in range(2)) for size in (1, 2)] for i in range(3))
        print(
            f"sequence parallelism: per process, SP 2 keeps {kept[1] / kept[0]:.2f}x the activations of SP 1 "
            f"(forward peak {forward[1] / forward[0]:.2f}x, with backward {step[1] / step[0]:.2f}x)"
        )
    return not failed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="the tiny model, 128 tokens, 1 step, in this process (--sp-split: 256 tokens): a check, no figure",
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--model", choices=("tiny", *MODELS), default="cpu-mid")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    parser.add_argument("--rows", type=int, default=2, help="rows per optimizer step (one prompt x 2 generations)")
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps per run (the first is not timed)")
    parser.add_argument("--attn", default="sdpa", help="attn_implementation: sdpa, flash_attention_2, ...")
    parser.add_argument("--sp-split", action="store_true", help="the SP 1 vs 2 memory split on 2 CPU processes")
    parser.add_argument("--sp-length", type=int, default=8192, help="response tokens per process for --sp-split")
    parser.add_argument("--work", default=None, help="folder for models and outputs (default: a temp dir)")
    parser.add_argument("--run-one", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.model, args.lengths, args.steps, args.sp_length = "tiny", [128], 1, 256
    if args.run_one:
        options = json.loads(os.environ["LONG_CONTEXT_OPTIONS"])
        result = run_one(args.run_one, options)
        if "out" in options:
            rank = int(os.environ.get("RANK", "0"))
            (Path(options["out"]) / f"rank{rank}.json").write_text(json.dumps(result))
        else:
            print(json.dumps(result))
        return 0
    work = Path(args.work or tempfile.mkdtemp(prefix="long-context-bench-"))
    return 0 if (sp_split(args, work) if args.sp_split else curve(args, work)) else 1


if __name__ == "__main__":
    sys.exit(main())
