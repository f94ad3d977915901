"""The end-of-run report of `train_dapo.py`: the metrics table printed after training and the --plot charts.

Kept out of `cli.py` so the entry point stays about parsing and wiring; matplotlib loads only when charts are written.
"""

from __future__ import annotations

import itertools
import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger("dapo_trl")

# Metrics printed in the end-of-run summary, in this order, when they were logged: the leading ones, then every
# reward function's mean (rewards/<name>/mean), then the rest.
LEADING_SUMMARY_METRICS = ("loss", "reward", "reward_std")
SUMMARY_METRICS = (
    "overlong/penalized_frac",
    "completions/mean_length",
    "completions/clipped_ratio",
    "frac_reward_zero_std",
    "dynamic_sampling/rounds",
    "dynamic_sampling/groups_generated",
    "dynamic_sampling/groups_kept",
    "dynamic_sampling/keep_rate",
    "dynamic_sampling/filler_groups",
    "clip_ratio/low_mean",
    "clip_ratio/high_mean",
    "entropy",
)


def summary_columns(steps: list[dict[str, Any]], max_columns: int = 8) -> list[tuple[str, list[dict[str, Any]]]]:
    """One column per logged step, or, for longer runs, `max_columns` consecutive windows (shown as their mean)."""
    if len(steps) <= max_columns:
        return [(f"step {entry.get('step', '?')}", [entry]) for entry in steps]
    bounds = [round(i * len(steps) / max_columns) for i in range(max_columns + 1)]
    windows = [steps[start:end] for start, end in itertools.pairwise(bounds)]
    return [(f"{window[0].get('step', '?')}-{window[-1].get('step', '?')}", window) for window in windows]


def print_summary(log_history: list[dict[str, Any]]) -> None:
    """Print the DAPO metrics of every logged step (or of 8 windows of steps, averaged) as a small table."""
    steps = [entry for entry in log_history if "loss" in entry or "reward" in entry]
    if not steps:
        return
    reward_means = sorted(
        {key for entry in steps for key in entry if key.startswith("rewards/") and key.endswith("/mean")}
    )
    ordered = (*LEADING_SUMMARY_METRICS, *reward_means, *SUMMARY_METRICS)
    names = [name for name in ordered if any(name in entry for entry in steps)]
    columns = summary_columns(steps)
    averaged = any(len(window) > 1 for _, window in columns)
    print("\nDAPO metrics per logged step" + (" (mean over each window of steps)" if averaged else ""))
    print(f"{'metric':<34}" + "".join(f"{title:>12}" for title, _ in columns))
    for name in names:
        cells = ""
        for _, window in columns:
            values = [entry[name] for entry in window if isinstance(entry.get(name), int | float)]
            cells += f"{sum(values) / len(values):>12.4f}" if values else f"{'-':>12}"
        print(f"{name:<34}{cells}")


def write_charts(output_dir: str, log_history: list[dict[str, Any]]) -> None:
    """--plot: the finished run's charts in OUTPUT_DIR/plots; a failure only warns (the model is already saved)."""
    try:
        from ..plot import plot_run

        charts = plot_run(output_dir, log_history=log_history)
    except Exception as error:  # charts are a convenience: never fail a finished run over them
        logger.warning("could not write the charts: %s: %s", type(error).__name__, error)
        return
    if charts:
        print(f"charts: {Path(output_dir) / 'plots'}")
    else:
        logger.warning("no charts: none of the charted metrics was logged")
