"""`python -m dapo_trl.plot RUN_DIR`: PNG charts of a run's DAPO metrics, drawn from the run's own logs.

Where the numbers come from (`--source auto`, the default):

1. TensorBoard event files anywhere under RUN_DIR (transformers writes `RUN_DIR/runs/<stamp>/events.out.tfevents.*`)
   when they hold any scalar: they are written at every log, so they cover runs without checkpoints and runs that
   stopped early. Several files (a resumed or repeated run) are read oldest first, and like TensorBoard's own
   orphaned-data purge, a file that starts at step s drops the older files' points at steps >= s.
   Tags are named back as in the trainer's log: `train/<name>` -> `<name>`, `eval/<name>` -> `eval_<name>`.
   (TensorBoard keeps values as float32.)
2. Otherwise `trainer_state.json` (its `log_history`): RUN_DIR's own or the newest `checkpoint-*/`'s, whichever
   reached the later global step.
3. Otherwise, when the caller passes it (`train_dapo.py --plot` does), the finished run's in-memory log history.

Non-finite values (NaN, inf) are left out: they cannot be drawn. The x axis is the global step. One PNG per panel
goes to RUN_DIR/plots (or --output); a panel none of whose series was logged is skipped, and `series.json` beside
the PNGs holds exactly the (step, value) pairs drawn, per panel and series.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

Series = dict[str, list[tuple[int, float]]]

SERIES_FILE = "series.json"
SOURCES = ("auto", "tensorboard", "trainer_state")
EVENT_FILE_PATTERN = "events.out.tfevents.*"
TRAINER_STATE = "trainer_state.json"
LOOKED_FOR = (
    f"TensorBoard event files (RUN_DIR/**/{EVENT_FILE_PATTERN}) and {TRAINER_STATE} "
    f"(RUN_DIR/{TRAINER_STATE}, RUN_DIR/checkpoint-*/{TRAINER_STATE})"
)
NUMBER = r"-?\d[\d.eE+-]*"
VALIDATION_METRIC = re.compile(r"^eval_.+/(avg|pass)@\d+$")


class NoLogsError(FileNotFoundError):
    """RUN_DIR holds none of the logs the charts are drawn from."""


class RunLogs(NamedTuple):
    series: Series
    source: str  # where they were read, in words


# ------------------------------------------------------------------------------------------------- panels
@dataclass(frozen=True)
class AxesSpec:
    """One subplot: the series `matches` accepts (and no earlier subplot of the panel took), sharing one y unit."""

    ylabel: str
    matches: Callable[[str], bool]
    split_by: Callable[[str], str] | None = None  # one subplot per key (e.g. per data source), labelled with it


@dataclass(frozen=True)
class PanelSpec:
    name: str  # also the PNG's file name
    title: str
    axes: tuple[AxesSpec, ...]


def _named(*names: str) -> Callable[[str], bool]:
    return lambda name: name in names


def _reward_mean(name: str) -> bool:
    return name == "reward" or (name.startswith("rewards/") and name.endswith("/mean"))


def _tool_metric(*fragments: str) -> Callable[[str], bool]:
    return lambda name: name.startswith("tools/") and any(fragment in name for fragment in fragments)


PANELS: tuple[PanelSpec, ...] = (
    PanelSpec(
        "reward",
        "Accuracy and shaped reward",
        (AxesSpec("reward (mean)", _reward_mean),),
    ),
    PanelSpec(
        "response_length",
        "Response length and clipped ratio",
        (
            AxesSpec("tokens", _named("completions/mean_length", "completions/max_length")),
            AxesSpec("share truncated", _named("completions/clipped_ratio")),
        ),
    ),
    PanelSpec(
        "dynamic_sampling",
        "Dynamic sampling: keep rate and rounds per step",
        (
            AxesSpec("keep rate", _named("dynamic_sampling/keep_rate")),
            AxesSpec("rounds / groups", _named("dynamic_sampling/rounds", "dynamic_sampling/filler_groups")),
        ),
    ),
    PanelSpec(
        "entropy_and_clipping",
        "Entropy and clip fractions",
        (
            AxesSpec("entropy", _named("entropy")),
            AxesSpec(
                "share of tokens clipped",
                _named("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"),
            ),
        ),
    ),
    PanelSpec(
        "validation",
        "Validation",
        (
            AxesSpec("avg@n", lambda name: bool(VALIDATION_METRIC.match(name)) and "/avg@" in name),
            AxesSpec(
                "pass@k",
                lambda name: bool(VALIDATION_METRIC.match(name)) and "/pass@" in name,
                split_by=lambda name: name[len("eval_") : name.rindex("/")],
            ),
        ),
    ),
    PanelSpec(
        "tools",
        "Tool use",
        (
            AxesSpec("tool rounds per response", _tool_metric("rounds")),
            AxesSpec("share", lambda name: name.startswith("tools/") and name.endswith(("_rate", "_with_tool_use"))),
            AxesSpec("executions", _named("tools/executions")),
            AxesSpec("seconds", _tool_metric("seconds")),
            AxesSpec("other", lambda name: name.startswith("tools/")),
        ),
    ),
    PanelSpec(
        "optimization",
        "Optimization",
        (
            AxesSpec("loss", _named("loss")),
            AxesSpec("grad norm", _named("grad_norm")),
            AxesSpec("learning rate", _named("learning_rate")),
        ),
    ),
)


def _natural_key(name: str) -> list[str | int]:
    """pass@2 before pass@10."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def select_panels(series: Series) -> dict[str, list[tuple[str, Series]]]:
    """The panels that have data: panel name -> its non-empty subplots as (y label, series in name order)."""
    selected: dict[str, list[tuple[str, Series]]] = {}
    for panel in PANELS:
        taken: set[str] = set()
        subplots = []
        for spec in panel.axes:
            names = [name for name in series if series[name] and name not in taken and spec.matches(name)]
            taken.update(names)
            groups: dict[str, list[str]] = {}
            for name in names:
                groups.setdefault(spec.split_by(name) if spec.split_by else "", []).append(name)
            for key in sorted(groups, key=_natural_key):
                label = f"{spec.ylabel} ({key})" if key else spec.ylabel
                subplots.append((label, {name: series[name] for name in sorted(groups[key], key=_natural_key)}))
        if subplots:
            selected[panel.name] = subplots
    return selected


# ------------------------------------------------------------------------------------------------- reading
def _add_point(points: dict[str, dict[int, float]], name: str, step: Any, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return
    if isinstance(step, bool) or not isinstance(step, int | float):
        return
    points.setdefault(name, {})[int(step)] = float(value)


def _as_series(points: dict[str, dict[int, float]]) -> Series:
    return {name: sorted(by_step.items()) for name, by_step in sorted(points.items()) if by_step}


def series_from_log_history(log_history: Iterable[dict[str, Any]]) -> Series:
    """Trainer `log_history` entries -> name -> [(step, value)] sorted by step (the last value of a step wins)."""
    points: dict[str, dict[int, float]] = {}
    for entry in log_history:
        for name, value in entry.items():
            if name != "step":
                _add_point(points, name, entry.get("step"), value)
    return _as_series(points)


def _tag_to_name(tag: str) -> str:
    """transformers' TensorBoard tags back to the trainer's log names (the inverse of its `rewrite_logs`)."""
    for prefix, replacement in (("train/", ""), ("eval/", "eval_"), ("test/", "test_")):
        if tag.startswith(prefix):
            return replacement + tag[len(prefix) :]
    return tag


def _event_file_order(path: Path) -> tuple[float, float, str]:
    parts = path.name.split(".")  # events.out.tfevents.<unix time>.<host>...
    try:
        stamp = float(parts[3])
    except (IndexError, ValueError):
        stamp = path.stat().st_mtime
    return stamp, path.stat().st_mtime, str(path)


def _read_event_file(path: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    accumulator = EventAccumulator(str(path), size_guidance={"scalars": 0, "tensors": 0})
    accumulator.Reload()
    tags = accumulator.Tags()
    points: dict[str, dict[int, float]] = {}
    for tag in tags.get("scalars", []):
        for event in accumulator.Scalars(tag):
            _add_point(points, _tag_to_name(tag), event.step, event.value)
    for tag in tags.get("tensors", []):  # scalars written as tensors (tf.summary v2, `new_style` writers)
        if accumulator.SummaryMetadata(tag).plugin_data.plugin_name != "scalars":
            continue
        for event in accumulator.Tensors(tag):
            value = tensor_util.make_ndarray(event.tensor_proto)
            if value.size == 1:
                _add_point(points, _tag_to_name(tag), event.step, value.item())
    return points


def read_tensorboard(run_dir: str | Path) -> RunLogs | None:
    """Scalars of every event file under `run_dir`, oldest file first; None when there are none."""
    files = sorted((p for p in Path(run_dir).rglob(EVENT_FILE_PATTERN) if p.is_file()), key=_event_file_order)
    merged: dict[str, dict[int, float]] = {}
    read = []
    for path in files:
        points = _read_event_file(path)
        if not points:
            continue
        start = min(step for by_step in points.values() for step in by_step)
        for by_step in merged.values():  # a restart from `start`: what older files logged from there is orphaned
            for step in [step for step in by_step if step >= start]:
                del by_step[step]
        for name, by_step in points.items():
            merged.setdefault(name, {}).update(by_step)
        read.append(path)
    series = _as_series(merged)
    if not series:
        return None
    where = ", ".join(str(path) for path in read)
    return RunLogs(series, f"TensorBoard events: {where}")


def _checkpoint_number(path: Path) -> int:
    suffix = path.name.rpartition("-")[2]
    return int(suffix) if suffix.isdigit() else -1


def read_trainer_state(run_dir: str | Path) -> RunLogs | None:
    """`log_history` of RUN_DIR's trainer_state.json or the newest checkpoint's, whichever reached the later step."""
    run_dir = Path(run_dir)
    candidates = [run_dir / TRAINER_STATE]
    checkpoints = sorted(run_dir.glob("checkpoint-*"), key=_checkpoint_number)
    if checkpoints:
        candidates.append(checkpoints[-1] / TRAINER_STATE)
    best: tuple[int, Path, list[dict[str, Any]]] | None = None
    for path in candidates:
        if not path.is_file():
            continue
        state = json.loads(path.read_text(encoding="utf-8"))
        history = state.get("log_history") or []
        reached = int(state.get("global_step") or max((entry.get("step", 0) for entry in history), default=0))
        if history and (best is None or reached > best[0]):
            best = (reached, path, history)
    if best is None:
        return None
    series = series_from_log_history(best[2])
    return RunLogs(series, f"{TRAINER_STATE}: {best[1]}") if series else None


def load_run_logs(
    run_dir: str | Path, source: str = "auto", log_history: Sequence[dict[str, Any]] | None = None
) -> RunLogs:
    """The run's series and where they were read (module docstring: the rule); NoLogsError when there are none."""
    if source not in SOURCES:
        raise ValueError(f"source must be one of {SOURCES}, not {source!r}")
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise NoLogsError(f"{run_dir} is not a directory")
    found = None
    if source in ("auto", "tensorboard"):
        found = read_tensorboard(run_dir)
    if found is None and source in ("auto", "trainer_state"):
        found = read_trainer_state(run_dir)
    if found is None and log_history is not None:
        series = series_from_log_history(log_history)
        found = RunLogs(series, "the trainer's in-memory log history") if series else None
    if found is None:
        looked_for = {
            "auto": LOOKED_FOR,
            "tensorboard": f"TensorBoard event files (RUN_DIR/**/{EVENT_FILE_PATTERN})",
            "trainer_state": f"{TRAINER_STATE} (RUN_DIR/{TRAINER_STATE}, RUN_DIR/checkpoint-*/{TRAINER_STATE})",
        }[source]
        raise NoLogsError(f"no training logs in {run_dir}: looked for {looked_for}")
    return found


def read_run(run_dir: str | Path, source: str = "auto") -> Series:
    """Every numeric series the run logged: name (as in the trainer's log) -> [(global step, value)] by step."""
    return load_run_logs(run_dir, source).series


# ------------------------------------------------------------------------------------------------- drawing
def _draw_panel(panel: PanelSpec, subplots: list[tuple[str, Series]], path: Path) -> None:
    from matplotlib.figure import Figure  # no pyplot: no display, no global backend switch
    from matplotlib.ticker import MaxNLocator

    figure = Figure(figsize=(11, 1.2 + 2.4 * len(subplots)), layout="constrained")
    axes_list = figure.subplots(len(subplots), 1, sharex=True, squeeze=False)[:, 0]
    for axes, (ylabel, series) in zip(axes_list, subplots, strict=True):
        for name, points in series.items():
            steps = [step for step, _ in points]
            values = [value for _, value in points]
            axes.plot(steps, values, label=name, marker="o" if len(points) <= 50 else None, markersize=3)
        axes.set_ylabel(ylabel)
        axes.grid(True, alpha=0.3)
        # beside the plot, never over the lines; two columns keep pass@1..32 within the subplot's height
        axes.legend(fontsize="small", ncols=2 if len(series) > 8 else 1, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    axes_list[-1].set_xlabel("global step")
    axes_list[-1].xaxis.set_major_locator(MaxNLocator(integer=True))
    figure.suptitle(panel.title)
    figure.savefig(path, format="png", dpi=100)


def plot_series(series: Series, output_dir: str | Path, source: str = "") -> dict[str, Path]:
    """Draw the panels that have data into `output_dir` (one PNG each) and write series.json; panel -> PNG path.

    PNGs of panels left out this time are removed, so the folder matches series.json.
    """
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    selected = select_panels(series)
    charts: dict[str, Path] = {}
    record: dict[str, Any] = {"source": source, "panels": {}}
    for panel in PANELS:
        path = output_dir / f"{panel.name}.png"
        if panel.name not in selected:
            path.unlink(missing_ok=True)
            continue
        subplots = selected[panel.name]
        _draw_panel(panel, subplots, path)
        charts[panel.name] = path
        drawn = {
            name: [[step, value] for step, value in points] for _, group in subplots for name, points in group.items()
        }
        record["panels"][panel.name] = {"title": panel.title, "file": path.name, "series": drawn}
    text = re.sub(
        rf"\[\s+({NUMBER}),\s+({NUMBER})\s+\]", r"[\1, \2]", json.dumps(record, indent=1)
    )  # one [step, value] a line
    (output_dir / SERIES_FILE).write_text(text + "\n", encoding="utf-8")
    return charts


def plot_run(
    run_dir: str | Path,
    output_dir: str | Path | None = None,
    source: str = "auto",
    log_history: Sequence[dict[str, Any]] | None = None,
) -> dict[str, Path]:
    """Chart a run: read its logs (module docstring: the rule) and draw them into `output_dir` (RUN_DIR/plots).

    Returns panel name -> PNG path (empty when no charted metric was logged); the drawn points are in
    `<output_dir>/series.json`. `log_history` (the finished run's, from the trainer) is used only when RUN_DIR
    holds no logs. Raises NoLogsError when there is nothing to read.
    """
    logs = load_run_logs(run_dir, source, log_history)
    return plot_series(logs.series, Path(output_dir) if output_dir else Path(run_dir) / "plots", logs.source)


# ------------------------------------------------------------------------------------------------- command
def build_parser() -> argparse.ArgumentParser:
    panels = ", ".join(panel.name for panel in PANELS)
    parser = argparse.ArgumentParser(
        prog="python -m dapo_trl.plot",
        description=f"PNG charts of a DAPO run's metrics, one per panel ({panels}); panels with no logged series "
        f"are skipped. Reads TensorBoard events under RUN_DIR, else {TRAINER_STATE} (RUN_DIR's or the newest "
        f"checkpoint's). The points drawn are written to {SERIES_FILE} beside the PNGs.",
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the run's output_dir")
    parser.add_argument("--output", metavar="DIR", default=None, help="where the PNGs go (default: RUN_DIR/plots)")
    parser.add_argument(
        "--source",
        choices=SOURCES,
        default="auto",
        help="which logs to read: TensorBoard events, trainer_state.json, or auto (events if any, else the state)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        logs = load_run_logs(args.run_dir, args.source)
    except (NoLogsError, json.JSONDecodeError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    output_dir = Path(args.output) if args.output else Path(args.run_dir) / "plots"
    charts = plot_series(logs.series, output_dir, logs.source)
    if not charts:
        print(f"error: {logs.source} holds none of the charted metrics (rewards, lengths, ...)", file=sys.stderr)
        return 2
    print(f"read {logs.source}")
    for name, path in charts.items():
        print(f"{name:<22}{path}")
    print(f"charts: {output_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
