"""`python -m dapo_trl.plot` and `train_dapo.py --plot`: the charted series are read back and compared with the logs."""

import json
import logging
import math
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from dapo_trl.plot import NoLogsError, plot_run, read_run, series_from_log_history

from .helpers import REPO, offline_environment, run_command

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

# Three logged training steps and one validation, as the trainer's log_history holds them.
TRAIN_KEYS = {
    "loss": [0.5, 0.4, 0.3],
    "grad_norm": [1.0, 0.9, 0.8],
    "learning_rate": [1e-6, 1e-6, 1e-6],
    "reward": [-0.5, 0.0, 0.25],
    "reward_std": [0.8, 0.7, 0.6],
    "rewards/dapo_math_reward/mean": [-0.4, 0.1, 0.3],
    "rewards/overlong_penalty/mean": [-0.2, -0.1, -0.05],
    "completions/mean_length": [40.0, 44.5, 50.0],
    "completions/max_length": [64.0, 64.0, 60.0],
    "completions/clipped_ratio": [0.25, 0.125, 0.0],
    "dynamic_sampling/keep_rate": [0.5, 0.75, 1.0],
    "dynamic_sampling/rounds": [2.0, 1.0, 1.0],
    "dynamic_sampling/filler_groups": [0.0, 1.0, 0.0],
    "entropy": [2.5, 2.4, 2.3],
    "clip_ratio/low_mean": [0.01, 0.02, 0.0],
    "clip_ratio/high_mean": [0.0, 0.03, 0.04],
    "clip_ratio/region_mean": [0.01, 0.05, 0.04],
}
EVAL = {"eval_aime/avg@4": 0.25, "eval_aime/pass@1": 0.25, "eval_aime/pass@4": 0.5, "eval_aime/num_prompts": 30.0}
STEPS = [1, 2, 3]

EXPECTED_PANELS = {
    "reward": {"reward", "rewards/dapo_math_reward/mean", "rewards/overlong_penalty/mean"},
    "response_length": {"completions/mean_length", "completions/max_length", "completions/clipped_ratio"},
    "dynamic_sampling": {"dynamic_sampling/keep_rate", "dynamic_sampling/rounds", "dynamic_sampling/filler_groups"},
    "entropy_and_clipping": {"entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"},
    "validation": {"eval_aime/avg@4", "eval_aime/pass@1", "eval_aime/pass@4"},
    "optimization": {"loss", "grad_norm", "learning_rate"},
}


def log_history() -> list[dict]:
    history = []
    for i, step in enumerate(STEPS):
        history.append({"epoch": step / 10, "step": step, **{key: values[i] for key, values in TRAIN_KEYS.items()}})
        if step == 2:
            history.append({"epoch": 0.2, "step": 2, **EVAL})
    history[0]["entropy"] = float("nan")  # not drawable: left out
    history.append({"step": 3, "train_runtime": 12.0, "train_loss": 0.4, "total_flos": 0.0})
    return history


def expected_points(name: str) -> list[list[float]]:
    """The (step, value) pairs the history holds for `name`, NaN left out."""
    return [[entry["step"], entry[name]] for entry in log_history() if name in entry and math.isfinite(entry[name])]


def check_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, path
    assert len(data) > 5000, f"{path} is only {len(data)} bytes"
    width, height = struct.unpack(">II", data[16:24])  # the IHDR chunk
    assert width >= 400 and height >= 200


def read_series_file(plots: Path) -> dict:
    return json.loads((plots / "series.json").read_text())


def check_plotted(plots: Path, charts: dict, expected_panels: dict[str, set[str]]) -> dict:
    record = read_series_file(plots)
    assert set(charts) == set(expected_panels) == set(record["panels"])
    for panel, names in expected_panels.items():
        assert charts[panel] == plots / f"{panel}.png"
        check_png(charts[panel])
        assert set(record["panels"][panel]["series"]) == names, panel
    assert sorted(p.name for p in plots.glob("*.png")) == sorted(f"{panel}.png" for panel in expected_panels)
    return record


def write_state(path: Path, history: list[dict], global_step: int) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / "trainer_state.json").write_text(json.dumps({"global_step": global_step, "log_history": history}))


# ------------------------------------------------------------------------------------------------ trainer_state
def test_trainer_state_series_are_plotted_exactly(tmp_path):
    # checkpoint-10 is the newest (numerically, not by name); checkpoint-2 holds other numbers that must not be used
    write_state(tmp_path / "checkpoint-10", log_history(), 3)
    write_state(tmp_path / "checkpoint-2", [{"step": 1, "reward": 99.0}], 2)
    charts = plot_run(tmp_path)
    record = check_plotted(tmp_path / "plots", charts, EXPECTED_PANELS)
    assert "checkpoint-10" in record["source"]
    for panel, names in EXPECTED_PANELS.items():
        for name in names:
            assert record["panels"][panel]["series"][name] == expected_points(name), name
    assert "tools" not in charts  # no tools/* series: skipped, no empty PNG
    assert "eval_aime/num_prompts" not in record["panels"]["validation"]["series"]
    series = read_run(tmp_path)
    assert series["dynamic_sampling/keep_rate"] == [(1, 0.5), (2, 0.75), (3, 1.0)]
    assert series["entropy"] == [(2, 2.4), (3, 2.3)]
    assert series["train_runtime"] == [(3, 12.0)]


def test_run_dir_state_wins_when_it_reached_later(tmp_path):
    write_state(tmp_path / "checkpoint-1", [{"step": 1, "reward": 1.0}], 1)
    write_state(tmp_path, [{"step": 1, "reward": 2.0}, {"step": 2, "reward": 3.0}], 2)
    assert read_run(tmp_path) == {"reward": [(1, 2.0), (2, 3.0)]}


def test_missing_series_skip_their_panels_and_stale_pngs_go(tmp_path):
    write_state(tmp_path, log_history(), 3)
    plot_run(tmp_path)
    assert (tmp_path / "plots" / "validation.png").exists()
    write_state(tmp_path, [{"step": 1, "reward": 0.5, "tools/rounds_per_response": 1.5, "tools/success_rate": 0.8}], 1)
    charts = plot_run(tmp_path)
    expected = {"reward": {"reward"}, "tools": {"tools/rounds_per_response", "tools/success_rate"}}
    check_plotted(tmp_path / "plots", charts, expected)


# ------------------------------------------------------------------------------------------------ TensorBoard
def write_events(run_dir: Path, stamp: int, scalars: dict[str, list[tuple[int, float]]]) -> None:
    """Events as transformers' TensorBoardCallback writes them, in a file named as written at `stamp`."""
    from torch.utils.tensorboard import SummaryWriter

    log_dir = run_dir / "runs" / f"run{stamp}"
    writer = SummaryWriter(log_dir=str(log_dir))
    writer.add_text("args", "{}")
    for tag, points in scalars.items():
        for step, value in points:
            writer.add_scalar(tag, value, step)
    writer.close()
    (written,) = log_dir.glob("events.out.tfevents.*")
    written.rename(log_dir / f"events.out.tfevents.{stamp}.host.1.0")


def tensorboard_tag(name: str) -> str:
    return "eval/" + name[len("eval_") :] if name.startswith("eval_") else "train/" + name


def test_tensorboard_series_are_plotted_exactly(tmp_path):
    scalars = {}
    for entry in log_history():
        for name, value in entry.items():
            if name != "step" and not (isinstance(value, float) and math.isnan(value)):
                scalars.setdefault(tensorboard_tag(name), []).append((entry["step"], value))
    write_events(tmp_path, 1000, scalars)
    write_state(tmp_path, [{"step": 1, "reward": 99.0}], 1)  # the events win over trainer_state.json
    charts = plot_run(tmp_path, output_dir=tmp_path / "charts")
    record = check_plotted(tmp_path / "charts", charts, EXPECTED_PANELS)
    assert record["source"].startswith("TensorBoard events")
    for panel, names in EXPECTED_PANELS.items():
        for name in names:
            got = record["panels"][panel]["series"][name]
            assert [step for step, _ in got] == [step for step, _ in expected_points(name)], name
            assert [value for _, value in got] == pytest.approx([v for _, v in expected_points(name)], rel=1e-6)
    assert read_run(tmp_path, source="trainer_state") == {"reward": [(1, 99.0)]}


def test_resumed_run_replaces_the_orphaned_tail(tmp_path):
    # first run logged steps 1-3; resumed from checkpoint-2, the second run logs 3-4: step 3 comes from the second,
    # and a series only the first logged at step 3 loses that point
    write_events(
        tmp_path, 1000, {"train/reward": [(1, 0.1), (2, 0.2), (3, 0.3)], "train/entropy": [(2, 2.0), (3, 3.0)]}
    )
    write_events(tmp_path, 2000, {"train/reward": [(3, -0.3), (4, -0.4)], "train/tools/executions": [(4, 7.0)]})
    series = read_run(tmp_path)
    assert [step for step, _ in series["reward"]] == [1, 2, 3, 4]
    assert [value for _, value in series["reward"]] == pytest.approx([0.1, 0.2, -0.3, -0.4])
    assert series["entropy"] == [(2, 2.0)]
    assert series["tools/executions"] == [(4, 7.0)]


# ------------------------------------------------------------------------------------------------ sources, command
def test_no_logs_names_what_it_looked_for(tmp_path):
    with pytest.raises(NoLogsError, match="events.out.tfevents"):
        plot_run(tmp_path)
    result = subprocess.run(
        [sys.executable, "-m", "dapo_trl.plot", str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"error: no training logs in {tmp_path}: looked for TensorBoard event files (RUN_DIR/**/events.out.tfevents.*)"
        " and trainer_state.json (RUN_DIR/trainer_state.json, RUN_DIR/checkpoint-*/trainer_state.json)"
    ]
    assert not (tmp_path / "plots").exists()


def test_in_memory_history_is_the_last_resort(tmp_path):
    charts = plot_run(tmp_path, log_history=log_history())
    record = check_plotted(tmp_path / "plots", charts, EXPECTED_PANELS)
    assert record["source"] == "the trainer's in-memory log history"
    assert series_from_log_history(log_history())["reward"] == [(1, -0.5), (2, 0.0), (3, 0.25)]


def test_command_help_and_run(tmp_path):
    env = offline_environment()
    help_result = subprocess.run(
        [sys.executable, "-m", "dapo_trl.plot", "--help"], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert help_result.returncode == 0 and "RUN_DIR" in help_result.stdout and "--output" in help_result.stdout
    write_state(tmp_path, log_history(), 3)
    result = run_command([sys.executable, "-m", "dapo_trl.plot", str(tmp_path), "--output", str(tmp_path / "out")])
    assert result.stdout.strip().splitlines()[-1] == f"charts: {tmp_path / 'out'}"
    assert set(read_series_file(tmp_path / "out")["panels"]) == set(EXPECTED_PANELS)


def test_importing_the_package_does_not_import_matplotlib(tmp_path):
    """In a fresh interpreter (the warm launcher's: torch, TRL and the trainer imported, matplotlib not)."""
    script = tmp_path / "imports.py"
    script.write_text("import sys, dapo_trl, dapo_trl.cli, dapo_trl.plot\nprint('matplotlib' in sys.modules)\n")
    result = run_command([sys.executable, str(script)])
    assert result.stdout.strip() == "False"


def test_plot_flag_parses():
    from dapo_trl.cli import DAPOParser

    assert DAPOParser().parse_args_and_config(args=["--output_dir", "x"])[0].plot is True
    assert DAPOParser().parse_args_and_config(args=["--output_dir", "x", "--plot", "false"])[0].plot is False


def test_a_plotting_failure_only_warns(tmp_path, monkeypatch, caplog, capsys):
    import dapo_trl.plot
    from dapo_trl.cli import write_charts

    def broken(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(dapo_trl.plot, "plot_run", broken)
    with caplog.at_level(logging.WARNING, logger="dapo_trl"):
        write_charts(str(tmp_path), log_history())
    assert "could not write the charts: RuntimeError: disk full" in caplog.text
    assert "charts:" not in capsys.readouterr().out


# ------------------------------------------------------------------------------------------------ end to end
