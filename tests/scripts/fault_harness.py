"""Faults of the fast path against a real vLLM server: each injected at a chosen point by a hook, then the run
requeued as a scheduler would, and what survived checked.

Usage: python fault_harness.py OUT MODEL_DIR BASE_URL [FAULT ...]
The server runs MODEL_DIR in float32 and dev mode (as tests/test_vllm.py starts it). Every run is tests/scripts/
vllm_run.py's streaming trainer: k = 1 with in-flight weight updates over shared storage, 4 optimizer updates per
rollout, 12 steps, a checkpoint every 4, dynamic sampling off (so every step trains its stream's prompts, whatever
the timing: what "no group lost or trained twice" can be checked against). First an uninterrupted run (per process
count); then, per fault, a run with the fault injected from step 5 (the first of generation batch 1: version 1 loads
in flight under batch 2's groups, checkpoint-4 written just before), and the same command resumed with `latest`.
Checked after each: whether the server was left paused (`GET /is_paused`) after the faulty run and after the resumed
one, the faulty run's exit and the error it names, the groups generated ahead that its newest checkpoint kept and how
many of them the resumed run restored (`rollout/groups_restored`) against those its first batch must take from it,
and whether every step trained the uninterrupted run's prompts exactly once across the two runs. A server restart
(`restart_server`) is not requeued: the run waits for the server, which the harness starts again, and goes on; it
runs on a server of the harness's own. One-process legs are forked from an interpreter that has done the imports
(tests/warm_launch.py, as the suite starts its scripts; DAPO_TEST_COLD=1 starts each cold); two-process legs go through
`accelerate launch`, whose store fail-together reads. OUT/faults.json gets the outcomes, OUT/FAULT/runs.log every
leg's output; the table is printed in markdown (docs/reliability.md shows it).
"""

import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent / "vllm_run.py"
REPO = Path(__file__).resolve().parents[2]
sys.path.append(str(REPO))  # tests.warm_launch: each leg forked from an interpreter that has done the imports
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
    "kill_in_publish": "kill -9 of the training process halfway through writing weights version 1 to shared storage "
    "(the transfer)",
    "sigterm_in_save": "SIGTERM while checkpoint-8 is written (as it saves the groups generated ahead)",
    "kill_peer_in_reload": "2 processes: kill -9 of process 1 while the main process holds the server paused (inside "
    "an in-flight reload that then never returns)",
    "restart_server": "the server killed (kill -9 of its process group) as a group of version 1 starts, then started "
    "again on its port",
}
PROCESSES = {"kill_peer_in_reload": 2}  # the rest run one training process
GROUPS_PER_BATCH = 2  # per process: 2 rows x 4 updates per rollout / 4 completions per group
STEPS = 12  # 3 generation batches: batch 2 is waited for, so a failure of the engine's while it runs surfaces
FAULT_STEP = 4  # from the first step of generation batch 1: the load of version 1 is in flight


def command(out: Path, model_dir: str, url: str, overrides: tuple[str, ...], processes: int = 1) -> list[str]:
    """tests/scripts/vllm_run.py's streaming trainer: one process, or several gloo processes launched as
    `accelerate launch --multi_gpu` launches them (torchrun's agent, whose store the processes share)."""
    launch = [sys.executable]
    if processes > 1:
        port = str(29500 + os.getpid() % 1000)
        launch += ["-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(processes)]
        launch += ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
        launch += ["--main_process_port", port]
    return [*launch, str(SCRIPT), "server", str(out), model_dir, url, *COMMON, *overrides]


def run(out: Path, model_dir: str, url: str, *overrides: str, processes: int = 1) -> tuple[int, str, float]:
    args = command(out, model_dir, url, overrides, processes)
    started = time.monotonic()
    result = None
    if processes == 1 and not os.environ.get("DAPO_TEST_COLD"):  # forked with the imports done (tests/warm_launch)
        from tests.warm_launch import run_warm

        result = run_warm(args, REPO, dict(os.environ), 600, server_env=dict(os.environ))
    if result is None:  # several processes go through the real launcher: its store is what fail-together reads
        result = subprocess.run(args, capture_output=True, text=True, timeout=600)
    seconds = time.monotonic() - started
    logged(out, args, result.returncode, result.stdout + result.stderr)
    return result.returncode, result.stdout + result.stderr, seconds


def logged(out: Path, args: list[str], code: int, output: str) -> None:
    """Every leg's output in OUT/FAULT/runs.log, for when a row surprises."""
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "runs.log", "a") as log:
        log.write(f"$ {' '.join(args)}\nexit {code}\n{output}\n")


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


def checkpoints(out: Path) -> list[str]:
    return sorted((path.name for path in (out / "run").glob("checkpoint-*")), key=lambda name: int(name.split("-")[1]))


def groups_kept(checkpoint: Path, processes: int) -> tuple[int, int]:
    """(groups generated ahead that `checkpoint` kept, how many of them the resumed run's first batch must take from
    it instead of generating them again: its own groups, sampled at versions its staleness bound accepts). How many
    a checkpoint holds depends on how far the engine got by then; what a resume does with them does not."""
    import torch

    from dapo_trl.training.rollout.rollout_engine import PartialGroup

    state = torch.load(checkpoint / "dapo_rollout_state.pt", weights_only=True)
    kept = state.get("groups") or []
    bound = max(0, state["generation"] - state["staleness"])
    first_batch = {("stream", index) for index, _ in state["cursor"]["lookahead"][: GROUPS_PER_BATCH * processes]}
    return len(kept), sum(
        tuple(key) in first_batch and PartialGroup.from_state(group).oldest_version >= bound for key, group in kept
    )


def error_line(output: str) -> str:
    """The last line that says why the run ended: an error, or the preemption's (abandoned a step, or saved at the
    end of one)."""
    said, launcher = ("Error", "error:", "preempted:", "preempted at"), ("ChildFailedError", "distributed.elastic")
    lines = [
        line
        for line in output.splitlines()
        if any(words in line for words in said) and not any(words in line for words in launcher)
    ]
    if not lines:
        return ""
    line = re.sub(r"^\[rank\d+\]: ", "", lines[-1])  # a launched process's prefix
    return re.sub(r"^(\w+\.)+(?=\w+: )", "", line)[:300]  # the exception's name without its module


def fault_case(name: str, root: Path, model_dir: str, url: str, reference: dict[int, list]) -> dict:
    out, processes = root / name, PROCESSES.get(name, 1)
    if name == "restart_server":
        return restarted_server_case(out, model_dir, reference)
    code, output, seconds = run(out, model_dir, url, f"fault={name}", f"fault_step={FAULT_STEP}", processes=processes)
    was_injected = (out / "fault_injected").exists()
    paused_after_fault = server_paused(url)
    first_leg = trained_records(out)
    saved = checkpoints(out)
    held, first_batch_held = groups_kept(out / "run" / saved[-1], processes) if saved else (0, 0)
    resumed_code, resumed_output, _ = run(out, model_dir, url, "resume=latest", processes=processes)
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
        "processes": processes,
        "injected": was_injected,
        "exit": code,
        "seconds": round(seconds, 1),
        "error": error_line(output),
        "checkpoints": saved,
        "paused_after_fault": paused_after_fault,
        "resumed_exit": resumed_code,
        "resumed_said_paused": "was paused" in resumed_output,
        "paused_after_resume": server_paused(url),
        "groups_kept": held,
        "groups_the_resume_must_take": first_batch_held,
        "groups_restored": restored[0] if restored else 0,
        "every_step_once": trained == reference,
    }


def restarted_server_case(out: Path, model_dir: str, reference: dict[int, list]) -> dict:
    """`restart_server`, on a server of the harness's own (the one it was given keeps serving the other cases): the
    run's hook kills the server's process group as the engine starts a group of version 1 (`kill_server=PID`, groups
    of version 0 and 1 running), the harness starts it again on the same port at once, and the run is expected to
    wait for it, reload its weights and go on to the end: no requeue."""
    from vllm_server import free_port, start_server, stop, wait_healthy

    venv, port = str(Path(sys.executable).parent.parent), free_port()
    url = f"http://127.0.0.1:{port}"
    out.mkdir(parents=True, exist_ok=True)
    server = start_server(venv, model_dir, out / "server.log", port)
    try:
        wait_healthy(url, server)
        args = command(out, model_dir, url, (f"kill_server={server.pid}",))
        started = time.monotonic()
        trainer = None
        if not os.environ.get("DAPO_TEST_COLD"):
            from tests.warm_launch import popen_warm

            environment = dict(os.environ)
            trainer = popen_warm(args, REPO, environment, out / "trainer.log", server_env=environment)
        if trainer is None:
            with open(out / "trainer.log", "w") as log:
                trainer = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        try:
            server.wait(300)  # killed by the run's hook
            was_injected = trainer.poll() is None  # mid-run
            server = start_server(venv, model_dir, out / "server.log", port)
            code = trainer.wait(600)
        finally:
            if trainer.poll() is None:
                trainer.kill()
        seconds, output = time.monotonic() - started, (out / "trainer.log").read_text()
        logged(out, args, code, output)
        paused = server_paused(url)
    finally:
        stop(server)
    trained = prompts_by_step([record for record in trained_records(out) if record["step"] < STEPS])
    return {
        "fault": FAULTS["restart_server"],
        "processes": 1,
        "injected": was_injected and "killed the server" in output,
        "exit": code,
        "seconds": round(seconds, 1),
        "error": error_line(output),
        "checkpoints": checkpoints(out),
        "waited_for_the_server": "waiting up to" in output and "answers again" in output,
        "paused_after_fault": paused,
        "resumed_exit": None,  # not requeued: the run went on
        "resumed_said_paused": False,
        "paused_after_resume": paused,
        "groups_kept": None,
        "groups_the_resume_must_take": None,
        "groups_restored": None,
        "every_step_once": trained == reference,
    }


def table(report: dict) -> str:
    lines = [
        "| fault (from step 5) | the faulty run | server paused after it | the requeued run | groups kept / restored "
        "| every step's prompts trained once |",
        "|---|---|---|---|---|---|",
    ]
    for case in report["faults"].values():
        ended = f"exit {case['exit']} in {case['seconds']:g} s, {', '.join(case['checkpoints']) or 'no checkpoint'}"
        if case["error"]:
            ended += f": `{case['error'].strip()[:140]}`"
        if case["resumed_exit"] is None:
            ended += ", waited for the server and went on" if case.get("waited_for_the_server") else ""
            resumed, restored = "not needed: the run went on", "-"
        else:
            resumed = f"exit {case['resumed_exit']}" + (
                ", resumed the paused server" if case["resumed_said_paused"] else ""
            )
            resumed += ", server paused after" if case["paused_after_resume"] else ""
            restored = f"{case['groups_kept']} / {case['groups_restored']:g}"
        lines.append(
            f"| {case['fault']} | {ended} | {'yes' if case['paused_after_fault'] else 'no'} | {resumed} | "
            f"{restored} | {'yes' if case['every_step_once'] else 'no'} |"
        )
    return "\n".join(lines)


def main(root: Path, model_dir: str, url: str, names: list[str]) -> None:
    references: dict[int, dict[int, list]] = {}  # per process count: each step's prompts, uninterrupted
    for processes in sorted({PROCESSES.get(name, 1) for name in names}):
        out = root / ("uninterrupted" if processes == 1 else f"uninterrupted-{processes}-processes")
        code, output, _ = run(out, model_dir, url, processes=processes)
        assert code == 0, output[-3000:]
        references[processes] = prompts_by_step(trained_records(out))
        assert sorted(references[processes]) == list(range(STEPS)), sorted(references[processes])
    report = {
        "faults": {name: fault_case(name, root, model_dir, url, references[PROCESSES.get(name, 1)]) for name in names}
    }
    (root / "faults.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))
    print(table(report))


if __name__ == "__main__":
    output_root = Path(sys.argv[1])
    output_root.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main(output_root, sys.argv[2], sys.argv[3], sys.argv[4:] or list(FAULTS))
