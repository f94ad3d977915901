"""Prompt triage on real learning: the demo's run (`DEMO=1 ./test_dapo.sh`: the built-in tiny model on the 256
built-in arithmetic problems, 16 prompts x 8 responses a step) with `--prompt_triage` off and on, over seeds.

What is measured
----------------
Each run trains with dynamic sampling (DAPO's defaults) for `--steps` optimizer steps, then scores the trained model
on all 256 problems (`--problems`; 4 samples each at temperature 1: avg@4, the same for every arm, so the skipped
prompts count).
Printed per arm and seed: generated tokens per trained token (`rollout/generated_tokens_per_trained_token`,
averaged over the steps after the first pass over the data, when triage has a history), groups generated per
step, seconds per step, prompts skipped, and the final avg@4. The summary line gives the reduction in generated
tokens per trained token and whether triage's accuracy lies within the seeds' spread of the run without it.
`--plot PATH` draws the training accuracy of every run (the accuracy reward's mean per step over the responses it
generated: with triage, fewer of them come from prompts always right or always wrong) in one chart.

    python benchmarks/prompt_triage.py                 # 150 steps, seeds 0 1 2, both arms (~14 min on 2 cores)
    python benchmarks/prompt_triage.py --quick         # 6 steps, seed 0: the suite's quick form
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from common import package_version, quiet  # noqa: E402

GROUP = 8  # responses per prompt, as the demo


def train(triage: bool, seed: int, steps: int, work: Path, problems: int, prompts: int) -> dict:
    """One run; its per-step metrics and the trained model's avg@4 over every problem."""
    from transformers import PrinterCallback, TrainerCallback

    from dapo_trl import DAPOConfig, DAPOTrainer
    from dapo_trl.data import load_prompt_dataset

    dataset = load_prompt_dataset("builtin:arithmetic")
    history: list[dict] = []

    class Record(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                history.append(dict(logs))

    config = DAPOConfig(  # test_dapo.sh's DEMO settings
        output_dir=str(work / f"{'on' if triage else 'off'}-{seed}"),
        seed=seed,
        max_steps=steps,
        per_device_train_batch_size=prompts * GROUP,
        num_generations=GROUP,
        learning_rate=5e-4,
        lr_scheduler_type="constant",
        max_completion_length=32,
        overlong_buffer_len=8,
        prompt_triage=triage,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        eval_num_samples=4,
        eval_temperature=1.0,
        disable_tqdm=True,
    )
    held = dataset.select(range(problems))
    trainer = DAPOTrainer(model="builtin:tiny", args=config, train_dataset=dataset, eval_dataset=held)
    trainer.add_callback(Record())
    trainer.remove_callback(PrinterCallback)
    start = time.perf_counter()
    trainer.train()
    seconds = (time.perf_counter() - start) / steps
    scores = trainer.evaluate()
    accuracy = next(value for key, value in scores.items() if "avg@4" in key and "arithmetic" in key)
    return {"history": history, "seconds_per_step": seconds, "final_accuracy": accuracy}


def mean_after(history: list[dict], key: str, first: int) -> float:
    values = [entry[key] for entry in history[first:] if key in entry]
    return statistics.fmean(values) if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--problems", type=int, default=256, help="problems the final avg@4 is over")
    parser.add_argument("--prompts", type=int, default=16, help="prompts a step (x 8 responses)")
    parser.add_argument("--quick", action="store_true", help="3 steps of 4 prompts, seed 0, avg@4 over 16 problems")
    parser.add_argument("--plot", help="write the training-accuracy chart here (a PNG)")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.seeds, args.problems, args.prompts = 3, [0], 16, 4
    quiet()
    print(
        f"# Prompt triage on the demo's run: builtin:tiny, 256 arithmetic problems, {args.prompts} x {GROUP} a "
        f"step, {args.steps} steps (torch {package_version('torch')}, trl {package_version('trl')})\n"
    )
    first_pass = 256 // args.prompts  # steps before every prompt has been sampled once (roughly)
    skip = min(first_pass, args.steps // 2)
    runs: dict[tuple[bool, int], dict] = {}
    with tempfile.TemporaryDirectory() as work:
        for seed in args.seeds:
            for triage in (False, True):
                runs[triage, seed] = train(triage, seed, args.steps, Path(work), args.problems, args.prompts)
    print(
        "| prompt triage | seed | generated tokens per trained token | groups generated per step | s per step | "
        "prompts skipped | final avg@4 |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for (triage, seed), run in sorted(runs.items(), key=lambda item: (item[0][0], item[0][1])):
        history = run["history"]
        print(
            f"| {'on' if triage else 'off'} | {seed} "
            f"| {mean_after(history, 'rollout/generated_tokens_per_trained_token', skip):.2f} "
            f"| {mean_after(history, 'dynamic_sampling/groups_generated', skip):.1f} "
            f"| {run['seconds_per_step']:.2f} "
            f"| {sum(entry.get('prompt_triage/skipped', 0) for entry in history):.0f} "
            f"| {run['final_accuracy']:.3f} |"
        )
    ratio = {
        triage: statistics.fmean(
            mean_after(runs[triage, seed]["history"], "rollout/generated_tokens_per_trained_token", skip)
            for seed in args.seeds
        )
        for triage in (False, True)
    }
    accuracy = {triage: [runs[triage, seed]["final_accuracy"] for seed in args.seeds] for triage in (False, True)}
    reduction = 1 - ratio[True] / ratio[False]
    within = min(accuracy[False]) - 0.02 <= statistics.fmean(accuracy[True]) <= max(accuracy[False]) + 0.02
    print(
        f"\ngenerated tokens per trained token: {ratio[False]:.2f} without triage, {ratio[True]:.2f} with it "
        f"({100 * reduction:.0f}% fewer); final avg@4 {statistics.fmean(accuracy[False]):.3f} without, "
        f"{statistics.fmean(accuracy[True]):.3f} with ({'within' if within else 'outside'} the seeds' spread of "
        "the run without it, +-0.02)"
    )
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        figure, axis = plt.subplots(figsize=(7, 4))
        for (triage, seed), run in sorted(runs.items()):
            steps = range(1, len(run["history"]) + 1)
            accuracy_curve = [(entry["rewards/dapo_math_reward/mean"] + 1) / 2 for entry in run["history"]]
            axis.plot(
                steps,
                accuracy_curve,
                color="tab:orange" if triage else "tab:blue",
                alpha=0.6,
                label=f"triage {'on' if triage else 'off'}" if seed == args.seeds[0] else None,
            )
        axis.set_xlabel("optimizer step")
        axis.set_ylabel("accuracy of the generated responses")
        axis.set_title("Demo run, prompt triage off and on (each line a seed)")
        axis.legend()
        figure.tight_layout()
        figure.savefig(args.plot, dpi=100)
        print(f"chart: {args.plot}")


if __name__ == "__main__":
    main()
