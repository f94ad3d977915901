"""Dynamic sampling's sampling efficiency and bookkeeping overhead in `DAPOTrainer`, on prompts of known difficulty.

What is measured
----------------
Every run trains the built-in tiny Qwen2 model (`dapo_trl.builtin_models.build_tiny_model`) with dynamic sampling on a
shuffled dataset of `--dataset-size` prompts whose accuracy is known in advance (the same design as
`tests/scripts/dynamic_sampling_run.py`): "easy k" always scores +1, "hard k" always -1 and "mixed k" scores
+1 / -1 alternately within its group (by row parity; groups are contiguous and of even size). Exactly the mixed
groups have accuracy spread, so the share p of mixed prompts in the dataset is the keep rate of every round
(up to sampling noise). Settings: `num_generations=4`, `per_device_train_batch_size=16` (4 groups per optimizer
step), `max_completion_length=8`, `max_filter_gen_batches=0` (unlimited rounds), no overlong penalty, no gradient
checkpointing, fp32 on CPU, `--steps` optimizer steps per run, fixed seed.

For each keep rate p (default 0.9, 0.5, 0.2) and each mode

- `discard`: the default, kept groups beyond the 4 a step needs are thrown away;
- `carry`: `filter_groups_carry_surplus=True`, they are trained in a later step;
- `os3 discard` / `os3 carry`: the same with `filter_groups_oversample=3` (12 groups per round);

table 1 reads the trainer's per-step metrics `dynamic_sampling/*` from `trainer.state.log_history` and reports
the measured keep rate (sum kept / sum generated), generated groups per trained group (sum generated /
(steps x 4)), the ideal 1 / keep rate (measured and nominal 1 / p), actual / ideal (measured), mean rounds per
step, discarded groups per step, carried-in groups per step, and the carried backlog after the last step (groups
generated and kept but not trained yet).

Table 2 times, with `time.perf_counter` in a `DAPOTrainer` subclass, per optimizer step: the whole
`DAPOTrainer._generate_and_score_completions` call (dynamic sampling), the time inside `_score_round`, and inside that
the time in TRL's own `GRPOTrainer._generate_and_score_completions` (generation + rewards + advantages). `bookkeeping` =
total - `_score_round` time: gathering rows, keep decisions, drawing fresh prompts, concatenating / cutting the batch,
carrying surplus, logging. `carry log-probs` = `_score_round` - TRL time: the extra forward pass that stores the
behaviour policy's log-probs when surplus is carried (DAPO's own work, not bookkeeping). The step time is TRL's
`step_time` metric from `log_history` (generation + scoring + forward/backward of the optimizer step). Reported: medians
over all steps of all runs of a (p, mode), after one untimed warm-up run; `share` is the median of the per-step ratios
bookkeeping / step_time.

With 10 steps a run sees only 50 to 200 groups, so the measured keep rate can be a few points off p (the ideal
columns give both); `--steps 50` brings it within about 0.01. Run from the repository root (about 25 s on 2 idle
CPU cores with the defaults, about 80 s with `--steps 50`):

    python benchmarks/dynamic_sampling.py
    python benchmarks/dynamic_sampling.py --quick   # keep rate 0.5, discard and carry, 1 step, no warm-up: a check
    python benchmarks/dynamic_sampling.py --steps 20 --keep-rates 0.5 0.1 --no-oversample
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import torch  # noqa: E402
import transformers  # noqa: E402
from common import package_version, quiet
from datasets import Dataset  # noqa: E402
from transformers import PrinterCallback  # noqa: E402
from trl import GRPOTrainer  # noqa: E402

from dapo_trl import DAPOConfig, DAPOTrainer  # noqa: E402
from dapo_trl.builtin_models import build_tiny_model  # noqa: E402
from dapo_trl.utils.transformers_compat import activation_checkpointing_kwargs  # noqa: E402

SEED = 0
NUM_GENERATIONS = 4
BATCH_SIZE = 16  # completions per optimizer step: 4 groups
MAX_COMPLETION_LENGTH = 8
METRIC_NAMES = (
    "groups_generated",
    "groups_kept",
    "rounds",
    "surplus_discarded_groups",
    "surplus_carried_groups",
    "carried_in_groups",
    "filler_groups",
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="keep rate 0.5, no over-sampling, 1 step, 40 prompts, no warm-up run"
    )
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps per run")
    parser.add_argument("--keep-rates", type=float, nargs="+", default=[0.9, 0.5, 0.2], help="shares of mixed prompts")
    parser.add_argument("--dataset-size", type=int, default=400, help="prompts in each shuffled dataset")
    parser.add_argument("--no-oversample", action="store_true", help="skip the filter_groups_oversample=3 runs")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.keep_rates, args.dataset_size, args.no_oversample = 1, [0.5], 40, True
    if args.steps < 1:
        parser.error("--steps must be >= 1")
    if any(not 0.0 < p <= 1.0 for p in args.keep_rates):
        parser.error("--keep-rates must be in (0, 1]: with no mixed prompt, unlimited rounds never fill a batch")
    if args.dataset_size < BATCH_SIZE // NUM_GENERATIONS:
        parser.error(f"--dataset-size must be >= {BATCH_SIZE // NUM_GENERATIONS}")
    return args


def difficulty_dataset(mixed_share: float, size: int, seed: int = SEED) -> Dataset:
    """`size` prompts, round(mixed_share * size) of them "mixed", the rest alternately easy / hard, shuffled."""
    num_mixed = round(mixed_share * size)
    kinds = ["mixed"] * num_mixed + ["easy" if i % 2 else "hard" for i in range(size - num_mixed)]
    random.Random(seed).shuffle(kinds)
    return Dataset.from_list([{"prompt": f"{kind} {i}", "solution": "1"} for i, kind in enumerate(kinds)])


def known_difficulty_reward(prompts, completions, **kwargs) -> list[float]:
    """+1 for easy, -1 for hard, and for mixed prompts +1 / -1 by row parity (groups are contiguous, even size)."""
    rewards = []
    for index, prompt in enumerate(prompts):
        kind = prompt.split()[0]
        rewards.append(1.0 if kind == "easy" else -1.0 if kind == "hard" else (1.0 if index % 2 == 0 else -1.0))
    return rewards


class _TRLScoringTimer(GRPOTrainer):
    """Sits between DAPOTrainer and GRPOTrainer in the MRO, so it times exactly TRL's generation + scoring."""

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        start = time.perf_counter()
        try:
            return super()._generate_and_score_completions(inputs)
        finally:
            self._trl_seconds += time.perf_counter() - start


class TimedDAPOTrainer(DAPOTrainer, _TRLScoringTimer):
    """DAPOTrainer that records, per dynamic-sampling call, the total, `_score_round` and TRL-only seconds."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._trl_seconds = 0.0
        self._score_round_seconds = 0.0
        self.sampling_timings: list[dict[str, float]] = []
        super().__init__(*args, **kwargs)

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        """DAPO's dynamic sampling (every round scored through `_score_round`), once per generation batch."""
        self._trl_seconds = 0.0
        self._score_round_seconds = 0.0
        start = time.perf_counter()
        output = super()._generate_and_score_completions(inputs)
        total = time.perf_counter() - start
        self.sampling_timings.append(
            {"total": total, "score_round": self._score_round_seconds, "trl": self._trl_seconds}
        )
        return output

    def _score_round(self, round_inputs: list[dict[str, Any]], *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return super()._score_round(round_inputs, *args, **kwargs)
        finally:
            self._score_round_seconds += time.perf_counter() - start


def modes(args: argparse.Namespace) -> list[tuple[str, dict[str, Any]]]:
    result = [
        ("discard", {"filter_groups_carry_surplus": False}),
        ("carry", {"filter_groups_carry_surplus": True}),
    ]
    if not args.no_oversample:
        result += [
            ("os3 discard", {"filter_groups_carry_surplus": False, "filter_groups_oversample": 3}),
            ("os3 carry", {"filter_groups_carry_surplus": True, "filter_groups_oversample": 3}),
        ]
    return result


def run_once(model_path: str, dataset: Dataset, steps: int, overrides: dict[str, Any]) -> dict[str, Any]:
    """Train a fresh TimedDAPOTrainer for `steps` steps; return per-step metrics and timings."""
    with tempfile.TemporaryDirectory(prefix="dynamic-sampling-bench-") as output_dir:
        config = DAPOConfig(
            output_dir=output_dir,
            per_device_train_batch_size=BATCH_SIZE,
            num_generations=NUM_GENERATIONS,
            max_completion_length=MAX_COMPLETION_LENGTH,
            max_steps=steps,
            filter_groups_enable=True,
            max_filter_gen_batches=0,
            apply_overlong_penalty=False,
            **activation_checkpointing_kwargs(False),
            report_to="none",
            save_strategy="no",
            logging_steps=1,
            disable_tqdm=True,
            seed=SEED,
            **overrides,
        )
        torch.manual_seed(SEED)
        trainer = TimedDAPOTrainer(
            model=model_path, reward_funcs=known_difficulty_reward, args=config, train_dataset=dataset
        )
        trainer.remove_callback(PrinterCallback)
        trainer.train()

    step_logs = [entry for entry in trainer.state.log_history if "dynamic_sampling/groups_generated" in entry]
    if len(step_logs) != steps or len(trainer.sampling_timings) != steps:
        raise RuntimeError(
            f"expected {steps} steps, got {len(step_logs)} step logs and {len(trainer.sampling_timings)} timed calls"
        )
    metrics = {name: [entry[f"dynamic_sampling/{name}"] for entry in step_logs] for name in METRIC_NAMES}
    return {
        "metrics": metrics,
        "step_time": [entry["step_time"] for entry in step_logs],
        "timings": trainer.sampling_timings,
        "target_groups": config.generation_batch_size // NUM_GENERATIONS,
    }


def efficiency_row(p: float, mode: str, run: dict[str, Any], steps: int) -> str:
    m = run["metrics"]
    generated, kept = sum(m["groups_generated"]), sum(m["groups_kept"])
    keep_rate = kept / generated
    per_trained = generated / (steps * run["target_groups"])
    ideal = 1.0 / keep_rate if keep_rate > 0 else float("inf")
    backlog = m["surplus_carried_groups"][-1]
    cells = [
        f"{p:.1f}",
        mode,
        f"{int(generated)}",
        f"{int(kept)}",
        f"{keep_rate:.3f}",
        f"{per_trained:.2f}",
        f"{ideal:.2f}",
        f"{1.0 / p:.2f}",
        f"{per_trained / ideal:.2f}",
        f"{statistics.mean(m['rounds']):.2f}",
        f"{statistics.mean(m['surplus_discarded_groups']):.2f}",
        f"{statistics.mean(m['carried_in_groups']):.2f}",
        f"{int(backlog)}",
    ]
    if any(m["filler_groups"]):
        cells[1] += f" ({int(sum(m['filler_groups']))} filler groups!)"
    return "| " + " | ".join(cells) + " |"


def overhead_row(p: float, mode: str, run: dict[str, Any]) -> str:
    timings, step_times = run["timings"], run["step_time"]
    bookkeeping = [t["total"] - t["score_round"] for t in timings]
    carry_pass = [t["score_round"] - t["trl"] for t in timings]
    shares = [b / s for b, s in zip(bookkeeping, step_times, strict=True)]
    rounds = run["metrics"]["rounds"]
    cells = [
        f"{p:.1f}",
        mode,
        f"{statistics.mean(rounds):.2f}",
        f"{statistics.median(t['total'] for t in timings) * 1e3:.1f}",
        f"{statistics.median(t['trl'] for t in timings) * 1e3:.1f}",
        f"{statistics.median(carry_pass) * 1e3:.2f}",
        f"{statistics.median(bookkeeping) * 1e3:.2f}",
        f"{statistics.median(b / r for b, r in zip(bookkeeping, rounds, strict=True)) * 1e3:.2f}",
        f"{statistics.median(step_times) * 1e3:.1f}",
        f"{statistics.median(shares):.2%}",
        f"{max(shares):.2%}",
    ]
    return "| " + " | ".join(cells) + " |"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    quiet()
    started = time.perf_counter()
    model_path = str(build_tiny_model())
    data_by_rate = {p: difficulty_dataset(p, args.dataset_size) for p in args.keep_rates}
    # One short untimed run first, so one-off process warm-up (lazy imports, allocator) hits no timed run.
    if not args.quick:
        run_once(model_path, data_by_rate[args.keep_rates[0]], 2, {})

    results: list[tuple[float, str, dict[str, Any]]] = []
    for p in args.keep_rates:
        for mode, overrides in modes(args):
            run_started = time.perf_counter()
            run = run_once(model_path, data_by_rate[p], args.steps, overrides)
            results.append((p, mode, run))
            print(
                f"p={p} {mode}: {args.steps} steps in {time.perf_counter() - run_started:.1f} s",
                file=sys.stderr,
                flush=True,
            )

    print(
        f"\nDynamic sampling on prompts of known difficulty: {args.dataset_size} shuffled prompts, batch {BATCH_SIZE} "
        f"({BATCH_SIZE // NUM_GENERATIONS} groups of {NUM_GENERATIONS}), max_completion_length "
        f"{MAX_COMPLETION_LENGTH}, max_filter_gen_batches 0, {args.steps} steps per run, torch threads "
        f"{torch.get_num_threads()}, trl {package_version('trl')}, transformers {transformers.__version__}, "
        f"torch {torch.__version__}\n"
    )
    print("### 1. Sampling efficiency\n")
    print(
        "| p (nominal) | mode | groups generated | groups kept | measured keep rate | generated / trained group "
        "| ideal 1/keep (measured) | ideal 1/p (nominal) | actual / ideal | rounds / step | discarded / step "
        "| carried in / step | carried backlog at end |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for p, mode, run in results:
        print(efficiency_row(p, mode, run, args.steps))
    print(
        "\n`generated / trained group` counts every generated group, including the backlog still carried after "
        "the last step; `os3` = filter_groups_oversample=3.\n"
    )
    print("### 2. Bookkeeping overhead (medians over steps)\n")
    print(
        "| p (nominal) | mode | rounds / step | DAPO `_generate_and_score_completions` (ms) | TRL generate+score (ms) "
        "| carry log-probs (ms) | bookkeeping (ms) | bookkeeping / round (ms) | step_time (ms) "
        "| bookkeeping share of step | max share |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for p, mode, run in results:
        print(overhead_row(p, mode, run))
    print(
        "\nbookkeeping = DAPO's `_generate_and_score_completions` - time inside `_score_round`; carry log-probs = "
        "`_score_round` - TRL's `_generate_and_score_completions`; step_time = TRL's `step_time` metric."
    )
    print(f"\ntotal wall time {time.perf_counter() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
