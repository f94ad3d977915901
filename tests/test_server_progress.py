"""Timeouts by progress (`training/rollout/server_progress.py`): a request to a vLLM server fails when the server
has made no progress for `vllm_request_timeout`, never because its response is long; streaming (`VLLMServerEngine`)
and rounds (TRL's client through `watch_generation`) alike.

A local stand-in for `vllm serve` generates "tokens" on a clock: `/v1/completions` answers once `tokens` were
generated, `/metrics` exports vLLM's token counter. `pause()` stops generation (the server slowed: paused and resumed
in a cycle); `freeze()` also stops every answer, /metrics included (its process stopped, as SIGSTOP does).
"""

from __future__ import annotations

import http.server
import json
import threading
import time
from types import SimpleNamespace

import pytest
import requests

from dapo_trl.training.faults.preemption import AbandonedRound, is_abandoned_round
from dapo_trl.training.rollout.rollout_engine import GroupRequest, RequestSampling
from dapo_trl.training.rollout.server_engine import VLLMServerEngine
from dapo_trl.training.rollout.server_progress import ServerProgress, token_counters, watch_generation
from dapo_trl.training.rollout.vllm_server_api import VLLMServerError, add_timeouts

TOKENS_PER_SECOND = 40.0


class ClockedServer:
    """See the module docstring. `cycle(run, pause)` alternates generating for `run` s and pausing for `pause` s."""

    def __init__(self, tokens: int):
        self.tokens = tokens
        self.generated = 0.0
        self.running = threading.Event()
        self.running.set()
        self.frozen = threading.Event()
        self.stopped = threading.Event()
        self.lock = threading.Lock()
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                server.wait_thawed()
                if self.path.endswith("/metrics"):
                    with server.lock:
                        counter = f'vllm:generation_tokens_total{{model_name="m"}} {server.generated}'
                    text = f"# TYPE vllm:generation_tokens_total counter\n{counter}\n"
                    self.reply(200, text.encode(), "text/plain")
                elif self.path.endswith("/v1/models"):
                    self.reply(200, json.dumps({"data": [{"id": "m"}]}).encode())
                else:
                    self.reply(200, b"{}")

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                left = server.tokens
                while left > 0 and not server.stopped.is_set():
                    server.wait_thawed()
                    if server.running.is_set():
                        left -= TOKENS_PER_SECOND * 0.02
                        with server.lock:
                            server.generated += TOKENS_PER_SECOND * 0.02
                    time.sleep(0.02)
                server.wait_thawed()
                ids = list(range(5, 5 + server.tokens))
                choice = {"token_ids": ids, "logprobs": {"token_logprobs": [-0.5] * len(ids)}, "text": ""}
                self.reply(200, json.dumps({"choices": [choice] * body.get("n", 1)}).encode())

            def reply(self, status, payload, kind="application/json"):
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.base_url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def wait_thawed(self) -> None:
        while self.frozen.is_set() and not self.stopped.is_set():
            time.sleep(0.02)

    def cycle(self, run: float, pause: float) -> None:
        def alternate():
            while not self.stopped.is_set():
                self.running.set()
                time.sleep(run)
                self.running.clear()
                time.sleep(pause)
            self.running.set()

        threading.Thread(target=alternate, daemon=True).start()

    def close(self) -> None:
        self.stopped.set()
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def clocked():
    servers = []

    def make(tokens: int) -> ClockedServer:
        servers.append(ClockedServer(tokens))
        return servers[-1]

    yield make
    for server in servers:
        server.close()


def stream_one_group(base_url: str, timeout: float) -> tuple[object, float]:
    """One group request through the streaming client: (its result or error, seconds it took)."""
    sampling = RequestSampling(
        n=2, max_tokens=512, temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0, extra={}
    )
    engine = VLLMServerEngine(base_url, sampling, max_in_flight=2, timeout=timeout)
    finished, answers = threading.Event(), []
    start = time.monotonic()
    engine.start(
        GroupRequest(("stream", 0), [1, 2, 3], 7, 0), lambda _, result: (answers.append(result), finished.set())
    )
    assert finished.wait(60), "no answer"
    engine.close()
    return answers[0], time.monotonic() - start


def rounds_client(base_url: str, timeout: float) -> SimpleNamespace:
    """TRL's VLLMClient as far as the timeouts see it: its session, base_url and a blocking `generate`."""
    session = requests.Session()
    client = SimpleNamespace(session=session, base_url=base_url)
    client.generate = lambda prompts=(), n=2: session.post(f"{base_url}/v1/completions", json={"n": n}).json()
    add_timeouts(client, timeout)
    watch_generation(client, timeout, VLLMServerError)
    return client


def test_a_long_response_from_a_slowed_server_is_no_timeout(clocked):
    """A response that takes ~4x the timeout, from a server paused 80% of the time in cycles shorter than the
    timeout (~5x slower), completes: streaming and rounds."""
    server = clocked(tokens=48)  # ~1.2 s of generation at full speed, ~6 s at 20% duty
    server.cycle(run=0.15, pause=0.6)
    result, seconds = stream_one_group(server.base_url, timeout=1.5)
    assert not isinstance(result, BaseException), result
    assert result.completion_ids == [list(range(5, 53))] * 2 and seconds > 1.5 * 2
    start = time.monotonic()
    answer = rounds_client(server.base_url, timeout=1.5).generate()
    assert len(answer["choices"]) == 2 and time.monotonic() - start > 1.5 * 2


@pytest.mark.parametrize("client", ["streaming", "rounds"])
def test_a_frozen_server_fails_within_the_timeout_naming_its_url(clocked, client):
    server = clocked(tokens=400)
    threading.Timer(0.3, server.frozen.set).start()  # frozen mid-response, /metrics too
    start = time.monotonic()
    if client == "streaming":
        result, seconds = stream_one_group(server.base_url, timeout=1.0)
        assert isinstance(result, RuntimeError)
        message = str(result)
    else:
        with pytest.raises(VLLMServerError) as raised:
            rounds_client(server.base_url, timeout=1.0).generate()
        seconds, message = time.monotonic() - start, str(raised.value)
    assert f"the vLLM server at {server.base_url} made no progress for" in message
    assert "vllm_request_timeout=1 s" in message
    assert 1.0 < seconds < 1.3 + 1.0 + 2.0  # timeout after the freeze, plus polls and a little slack


def test_a_preemption_signal_abandons_a_round_in_flight_at_once(clocked):
    """Rounds mode: a signal during the POST shuts its connection and `generate` returns `AbandonedRound` markers,
    one per completion, with empty log-probs, long before the round (~10 s) or the timeout (60 s) ends; with the
    flag already set, nothing is sent."""
    server = clocked(tokens=400)
    started, posts = threading.Event(), []
    handler = server.httpd.RequestHandlerClass
    post = handler.do_POST

    def do_post(self):
        posts.append(self.path)
        started.set()  # generation has started: the "signal" arrives now
        try:
            post(self)
        except (BrokenPipeError, ConnectionResetError):  # its answer, after the client shut the connection
            pass

    handler.do_POST = do_post
    client = rounds_client(server.base_url, timeout=60.0)
    client.generation_progress.abandon_when = started.is_set
    start = time.monotonic()
    answer = client.generate(prompts=[[1, 2], [3]], n=2)
    seconds = time.monotonic() - start
    assert seconds < 2.0 and len(posts) == 1
    assert is_abandoned_round(answer["completion_ids"]) and len(answer["completion_ids"]) == 4
    assert all(isinstance(row, AbandonedRound) for row in answer["completion_ids"])
    assert answer["logprobs"] == [[]] * 4 and answer["prompt_ids"] == [[1, 2], [3]]
    assert answer["logprob_token_ids"] is None
    again = client.generate(prompts=[[1, 2]], n=3)  # flag still set: returned without a POST
    assert len(posts) == 1 and len(again["completion_ids"]) == 3 and is_abandoned_round(again["completion_ids"])
    print(f"signal to abandoned round: {seconds:.2f} s")


def test_an_abandoned_round_passes_through_trls_vllm_generation():
    """TRL 1.16's `VLLMGeneration.generate` (server branch, one process) hands the markers on as completions, with
    TRL's own top-1 log-prob step after it working on the empty rows."""
    from trl.generation.vllm_generation import VLLMGeneration

    from dapo_trl.training.rollout.server_progress import abandoned_round

    generation = VLLMGeneration.__new__(VLLMGeneration)
    generation.mode, generation.enable_sleep_mode = "server", False
    generation.accelerator = SimpleNamespace(is_main_process=True, process_index=0, num_processes=1)
    generation.logprobs, generation.structured_outputs_regex, generation.generation_kwargs = 0, None, {}
    generation.repetition_penalty, generation.temperature, generation.top_p, generation.top_k = 1.0, 1.0, 1.0, 0
    generation.min_p, generation.max_completion_length = None, 8
    generation.vllm_client = SimpleNamespace(generate=abandoned_round)
    prompts = [[1, 2], [1, 2], [3], [3]]
    _, completion_ids, logprobs, _ = generation.generate(prompts=prompts, images=None, num_generations=2)
    assert is_abandoned_round(completion_ids) and len(completion_ids) == 4
    assert [[lp[0] for lp in seq] for seq in logprobs] == [[]] * 4


def test_progress_counts_moving_token_counters_and_answers_not_time():
    """The watchdog's rule on its own: counters that move keep a request alive; still counters and no answer for
    the timeout call on_stall once, then the clock restarts; a server without counters is judged by answers."""
    readings = iter([10.0, 20.0, 30.0] + [30.0] * 100)
    stalls = []
    progress = ServerProgress(
        "http://x", 0.3, lambda: f"vllm:prompt_tokens_total {next(readings)}\n", stalls.append, poll_seconds=0.05
    )
    progress.begin()
    time.sleep(0.25)
    assert not stalls  # the counters moved
    deadline = time.monotonic() + 3
    while not stalls and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(stalls) == 1 and "made no progress" in stalls[0]
    progress.end()
    progress.close()
    blind = ServerProgress("http://y", 0.3, lambda: None, stalls.append, poll_seconds=0.05)
    blind.begin()
    time.sleep(0.5)
    assert len(stalls) == 2 and not blind.counters_available
    assert "token counters" not in stalls[1]
    blind.close()
    assert token_counters('vllm:generation_tokens_total{a="1"} 3\nvllm:generation_tokens_total{a="2"} 4.5\n') == 7.5
    assert token_counters("other_total 3\n") is None


def test_a_pause_we_hold_is_no_stall_and_has_its_own_bound():
    """While we hold the server paused (a weight transfer) its counters stand still by design: no stall for the
    stall timeout; past the pause's own bound, its own message (the transfer did not finish). A server without
    counters is reported once, at start, naming what the watchdog judges by."""
    stalls = []
    progress = ServerProgress(
        "http://x", 0.2, lambda: "vllm:generation_tokens_total 5\n", stalls.append, poll_seconds=0.02, pause_timeout=1.0
    )
    assert progress.report_counters()
    progress.begin()
    progress.hold()
    time.sleep(0.6)  # three stall timeouts, still counters, no answer: we hold it paused
    assert not stalls and progress.stalled_for() == 0.0
    deadline = time.monotonic() + 5
    while not stalls and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(stalls) == 1 and "paused for a weight update" in stalls[0] and "ddp_timeout" in stalls[0]
    progress.release()
    time.sleep(0.1)
    assert len(stalls) == 1  # resumed: a full stall window from the resume
    progress.end()
    progress.close()


def test_a_server_without_token_counters_is_reported_once_at_start(caplog):
    blind = ServerProgress("http://y", 0.3, lambda: None, poll_seconds=0.05)
    with caplog.at_level("WARNING"):
        assert not blind.report_counters()
    blind.close()
    warnings = [
        record.getMessage() for record in caplog.records if "exports no vLLM token counters" in record.getMessage()
    ]
    assert len(warnings) == 1 and "bounds the silence of a streamed answer" in warnings[0]
