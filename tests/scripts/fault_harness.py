"""Faults of the fast path against a real vLLM server: each injected at a chosen point by a hook, then the run
requeued as a scheduler would, and what survived checked.

Usage: python fault_harness.py OUT MODEL_DIR BASE_URL
The server runs MODEL_DIR in float32 and dev mode (as tests/test_vllm.py starts it). Every run is tests/scripts/
vllm_run.py's streaming trainer: k = 1 with in-flight weight updates over shared storage, 4 optimizer updates per
rollout, 12 steps, a checkpoint every 4, dynamic sampling off (so every step trains its stream's prompts, whatever
the timing: what "no group lost or trained twice" can be checked against). First an uninterrupted run; then, per
fault, a run with the fault injected from step 5 (the first of generation batch 1: version 1 loads in flight under
batch 2's groups, checkpoint-4 written just before), and the same command resumed with `latest`. Checked after each:
whether the server was left paused (`GET /is_paused`) after the faulty run and after the resumed one, the faulty
run's exit and the error it names, the groups the resumed run restored from the checkpoint
(`rollout/groups_restored`), and whether every step trained the uninterrupted run's prompts exactly once across the
two runs. OUT/faults.json gets the outcomes; the table is printed in markdown (docs/reliability.md shows it).
"""

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent / "vllm_run.py"
COMMON = (
    "check_syncs=false",
    "rollout_streaming=true",
    "rollout_max_staleness=1",
    "rollout_in_flight_weight_updates=true",
    "vllm_importance_sampling_mode=token_truncate",
    "filter_groups_enable=false",
    "steps_per_generation=4",
    "gradient_accumulation_steps=1",
    "per_device_train_batch_size=2",
    "max_steps=12",
    "save_strategy=steps",
    "save_steps=4",
    "preemption_grace_seconds=30",
)
FAULTS = {
    "kill_in_reload": "kill -9 of the training process between /pause and /resume (inside an in-flight reload)",
    "fail_fence": "the fence marking the switch in the running answers fails (after the reload, before /resume)",
    "sigterm_in_reward": "SIGTERM while a reward scores, the reward then taking 120 s (grace 30 s)",
    "sigterm_in_generation": "SIGTERM as the engine starts a group (generating ahead, versions loading in flight)",
    "sigterm_in_training": "SIGTERM as a micro-batch's loss begins",
}
STEPS = 12  # 3 generation batches: batch 2 is waited for, so a failure of the engine's while it runs surfaces
FAULT_STEP = 4  # from the first step of generation batch 1: the load of version 1 is in flight


def run(out: Path, model_dir: str, url: str, *overrides: str) -> tuple[int, str, float]:
    command = [sys.executable, str(SCRIPT), "server", str(out), model_dir, url, *COMMON, *overrides]
    started = time.monotonic()
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    return result.returncode, result.stdout + result.stderr, time.monotonic() - started


def server_paused(url: str) -> bool:
    with urllib.request.urlopen(f"{url}/is_paused", timeout=10) as answer:
        return json.loads(answer.read())["is_paused"]


def prompts_by_step(records: list[dict]) -> dict[int, list]:
    steps: dict[int, list] = {}
    for record in records:
        steps.setdefault(record["step"], []).extend(map(tuple, record["prompt_ids"]))
    return {step: sorted(rows) for step, rows in steps.items()}


def trained_records(out: Path) -> list[dict]:
    path = out / "trained.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def error_line(output: str) -> str:
    lines = [line for line in output.splitlines() if "Error" in line or "error:" in line or "preempted:" in line]
    return lines[-1][-300:] if lines else ""


def fault_case(name: str, root: Path, model_dir: str, url: str, reference: dict[int, list]) -> dict:
    out = root / name
    code, output, seconds = run(out, model_dir, url, f"fault={name}", f"fault_step={FAULT_STEP}")
    was_injected = (out / "fault_injected").exists()
    paused_after_fault = server_paused(url)
    first_leg = trained_records(out)
    saved = sorted(path.name for path in (out / "run").glob("checkpoint-*"))
    resumed_code, resumed_output, _ = run(out, model_dir, url, "resume=latest")
    history_path = out / "log_history.json"
    history = json.loads(history_path.read_text()) if history_path.exists() else []
    newest = max((int(name.split("-")[1]) for name in saved), default=0)
    restored = [
        entry["rollout/groups_restored"]
        for entry in history
        if "rollout/groups_restored" in entry and entry["step"] > newest
    ]
    # What the faulty run trained up to its newest checkpoint stands; the rest was thrown away with the fault.
    kept = [record for record in first_leg if record["step"] < newest]
    resumed = [record for record in trained_records(out)[len(first_leg) :] if record["step"] < STEPS]
    trained = prompts_by_step(kept + resumed)
    return {
        "fault": FAULTS[name],
        "injected": was_injected,
        "exit": code,
        "seconds": round(seconds, 1),
        "error": error_line(output),
        "checkpoints": saved,
        "paused_after_fault": paused_after_fault,
        "resumed_exit": resumed_code,
        "resumed_said_paused": "was paused" in resumed_output,
        "paused_after_resume": server_paused(url),
        "groups_restored": restored[0] if restored else 0,
        "every_step_once": trained == reference,
    }


def table(report: dict) -> str:
    lines = [
        "| fault (from step 5) | the faulty run | server paused after it | the requeued run | groups restored | "
        "every step's prompts trained once |",
        "|---|---|---|---|---|---|",
    ]
    for case in report["faults"].values():
        ended = f"exit {case['exit']} in {case['seconds']:g} s, {', '.join(case['checkpoints']) or 'no checkpoint'}"
        if case["error"]:
            ended += f": `{case['error'].strip()[:140]}`"
        resumed = f"exit {case['resumed_exit']}" + (
            ", resumed the paused server" if case["resumed_said_paused"] else ""
        )
        resumed += ", server paused after" if case["paused_after_resume"] else ""
        lines.append(
            f"| {case['fault']} | {ended} | {'yes' if case['paused_after_fault'] else 'no'} | {resumed} | "
            f"{case['groups_restored']:g} | {'yes' if case['every_step_once'] else 'no'} |"
        )
    return "\n".join(lines)


def main(root: Path, model_dir: str, url: str, names: list[str]) -> None:
    code, output, _ = run(root / "uninterrupted", model_dir, url)
    assert code == 0, output[-3000:]
    reference = prompts_by_step(trained_records(root / "uninterrupted"))
    assert sorted(reference) == list(range(STEPS)), sorted(reference)
    report = {"faults": {name: fault_case(name, root, model_dir, url, reference) for name in names}}
    (root / "faults.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))
    print(table(report))


if __name__ == "__main__":
    output_root = Path(sys.argv[1])
    output_root.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main(output_root, sys.argv[2], sys.argv[3], sys.argv[4:] or list(FAULTS))
