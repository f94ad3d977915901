"""The embedded default learns where a person can see it: `DEMO=1 ./test_dapo.sh` on the warm-started built-in model.

Judged like the learning test, on the run's own plotted series (end clearly above the start), never on time. That
the 2-step smoke run trains on kept groups is checked with its charts in test_plot.py.
"""

import json
import statistics

import pytest

from .helpers import run_command

pytestmark = pytest.mark.e2e


def plotted(run_dir, panel: str, series: str) -> list[float]:
    panels = json.loads((run_dir / "plots" / "series.json").read_text())["panels"]
    return [value for _, value in panels[panel]["series"][series]]


def test_demo_accuracy_rises(tmp_path):
    """A shortened demo (its settings, 40 of its 150 steps): DAPO's +1/-1 reward, so mean = 2 x accuracy - 1. On a
    2-core machine: first 10 steps 0.22, steps 31-40 0.41, steps 41-50 0.38."""
    run_command(["./test_dapo.sh", "--max_steps", "40"], env={"OUTPUT_DIR": str(tmp_path), "DEMO": "1"})
    accuracy = [(reward + 1) / 2 for reward in plotted(tmp_path, "reward", "rewards/dapo_math_reward/mean")]
    print("accuracy per step:", [round(value, 2) for value in accuracy])
    assert len(accuracy) == 40
    start, end = statistics.mean(accuracy[:10]), statistics.mean(accuracy[-10:])
    assert end > start + 0.1, f"accuracy did not rise: first steps {accuracy[:10]}, last steps {accuracy[-10:]}"
