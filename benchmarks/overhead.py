"""Per-step overhead of `DAPOTrainer` against TRL's `GRPOTrainer` on the same tiny configuration.

What is measured
----------------
Both trainers train the built-in tiny Qwen2 model (`dapo_trl.builtin_models.tiny_model.build_tiny_model`) on
`make_arithmetic_dataset(num_problems=512, seed=0)` with the `dapo_math_reward` reward and the same settings (batch 16,
4 generations per prompt, 32 completion tokens, fp32 on CPU, no checkpointing, fixed seed). `GRPOTrainer` gets a
`trl.GRPOConfig` with `loss_type="dapo"`, `epsilon_high=0.28`, `weight_decay=0.1` and DAPOConfig's `use_cpu` and
`max_tool_calling_iterations`, so its loss, optimizer and device settings are the same as DAPO's (the script checks that
no shared field differs); `DAPOTrainer` gets a `DAPOConfig` with its defaults, so the soft overlong penalty reward
column and the exact per-step token denominator are on: that is the extra per-step work being measured.
The one exception is dynamic sampling (`filter_groups_enable`, on by default), which is turned off: it generates
extra rounds to replace filtered groups, which is more work per step rather than overhead (on the random tiny
model nearly every group is all-wrong, so it would run up to `max_filter_gen_batches` rounds per step);
`benchmarks/dynamic_sampling.py` measures it, and `--dynamic-sampling` keeps it on here anyway.
With the same seed both trainers sample the same completions, so step i is the same work in every run (the
script checks the logged mean completion lengths and says so).

All runs happen in one process: one short untimed warm-up run of each trainer, then GRPO, DAPO, GRPO, DAPO, ...
(`--repeats` runs of `--steps` optimizer steps each), so machine noise hits both alike. Per-step time is TRL's
own `step_time` metric from `trainer.state.log_history` (generation + scoring + forward/backward of each
optimizer step; the optimizer update is outside it); the first step of every run is dropped as warm-up.
The table gives the median, min and max over all kept steps and `ratio DAPO/GRPO` is the ratio of medians
(goal <= 1.03). Also reported:

- the median step with the time spent in `_generate` (sampling) subtracted;
- the median full optimizer-step wall time (callback `on_step_begin` to `on_step_end`, optimizer update included);
- the median `train_runtime` of the runs (all steps, warm-up step included);
- the ratio of run medians for each GRPO/DAPO pair, and a noise-robust ratio that sums, over step indices, the
  fastest time of that step over the runs (robust to bursts of load, not to jitter; valid because step i is
  the same work in every run);
- DAPO's extra bookkeeping in isolation (timeit), on a batch of the same size, as a share of DAPO's median step:
  `soft_overlong_penalty` + `steps.OptimizerSteps` summing each optimizer step's micro-batch token counts (the
  exact denominator's count), and the whole per-step path around them: the reward column, `StepPlanner.plan`'s
  loss-token counts, and `OptimizerSteps` handing out the micro-batches with their `num_items_in_batch`.

A step takes ~0.13 s here, so other processes on the machine move the medians a lot; the script measures how
many cores other processes used during each timed run (/proc/stat), warns when the machine was busy, and then
also gives the ratio over the GRPO/DAPO pairs that ran on an idle machine. Rerun on a quiet machine, or raise
`--repeats`, before reading a ratio near the goal.

Run from the repository root (under a minute on 2 idle CPU cores with the defaults):

    python benchmarks/overhead.py
    python benchmarks/overhead.py --quick   # 1 run of 2 steps each, 8 tokens, no warm-up runs: a check, no figure
    python benchmarks/overhead.py --steps 16 --repeats 5 --batch-size 32
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import timeit
from pathlib import Path
from types import SimpleNamespace
from typing import Any

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import torch  # noqa: E402
import transformers  # noqa: E402
from common import package_version, quiet
from transformers import PrinterCallback, TrainerCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from dapo_trl import DAPOConfig, DAPOTrainer  # noqa: E402
from dapo_trl.algorithm import soft_overlong_penalty  # noqa: E402
from dapo_trl.builtin_models import build_tiny_model  # noqa: E402
from dapo_trl.data import make_arithmetic_dataset  # noqa: E402
from dapo_trl.rewards import dapo_math_reward  # noqa: E402
from dapo_trl.training.sampling.overlong import SoftOverlongPenalty  # noqa: E402
from dapo_trl.training.step.batching import StepPlanner, loss_mask  # noqa: E402
from dapo_trl.training.step.steps import OptimizerSteps  # noqa: E402
from dapo_trl.utils.transformers_compat import activation_checkpointing_kwargs  # noqa: E402

SEED = 42
GOAL_RATIO = 1.03


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="1 run of 2 steps per trainer, 8 tokens, no warm-up runs: a check"
    )
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps per run (first one is warm-up)")
    parser.add_argument("--repeats", type=int, default=10, help="runs of each trainer, interleaved")
    parser.add_argument("--batch-size", type=int, default=16, help="per_device_train_batch_size (completions)")
    parser.add_argument("--num-generations", type=int, default=4)
    parser.add_argument("--max-completion-length", type=int, default=32)
    parser.add_argument(
        "--dynamic-sampling",
        action="store_true",
        help="keep DAPOConfig's dynamic sampling on (extra generation rounds per step, so not the same work)",
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="torch.set_num_threads (default: leave torch's default)"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.repeats, args.max_completion_length = 2, 1, 8
    if args.steps < 2:
        parser.error("--steps must be >= 2 (the first step of each run is skipped as warm-up)")
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    return args


def make_config(kind: str, args: argparse.Namespace, output_dir: str) -> GRPOConfig:
    common: dict[str, Any] = dict(
        output_dir=output_dir,
        per_device_train_batch_size=args.batch_size,
        num_generations=args.num_generations,
        max_completion_length=args.max_completion_length,
        max_steps=args.steps,
        bf16=False,
        report_to="none",
        logging_steps=1,
        save_strategy="no",
        **activation_checkpointing_kwargs(False),
        seed=SEED,
        disable_tqdm=True,
    )
    # Dynamic sampling (on by default) regenerates filtered groups: more generation per step, not overhead.
    dapo = DAPOConfig(**common, filter_groups_enable=args.dynamic_sampling)
    if kind == "DAPO":
        return dapo
    # Same loss kind and optimizer work as DAPOConfig's defaults (token-level loss, clip-higher, weight decay), and
    # the same device settings (DAPOConfig sets use_cpu, hence no pinned memory, on machines without a GPU), and
    # DAPOConfig's tool-turn cap (no tools here: it changes nothing, but the configs then differ in nothing).
    return GRPOConfig(
        **common,
        loss_type="dapo",
        epsilon_high=0.28,
        weight_decay=0.1,
        use_cpu=dapo.use_cpu,
        max_tool_calling_iterations=dapo.max_tool_calling_iterations,
    )


def config_differences(args: argparse.Namespace) -> list[str]:
    """GRPOConfig fields whose values differ between the two trainers' configs (should be none)."""
    with tempfile.TemporaryDirectory() as output_dir:
        grpo = make_config("GRPO", args, output_dir).to_dict()
        dapo = make_config("DAPO", args, output_dir).to_dict()
    return [f"{key}: {grpo[key]!r} vs {dapo[key]!r}" for key in grpo if grpo[key] != dapo.get(key)]


class StepTimer(TrainerCallback):
    """Full optimizer-step wall time, and time spent in `_generate` during each step."""

    def __init__(self) -> None:
        self.step_wall: list[float] = []
        self.step_generate: list[float] = []
        self._start = 0.0
        self._generate = 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        self._generate = 0.0
        self._start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.step_wall.append(time.perf_counter() - self._start)
        self.step_generate.append(self._generate)

    def wrap_generate(self, trainer: GRPOTrainer) -> None:
        original = trainer._generate

        def timed_generate(*a: Any, **kw: Any) -> Any:
            start = time.perf_counter()
            try:
                return original(*a, **kw)
            finally:
                self._generate += time.perf_counter() - start

        trainer._generate = timed_generate


def run_once(kind: str, model_path: str, dataset: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Train one fresh trainer for `args.steps` steps; per-step times exclude the first (warm-up) step."""
    with tempfile.TemporaryDirectory(prefix=f"overhead-{kind.lower()}-") as output_dir:
        config = make_config(kind, args, output_dir)
        trainer_cls = GRPOTrainer if kind == "GRPO" else DAPOTrainer
        torch.manual_seed(SEED)
        trainer = trainer_cls(model=model_path, reward_funcs=[dapo_math_reward], args=config, train_dataset=dataset)
        trainer.remove_callback(PrinterCallback)
        timer = StepTimer()
        trainer.add_callback(timer)
        timer.wrap_generate(trainer)
        result = trainer.train()

    step_logs = [entry for entry in trainer.state.log_history if "step_time" in entry]
    step_times = [entry["step_time"] for entry in step_logs]
    if len(step_times) != args.steps or len(timer.step_generate) != args.steps:
        raise RuntimeError(
            f"{kind}: expected {args.steps} steps, got {len(step_times)} step_time logs and "
            f"{len(timer.step_generate)} timed steps"
        )
    return {
        "step": step_times[1:],
        "no_gen": [s - g for s, g in zip(step_times[1:], timer.step_generate[1:], strict=True)],
        "wall": timer.step_wall[1:],
        "runtime": result.metrics["train_runtime"],
        "lengths": [round(entry.get("completions/mean_length", float("nan")), 4) for entry in step_logs],
    }


def bookkeeping_microbenchmark(args: argparse.Namespace) -> dict[str, float]:
    """Seconds per call of DAPO's per-step extras, on a batch of the benchmark's size (best of 5 timeit rounds).

    Each call covers one generation batch: its S micro-batches handed out by `OptimizerSteps` as DAPOTrainer's
    `_prepare_inputs` does, one optimizer step (K micro-steps) at a time.
    """
    with tempfile.TemporaryDirectory() as output_dir:
        config = make_config("DAPO", args, output_dir)
    n, max_len, buffer_len = args.batch_size, config.max_completion_length, config.overlong_buffer_len
    steps_per_generation, accumulation = config.steps_per_generation, config.gradient_accumulation_steps
    generator = torch.Generator().manual_seed(SEED)
    lengths = torch.randint(1, max_len + 1, (n,), generator=generator)
    completion_ids = [list(range(int(length))) for length in lengths]
    mask = (torch.arange(max_len).expand(n, max_len) < lengths[:, None]).long()
    micro_batches = [{"completion_mask": chunk} for chunk in mask.chunk(steps_per_generation)]
    counted = [{**batch, "loss_tokens": loss_mask(batch).sum().item()} for batch in micro_batches]
    penalty_column = SoftOverlongPenalty(max_len, buffer_len)
    # StepPlanner.plan's loss-token counts alone (no padding-free re-dealing of rows, no token budget: other work
    # than the denominator's); on one process accelerator.reduce returns its input.
    planner_args = SimpleNamespace(
        gradient_accumulation_steps=accumulation,
        steps_per_generation=steps_per_generation,
        padding_free=False,
        max_tokens_per_microbatch=None,
    )
    one_process = SimpleNamespace(device=torch.device("cpu"), reduce=lambda tensor, reduction: tensor)
    planner = StepPlanner(planner_args, one_process, config.loss_type)
    window_sums = OptimizerSteps(config, "cpu", exact_denominator=False)
    exact_denominator = OptimizerSteps(config, "cpu", exact_denominator=planner.exact_denominator)

    def one_generation_batch(steps: OptimizerSteps, generate: Any) -> None:
        # The Trainer loop: each optimizer step announces its K dataloader batches, then runs its micro-steps.
        for start in range(0, steps_per_generation, accumulation):
            window = range(start, min(start + accumulation, steps_per_generation))
            steps.begin(start, [None] * len(window))
            for step in window:
                steps.micro_batch(step, generate)

    def core() -> None:
        soft_overlong_penalty(lengths, max_len, buffer_len)
        one_generation_batch(window_sums, lambda step, prompts: counted)

    def full_path() -> None:
        # What DAPOTrainer adds per step: the reward column (list -> tensor -> list, one metric) and the exact
        # denominator (loss-mask sums per micro-batch, summed per optimizer step, num_items_in_batch).
        penalty_column(completion_ids=completion_ids, log_metric=lambda name, value: None)
        one_generation_batch(exact_denominator, lambda step, prompts: planner.plan(micro_batches))

    timings = {}
    for name, fn in (("core", core), ("full", full_path)):
        timer = timeit.Timer(fn)
        number, _ = timer.autorange()
        timings[name] = min(timer.repeat(repeat=5, number=number)) / number
    return timings


def cpu_seconds() -> tuple[float, float]:
    """(CPU seconds used by the whole machine, by this process) so far; machine = nan where /proc/stat is missing."""
    times = os.times()
    try:
        with open("/proc/stat") as stat:
            fields = [int(value) for value in stat.readline().split()[1:]]
        # user nice system idle iowait irq softirq steal ...: everything but idle and iowait is busy time.
        machine = (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        machine = float("nan")
    return machine, times.user + times.system


def quiet_pairs_medians(results: dict[str, list[dict[str, Any]]], max_other_cores: float) -> dict[str, float] | None:
    """Median step of each trainer over the GRPO/DAPO pairs in which other processes stayed under max_other_cores."""
    pairs = [
        (grpo, dapo)
        for grpo, dapo in zip(results["GRPO"], results["DAPO"], strict=True)
        if max(grpo["other_cores"], dapo["other_cores"]) <= max_other_cores
    ]
    if not pairs:
        return None
    medians = {
        kind: statistics.median(value for pair in pairs for value in pair[index]["step"])
        for index, kind in enumerate(("GRPO", "DAPO"))
    }
    return {**medians, "pairs": len(pairs)}


def summarize(values: list[float]) -> tuple[float, float, float]:
    return statistics.median(values), min(values), max(values)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    quiet()
    model_path = str(build_tiny_model())
    dataset = make_arithmetic_dataset(num_problems=512, seed=0)

    results: dict[str, list[dict[str, Any]]] = {"GRPO": [], "DAPO": []}
    # One short untimed run of each first, so one-off process warm-up (lazy imports, allocator) hits neither.
    warmup = argparse.Namespace(**{**vars(args), "steps": 2})
    for kind in () if args.quick else ("GRPO", "DAPO"):
        run_once(kind, model_path, dataset, warmup)

    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    machine_start, own_start = cpu_seconds()
    for repeat in range(args.repeats):
        for kind in ("GRPO", "DAPO"):
            machine_before, own_before = cpu_seconds()
            run_started = time.perf_counter()
            run = run_once(kind, model_path, dataset, args)
            machine_after, own_after = cpu_seconds()
            others = max(0.0, (machine_after - machine_before) - (own_after - own_before))
            run["other_cores"] = others / (time.perf_counter() - run_started)
            results[kind].append(run)
            print(
                f"[{repeat + 1}/{args.repeats}] {kind}: median step_time {statistics.median(run['step']):.4f} s, "
                f"train_runtime {run['runtime']:.2f} s, other processes used "
                f"{run['other_cores']:.2f} cores",
                file=sys.stderr,
                flush=True,
            )
    total = time.perf_counter() - started
    machine_end, own_end = cpu_seconds()
    other_cores = max(0.0, (machine_end - machine_start) - (own_end - own_start)) / total

    def pooled(kind: str, key: str) -> list[float]:
        return [value for run in results[kind] for value in run[key]]

    print(
        f"\nDAPOTrainer vs GRPOTrainer: batch {args.batch_size}, {args.num_generations} generations, "
        f"max_completion_length {args.max_completion_length}, {args.steps} steps x {args.repeats} runs each "
        f"(first step of each run skipped), DAPO dynamic sampling {'on' if args.dynamic_sampling else 'off'}, "
        f"torch threads {torch.get_num_threads()}, trl {package_version('trl')}, "
        f"transformers {transformers.__version__}, torch {torch.__version__}\n"
    )
    print(
        "| trainer | median step (s) | min | max | runs | steps | median step excl. generate (s) "
        "| median full step (s) | median train_runtime (s) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    medians: dict[str, dict[str, float]] = {}
    for kind in ("GRPO", "DAPO"):
        step_median, step_min, step_max = summarize(pooled(kind, "step"))
        medians[kind] = {
            "step": step_median,
            "no_gen": statistics.median(pooled(kind, "no_gen")),
            "wall": statistics.median(pooled(kind, "wall")),
            "runtime": statistics.median(run["runtime"] for run in results[kind]),
        }
        print(
            f"| {kind} | {step_median:.4f} | {step_min:.4f} | {step_max:.4f} | {len(results[kind])} "
            f"| {len(pooled(kind, 'step'))} | {medians[kind]['no_gen']:.4f} | {medians[kind]['wall']:.4f} "
            f"| {medians[kind]['runtime']:.2f} |"
        )

    ratio = medians["DAPO"]["step"] / medians["GRPO"]["step"]
    pair_ratios = [
        statistics.median(d["step"]) / statistics.median(g["step"])
        for g, d in zip(results["GRPO"], results["DAPO"], strict=True)
    ]
    print(f"\nratio DAPO/GRPO = {ratio:.3f}  (goal <= {GOAL_RATIO:.2f}: {'met' if ratio <= GOAL_RATIO else 'NOT met'})")
    print(f"ratio DAPO/GRPO excl. generate = {medians['DAPO']['no_gen'] / medians['GRPO']['no_gen']:.3f}")
    print(f"ratio DAPO/GRPO full step = {medians['DAPO']['wall'] / medians['GRPO']['wall']:.3f}")
    print(f"ratio DAPO/GRPO train_runtime = {medians['DAPO']['runtime'] / medians['GRPO']['runtime']:.3f}")
    print("per-pair ratios (run medians) = " + ", ".join(f"{r:.3f}" for r in pair_ratios))
    differences = config_differences(args)
    print("GRPOConfig fields that differ between the two configs: " + ("; ".join(differences) or "none"))
    same_work = all(g["lengths"] == d["lengths"] for g, d in zip(results["GRPO"], results["DAPO"], strict=True))
    print(
        f"same sampled completion lengths in every GRPO/DAPO pair (same work per step): {'yes' if same_work else 'no'}"
    )
    if same_work:
        # Step i does the same work in every run, so its fastest time over the runs is the least noisy estimate.
        best = {kind: sum(map(min, zip(*(run["step"] for run in runs), strict=True))) for kind, runs in results.items()}
        print(
            f"ratio DAPO/GRPO, per-step best of {args.repeats} runs (robust to bursts of load) = "
            f"{best['DAPO'] / best['GRPO']:.3f}"
        )
    cores = os.cpu_count() or 1
    idle = quiet_pairs_medians(results, max_other_cores=0.05 * cores)
    if idle is not None and idle["pairs"] < args.repeats:
        print(
            f"ratio DAPO/GRPO over the {idle['pairs']} of {args.repeats} pairs with an idle machine = "
            f"{idle['DAPO'] / idle['GRPO']:.3f} (medians {idle['GRPO']:.4f} s GRPO, {idle['DAPO']:.4f} s DAPO)"
        )
    load_after = os.getloadavg()[0]
    # /proc/stat tells what other processes really used; the load average (lagging, 1 minute) is the fallback.
    busy = other_cores > 0.1 * cores if other_cores == other_cores else max(load_before, load_after) > cores
    print(
        f"machine: {cores} cores, other processes used {other_cores:.2f} cores on average during the timed runs, "
        f"1-min load average {load_before:.2f} -> {load_after:.2f}"
        + (
            "\nWARNING: machine busy, medians are noisy; prefer the best-of ratio or rerun on a quiet machine"
            if busy
            else ""
        )
    )

    extra = bookkeeping_microbenchmark(args)
    step = medians["DAPO"]["step"]
    print(f"\nDAPO bookkeeping in isolation (timeit, batch of {args.batch_size} completions):\n")
    print("| work | time per step (us) | share of median DAPO step |")
    print("|---|---|---|")
    print(
        f"| soft_overlong_penalty + OptimizerSteps token sums | {extra['core'] * 1e6:.1f} "
        f"| {extra['core'] / step:.3%} |"
    )
    print(
        f"| full path (reward column + exact token denominator) | {extra['full'] * 1e6:.1f} "
        f"| {extra['full'] / step:.3%} |"
    )
    print(f"\ntraining runs took {total:.1f} s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
