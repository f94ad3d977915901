"""A rehearsal of the host work of DAPO's own run: 512 prompts x 16 responses per step, responses up to 20,480
tokens, through the real streaming client, driver, rollout and dynamic sampler, on 2 processes.

    python benchmarks/rehearsal.py            # the paper's data volume: a 512-group batch, lengths to 20,480
    python benchmarks/rehearsal.py --quick    # the same path at 16 groups, lengths to 2,048
    python benchmarks/rehearsal.py --quick --slowed   # what the suite runs: the server slowed 10x, a short timeout

A synthetic server (its own process, so its work is not counted) speaks the vLLM endpoints the client uses:
`/v1/models`, `/v1/completions` (n choices per group, each seeded by the request's seed: long-tailed lengths,
log-normal with median 3,000 tokens capped at max_tokens, as DAPO's responses run; token ids and log-probs; the JSON
as `vllm serve` writes it with `logprobs=0`, `return_token_ids` and `return_tokens_as_token_ids`: text, text offsets,
"token_id:N" token strings, top log-probs, token ids), `/metrics` (vLLM's token counters) and `/health`.
Two trainer processes (gloo, `accelerate launch --multi_gpu`) run `ServerStreamingRollout` with the main process's
`RolloutDriver` over `VLLMServerEngine`, for one generation batch, as the trainer does with streaming at
rollout_max_staleness 0: rounds of 512 groups (the oversampled generation batch's groups), waves scattered to the
processes, each scored by a model-free stand-in for TRL's scoring (a reward from the group's seed, the prompt
index and the completion lengths as the scored rows: TRL's padded rows and forwards live on the accelerator in a real
run and are not host work), the keep decisions taken by `DynamicSampler` until 512 groups with spread are kept.

It prints, per process, the peak RSS growth over the process's baseline and its CPU seconds (all threads: the
event loop that reads the answers, the driver, the main thread), and for the main process its CPU seconds per
million generated tokens. Goals at the paper's volume: RSS growth under 2 GB per process, main process under 1 CPU
second per million tokens (an 8-replica 7B engine generates ~50k tokens/s, simulated: docs/figures.md#throughput).

`--slowed`: the server generates each response at 5,000 tokens/s, and only 0.1 s of every second (paused 90% of the
time, as a server slowed ~10x), counting its tokens in `/metrics` as it goes; the client's request timeout is 3 s,
shorter than the longest response (~4 s slowed) and the batch. Timeouts are by progress (`vllm_request_timeout`:
no token generated for that long), so the batch completes; a timeout on the whole request would fail it.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
GROUP = 16
SLOWED_RATE, SLOWED_RUN, SLOWED_PAUSE, SLOWED_TIMEOUT = 5000.0, 0.1, 0.9, 3.0  # tokens/s per response; s; s; s
MEDIAN_TOKENS, SIGMA = 3000, 0.8  # log-normal response lengths, DAPO-like long tail


# ---------------------------------------------------------------------------------------------- the server
def lengths_for(seed: int, n: int, max_tokens: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    drawn = np.exp(np.log(MEDIAN_TOKENS * max_tokens / 20480) + SIGMA * rng.standard_normal(n))
    return np.clip(drawn.astype(np.int64), 1, max_tokens)


def choice_json(seed: int, index: int, length: int, max_tokens: int) -> str:
    """One completion choice as vLLM writes it (`logprobs=0`, token ids returned, tokens as "token_id:N")."""
    rng = np.random.default_rng([seed, index])
    ids = rng.integers(100, 150000, size=length)
    logprobs = -rng.exponential(0.7, size=length)
    id_text = ids.astype(str)
    logprob_text = np.char.mod("%.6f", logprobs)
    tokens = np.char.add("token_id:", id_text)
    token_list = '"' + '","'.join(tokens) + '"'
    top = ",".join(
        f'{{"{token}":{value}}}' for token, value in zip(tokens.tolist(), logprob_text.tolist(), strict=True)
    )
    offsets = ",".join(map(str, range(0, 4 * length, 4)))
    finish = "length" if length >= max_tokens else "stop"
    return (
        f'{{"index":{index},"text":"{"abcd" * min(length, 64)}","logprobs":{{"text_offset":[{offsets}],'
        f'"token_logprobs":[{",".join(logprob_text)}],"tokens":[{token_list}],"top_logprobs":[{top}]}},'
        f'"finish_reason":"{finish}","stop_reason":null,"token_ids":[{",".join(id_text)}],"prompt_logprobs":null,'
        '"prompt_token_ids":null}'
    )


def serve(port_file: str, slowed: bool = False) -> None:
    import http.server
    import threading

    generated = [0]
    running = threading.Event()
    running.set()
    lock = threading.Lock()

    def alternate() -> None:  # --slowed: generate for SLOWED_RUN s, pause for SLOWED_PAUSE s, and again
        while True:
            running.set()
            time.sleep(SLOWED_RUN)
            running.clear()
            time.sleep(SLOWED_PAUSE)

    def generate(tokens: int) -> None:
        """--slowed: `tokens` at SLOWED_RATE while running, counted in /metrics as they come."""
        left, tick = float(tokens), 0.02
        while left > 0:
            running.wait()  # paused: no token until the next running window
            step = min(left, SLOWED_RATE * tick)
            left -= step
            with lock:
                generated[0] += step
            time.sleep(tick)

    if slowed:
        threading.Thread(target=alternate, daemon=True).start()

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def do_GET(self):
            if self.path.endswith("/metrics"):
                with lock:
                    body = f"vllm:generation_tokens_total {float(generated[0])}\nvllm:num_requests_running 0.0\n"
                self._send(body.encode(), "text/plain")
            elif self.path.endswith("/v1/models"):
                self._send(json.dumps({"data": [{"id": "synthetic"}]}).encode())
            else:
                self._send(b"{}")

        def do_POST(self):
            request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            n, max_tokens, seed = request["n"], request["max_tokens"], request["seed"]
            lengths = lengths_for(seed, n, max_tokens)
            choices = ",".join(choice_json(seed, i, int(length), max_tokens) for i, length in enumerate(lengths))
            if slowed:  # the n responses of a group decode side by side: as long as the longest
                generate(int(lengths.max()))
                with lock:
                    generated[0] += int(lengths.sum() - lengths.max())
            else:
                with lock:
                    generated[0] += int(lengths.sum())
            body = f'{{"id":"cmpl-{seed}","object":"text_completion","model":"synthetic","choices":[{choices}]}}'
            self._send(body.encode())

        def _send(self, body: bytes, kind: str = "application/json") -> None:
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            try:
                self.wfile.write(body)
            except OSError:
                pass

    class Server(http.server.ThreadingHTTPServer):
        request_queue_size = 4096  # the client opens a connection per running group, hundreds at once
        daemon_threads = True

    server = Server(("127.0.0.1", 0), Handler)
    Path(port_file).write_text(str(server.server_address[1]))
    server.serve_forever()


# ---------------------------------------------------------------------------------------- a trainer process
def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def worker(url: str, groups: int, max_tokens: int, out: str, timeout: float = 600.0) -> None:
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist
    from accelerate import PartialState
    from accelerate.utils import gather_object

    from dapo_trl import DAPOConfig
    from dapo_trl.training.rollout.rollout_driver import RolloutDriver
    from dapo_trl.training.rollout.rollout_engine import RequestSampling
    from dapo_trl.training.rollout.rollout_setup import _broadcaster, _scatterer
    from dapo_trl.training.rollout.rollout_stream import ServerStreamingRollout
    from dapo_trl.training.rollout.server_engine import VLLMServerEngine
    from dapo_trl.training.sampling.dynamic_sampling import DynamicSampler, Process, ScoredRound

    PartialState()  # the process group accelerate launch set up
    rank, processes = dist.get_rank(), dist.get_world_size()
    state = SimpleNamespace(process_index=rank, num_processes=processes, is_main_process=rank == 0)
    per_device = groups * GROUP // processes
    args = DAPOConfig(
        output_dir="/tmp/unused",
        num_generations=GROUP,
        per_device_train_batch_size=per_device,
        steps_per_generation=1,
        gradient_accumulation_steps=1,
        max_completion_length=max_tokens,
        use_cpu=True,
        rollout_streaming=True,
        max_filter_gen_batches=0,
        report_to="none",
        seed=7,
    )
    dataset = [{"prompt": f"problem {i}", "index": i} for i in range(groups * 64)]
    process = Process(state.process_index, processes, gather_object)
    sampler = DynamicSampler(args, dataset, GROUP, {}, process, shuffle=True)
    baseline_rss, baseline_cpu = peak_rss_mb(), cpu_seconds()
    driver = None
    round_groups = groups
    if state.is_main_process:
        sampling = RequestSampling(n=GROUP, max_tokens=max_tokens)
        engine = VLLMServerEngine(url, sampling, max_in_flight=round_groups, timeout=timeout)
        held = round_groups * GROUP * max_tokens * 8  # the trainer's bound: one batch at full length
        driver = RolloutDriver(engine, round_groups, held)
        driver.loaded_externally(0)
    rollout = ServerStreamingRollout(
        sampler,
        driver,
        lambda prompts: [[1, 2, 3]] * len(prompts),
        _broadcaster(state),
        0,
        1,
        2 * timeout + 60,  # the trainer's wave timeout
        scatter=_scatterer(state),
    )
    rollout.first_round_from_loader = False  # every group from the seeded prompt stream
    tokens_seen = [0]

    def score_wave(rows, prepared) -> ScoredRound:
        """TRL's scoring, model-free: lengths and a reward per local row, gathered as TRL's scoring gathers."""
        lengths = [len(ids) for ids in prepared["completion_ids"]]
        tokens_seen[0] += sum(lengths)
        # A quarter of the prompts always right, a quarter always wrong (no spread: dropped), the rest mixed.
        rewards = [
            1.0 if row["index"] % 4 == 0 or (row["index"] % 4 > 1 and length % 2) else -1.0
            for row, length in zip(rows, lengths, strict=True)
        ]
        local = torch.tensor([[row["index"], length] for row, length in zip(rows, lengths, strict=True)])
        gathered = torch.cat(gather_object([local]))
        accuracy = torch.tensor(sum(gather_object([rewards]), []))
        return ScoredRound(
            rows={"prompt_ids": gathered[:, :1], "completion_ids": gathered[:, 1:], "advantages": accuracy.clone()},
            accuracy=accuracy,
        )

    started = time.monotonic()
    batch, metrics = rollout.sample([{"prompt": "unused", "index": 0}] * per_device, score_wave)
    seconds = time.monotonic() - started
    generated = driver.stats.generated_tokens if driver is not None else 0
    record = {
        "rank": state.process_index,
        "rss_growth_mb": peak_rss_mb() - baseline_rss,
        "cpu_seconds": cpu_seconds() - baseline_cpu,
        "wall_seconds": seconds,
        "generated_tokens": generated,
        "scored_local_tokens": tokens_seen[0],
        "kept_groups": int(batch["advantages"].numel() // GROUP),
        "rounds": metrics.get("dynamic_sampling/rounds"),
    }
    if driver is not None:
        driver.close()
    Path(out, f"rank{state.process_index}.json").write_text(json.dumps(record))
    dist.barrier()


# ----------------------------------------------------------------------------------------------------- main
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="16 groups, lengths to 2,048 (seconds)")
    parser.add_argument("--groups", type=int, default=None, help="groups kept per batch (default 512; quick 16)")
    parser.add_argument("--max-tokens", type=int, default=None, help="longest response (default 20480; quick 2048)")
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument(
        "--slowed", action="store_true", help=f"the server paused 90%% of the time, a {SLOWED_TIMEOUT:g} s timeout"
    )
    parser.add_argument("--timeout", type=float, default=600.0, help=argparse.SUPPRESS)
    parser.add_argument("--worker", nargs=2, metavar=("URL", "OUT"), help=argparse.SUPPRESS)
    parser.add_argument("--serve", metavar="PORT_FILE", help=argparse.SUPPRESS)
    options = parser.parse_args()
    groups = options.groups or (16 if options.quick else 512)
    max_tokens = options.max_tokens or (2048 if options.quick else 20480)
    if options.serve:
        serve(options.serve, options.slowed)
        return
    if options.worker:
        worker(*options.worker[:1], groups, max_tokens, options.worker[1], options.timeout)
        return
    import tempfile

    with tempfile.TemporaryDirectory() as out:
        port_file = os.path.join(out, "port")
        server = subprocess.Popen([sys.executable, __file__, "--serve", port_file, *(["--slowed"] * options.slowed)])
        try:
            while not os.path.exists(port_file) or not Path(port_file).read_text():
                time.sleep(0.05)
            url = f"http://127.0.0.1:{Path(port_file).read_text()}"
            command = [
                sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes",
                str(options.processes), "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                "--main_process_port", str(29700 + os.getpid() % 200), __file__,
                "--groups", str(groups), "--max-tokens", str(max_tokens), "--worker", url, out,
                "--timeout", str(SLOWED_TIMEOUT if options.slowed else 600.0),
            ]  # fmt: skip
            environment = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
            subprocess.run(command, check=True, env=environment)
        finally:
            server.terminate()
            server.wait()
        records = [json.loads(Path(out, f"rank{rank}.json").read_text()) for rank in range(options.processes)]
    main_record = records[0]
    millions = main_record["generated_tokens"] / 1e6
    print(
        f"# rehearsal: {groups} kept groups x {GROUP} responses, lengths to {max_tokens} (log-normal, median "
        f"{MEDIAN_TOKENS * max_tokens // 20480}), {options.processes} processes, synthetic vLLM server"
    )
    print(
        f"# generated {main_record['generated_tokens']:,} tokens in {main_record['rounds']:g} rounds, "
        f"{main_record['kept_groups']} groups kept, {main_record['wall_seconds']:.1f} s wall"
    )
    print("| process | peak RSS growth (MB) | CPU seconds (all threads) | CPU s per million generated tokens |")
    print("|---|---:|---:|---:|")
    for record in records:
        per_million = record["cpu_seconds"] / millions if millions else float("nan")
        print(f"| {record['rank']} | {record['rss_growth_mb']:.0f} | {record['cpu_seconds']:.2f} | {per_million:.3f} |")
    print("goals at the paper's volume: RSS growth < 2048 MB per process; main process < 1 CPU s per million tokens")
    if options.slowed:
        longest = max_tokens / SLOWED_RATE * (SLOWED_RUN + SLOWED_PAUSE) / SLOWED_RUN
        print(
            f"slowed server: generating {SLOWED_RUN:g} s of every {SLOWED_RUN + SLOWED_PAUSE:g} s, the longest "
            f"response ~{longest:.1f} s, request timeout {SLOWED_TIMEOUT:g} s: the batch completed in "
            f"{main_record['wall_seconds']:.1f} s"
        )


if __name__ == "__main__":
    main()
