"""Dynamic sampling end to end on prompts of known difficulty (see tests/scripts/dynamic_sampling_run.py)."""

import json
import subprocess
from collections import Counter, defaultdict

import pytest

from .helpers import REPO, SCRIPTS, python_command, run_command

pytestmark = pytest.mark.e2e
SCRIPT = str(SCRIPTS / "dynamic_sampling_run.py")
GROUP = 4


def run(out, per_device: int, steps: int, *overrides: str, processes: int = 1):
    return run_command(
        python_command(SCRIPT, str(out), str(per_device), str(steps), *overrides, num_processes=processes)
    )


def read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def trained_by_step(out, processes: int = 1) -> dict[int, list[tuple[str, float, int]]]:
    """(prompt, advantage, active tokens) of every trained row, per optimizer step, over all processes."""
    steps = defaultdict(list)
    for rank in range(processes):
        for record in read_jsonl(out / f"trained_rank{rank}.jsonl"):
            rows = zip(record["prompts"], record["advantages"], record["active_tokens"], strict=True)
            steps[record["step"]].extend(rows)
    return dict(steps)


def step_metrics(out) -> list[dict]:
    return [entry for entry in json.loads((out / "log_history.json").read_text()) if "dynamic_sampling/rounds" in entry]


def test_every_trained_group_has_spread_and_the_batch_is_exact(tmp_path):
    out = tmp_path / "run"
    run(out, 8, 3, "mixed_share=0.25", "save_strategy=steps", "save_steps=2")
    trained = trained_by_step(out)
    assert sorted(trained) == [0, 1, 2]
    for rows in trained.values():
        assert len(rows) == 8  # exactly the target: 2 groups of 4
        per_prompt = defaultdict(list)
        for prompt, advantage, _ in rows:
            per_prompt[prompt].append(advantage)
        assert all(prompt.startswith("mixed") for prompt in per_prompt)
        for advantages in per_prompt.values():
            assert len(advantages) == GROUP and min(advantages) < 0 < max(advantages)
    metrics = step_metrics(out)
    assert len(metrics) == 3
    for entry in metrics:
        assert entry["dynamic_sampling/groups_kept"] >= 2
        assert entry["dynamic_sampling/keep_rate"] == pytest.approx(
            entry["dynamic_sampling/groups_kept"] / entry["dynamic_sampling/groups_generated"]
        )
        assert entry["dynamic_sampling/filler_groups"] == 0
    assert sum(entry["dynamic_sampling/rounds"] for entry in metrics) > 3  # a 25% keep rate needs extra rounds
    # Accounting is in optimizer steps whatever the rounds: the linear LR schedule spans 3 steps, a checkpoint
    # is written at save_steps and at the end (verl #991, #2619), each with the sampling state.
    assert [entry["learning_rate"] for entry in metrics] == pytest.approx([1e-6, 2e-6 / 3, 1e-6 / 3])
    for step in (2, 3):
        assert (out / "run" / f"checkpoint-{step}" / "dapo_sampling_state.pt").exists()


def test_exhausted_rounds_raise_with_the_fix(tmp_path):
    command = python_command(
        SCRIPT,
        str(tmp_path / "run"),
        "8",
        "2",
        "mixed_share=0",
        "max_filter_gen_batches=2",
        "filter_groups_on_exhausted=error",
    )
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert "kept 0 of the 2 groups a step needs after 2 rounds" in result.stderr
    assert "raise max_filter_gen_batches" in result.stderr


def test_exhausted_rounds_fill_with_inert_groups(tmp_path):
    out = tmp_path / "run"
    run(out, 8, 2, "mixed_share=0", "max_filter_gen_batches=2")
    for rows in trained_by_step(out).values():
        assert len(rows) == 8
        assert all(advantage == 0 and tokens == 0 for _, advantage, tokens in rows)  # no loss, no denominator
    for entry in step_metrics(out):
        assert entry["dynamic_sampling/filler_groups"] == 2 and entry["dynamic_sampling/rounds"] == 2


def test_oversampling_and_carried_surplus(tmp_path):
    out = tmp_path / "run"
    run(out, 8, 3, "mixed_share=0.5", "filter_groups_oversample=3", "filter_groups_carry_surplus=true")
    metrics = step_metrics(out)
    assert metrics[0]["dynamic_sampling/groups_generated"] == 6  # 3 generation batches of 2 groups in round 1
    carried = [entry["dynamic_sampling/surplus_carried_groups"] for entry in metrics]
    carried_in = [entry["dynamic_sampling/carried_in_groups"] for entry in metrics]
    assert carried_in[1:] == carried[:-1] and carried_in[0] == 0
    assert any(carried)
    for entry in metrics:  # only this step's groups are carried: the backlog and staleness stay one step
        assert entry["dynamic_sampling/surplus_carried_groups"] <= entry["dynamic_sampling/groups_kept"]
    for rows in trained_by_step(out).values():
        assert len(rows) == 8 and all(prompt.startswith("mixed") for prompt, _, _ in rows)


def test_two_processes_with_straddling_groups_match_one_process(tmp_path):
    # 12 rows of groups of 4 over 2 processes: 6 rows each, so the second group straddles the process boundary.
    one, two = tmp_path / "one", tmp_path / "two"
    run(one, 12, 3, "mixed_share=0.3")
    run(two, 6, 3, "mixed_share=0.3", processes=2)
    trained_one, trained_two = trained_by_step(one), trained_by_step(two, processes=2)
    assert sorted(trained_one) == sorted(trained_two) == [0, 1, 2]
    for step in trained_one:
        rank_rows = [[r for r in read_jsonl(two / f"trained_rank{rank}.jsonl") if r["step"] == step] for rank in (0, 1)]
        assert sum(len(r["prompts"]) for r in rank_rows[0]) == sum(len(r["prompts"]) for r in rank_rows[1]) == 6
        assert Counter(p for p, _, _ in trained_one[step]) == Counter(p for p, _, _ in trained_two[step])
    metrics_one, metrics_two = step_metrics(one), step_metrics(two)
    for a, b in zip(metrics_one, metrics_two, strict=True):
        assert a["dynamic_sampling/rounds"] == b["dynamic_sampling/rounds"]
        assert a["dynamic_sampling/groups_kept"] == b["dynamic_sampling/groups_kept"]


def prompts_seen(out) -> list[tuple[int, tuple[str, ...]]]:
    return [(r["step"], tuple(r["prompts"])) for r in read_jsonl(out / "prompts_seen_rank0.jsonl")]


def test_kill_and_resume_sees_the_same_prompts(tmp_path):
    common = (
        "mixed_share=0.3",
        "filter_groups_carry_surplus=true",
        "filter_groups_oversample=2",
        "save_strategy=steps",
        "save_steps=2",
    )
    full, crashed = tmp_path / "full", tmp_path / "crashed"
    run(full, 8, 4, *common)
    result = subprocess.run(
        python_command(SCRIPT, str(crashed), "8", "4", *common, "crash_after_save=2"),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 3, result.stderr[-2000:]
    checkpoint = crashed / "run" / "checkpoint-2"
    assert (checkpoint / "dapo_sampling_state.pt").exists()
    run(crashed, 8, 4, *common, f"resume={checkpoint}")
    seen_full = [entry for entry in prompts_seen(full) if entry[0] >= 2]
    seen_resumed = [entry for entry in prompts_seen(crashed) if entry[0] >= 2]
    assert seen_resumed and seen_resumed == seen_full
    trained_full, trained_resumed = trained_by_step(full), trained_by_step(crashed)
    for step in (2, 3):
        assert Counter(p for p, _, _ in trained_full[step]) == Counter(p for p, _, _ in trained_resumed[step])
