"""The streaming rollout's engine for a `vllm serve` server: one OpenAI `/v1/completions` request per group (prompt
token ids, `n`, `seed`, `max_tokens`, sampled-token log-probs), all on one event loop, each on its own connection so
that cancelling a group closes it (vLLM then aborts the request).

The server's URL is honoured as TRL's client honours it for rounds: `https://` speaks TLS (port 443 by default,
certificates checked against `REQUESTS_CA_BUNDLE` / `CURL_CA_BUNDLE` when set, as `requests` does, else the system's
store), and a path (a proxy's `/proxy/vllm`) prefixes every endpoint.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import logging
import ssl
import threading
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from .rollout_engine import Callback, EngineUnavailable, GroupRequest, GroupResult, PartialGroup, RequestSampling
from .server_answers import StreamedAnswer, continued_completions, group_result, group_so_far
from .server_http import read_response, server_address, untrusted
from .server_pause import ServerPause
from .server_progress import ServerProgress, metric_sum

READ_AT_ONCE = 4  # answers whose bodies are read at the same time
QUEUE_METRICS = ("vllm:num_requests_running", "vllm:num_requests_waiting")

logger = logging.getLogger(__name__)


class VLLMServerEngine:
    """Group requests to a `vllm serve` server, all on one event loop (one thread, however many groups run), each
    request on its own connection, at most `max_in_flight` open at once; cancelling a request closes its connection,
    which vLLM answers by aborting it (its `with_cancellation`), and a request cancelled before it connected is never
    sent.

    Weights: `load_weights(version)` waits until the server runs no request (it asks `/metrics`: an aborted request
    may still hold KV blocks for a moment), then asks the dev-mode server to reload `weights_root/v{version}` (as the
    server sees it), which the trainer wrote with `publish`, and resets the prefix cache (KV computed under the
    previous weights must not be reused).

    In-flight weight updates (`in_flight_updates`, docs/rollout.md): answers are streamed
    (`server_answers.StreamedAnswer`), and a version loaded while requests run pauses the server with them kept
    (`/pause?mode=keep`), reloads, marks in every running answer where the new version takes over, and resumes them
    (`/resume`): no request restarts and no slot waits for the others to drain. vLLM 0.31 drops the kept requests' KV
    cache at the pause (and recomputes it with the new weights when they resume) unless `keep_kv_cache`
    (`clear_cache=false`): then they continue from the KV cache the old weights wrote, and the importance weight
    absorbs the mismatch. With `whole_answers` (routing replay: vLLM 0.31 returns routed experts only in a whole
    answer) answers are not streamed: each token's routing is still the version's that sampled the next one (the
    paused requests' routings before the switch are kept, later ones come from the new weights), but where the switch
    fell in a response is not known, so a row keeps the version it began under (the staleness bound holds) and a
    checkpoint keeps the finished groups only (with their routings).

    Timeouts measure progress, not length (`server_progress`): a group request fails only when the server has made
    no progress for `timeout` seconds (its token counters still, no answer of ours) while requests are outstanding,
    so a 20k-token response that takes 900 s is no timeout; a frozen server fails every running request within
    `timeout` plus one poll, naming its URL. A reload and every small request (models, metrics, health) must be
    answered within `timeout`.

    A server this engine paused is always resumed (`server_pause.ServerPause`): `/resume` runs in a `finally` of
    every load, a failed fence included; `release_pause` resumes it from the exit paths (a peer's failure, the grace
    exit, Ctrl-C, the end of `train()`); and a new engine resumes a server an earlier run left paused
    (`/is_paused`), saying so. While it holds the server paused the progress watchdog judges the pause by its own
    bound (`pause_timeout`: a weight transfer's), not the stall timeout.
    """

    def __init__(
        self,
        base_url: str,
        sampling: RequestSampling,
        max_in_flight: int,
        timeout: float,
        weights_server_root: str | Path | None = None,
        reload: Callable[[str, str, float], None] | None = None,
        weights_local_root: str | Path | None = None,
        in_flight_updates: bool = False,
        keep_kv_cache: bool = False,
        whole_answers: bool = False,
        pause_timeout: float | None = None,
    ):
        self.base_url = base_url.strip().rstrip("/")
        self._host, self._port, self._path, self._ssl = server_address(self.base_url)
        self._host_header = urllib.parse.urlsplit(self.base_url).netloc
        self.sampling = sampling
        self.timeout = timeout
        self.weights_server_root = None if weights_server_root is None else str(weights_server_root)
        self._reload = reload
        self.weights_local_root = None if weights_local_root is None else Path(weights_local_root)
        self.model = self._model_name()
        self._max_in_flight = max(1, max_in_flight)
        self._tasks: dict[int, asyncio.Task] = {}  # id(request) -> its task (a cancelled key is requested again)
        self._closed = False
        self._queued, self._queued_lock = 0, threading.Lock()  # started, not yet on the loop
        self._loop = asyncio.new_event_loop()
        self._connections = asyncio.Semaphore(self._max_in_flight)
        # Answers read at once: the others wait in their sockets (TCP holds the server back), so the bytes held here
        # are a few answers', not every running group's (16 x 20k tokens of JSON is ~30 MB).
        self._reading = asyncio.Semaphore(READ_AT_ONCE)
        self._stalled: dict[int, str] = {}  # id(request) -> why it was failed (the server stalled)
        self.updates_in_flight = in_flight_updates  # the driver may load a version while requests run
        self.keep_kv_cache = keep_kv_cache  # paused requests continue from the old weights' KV cache
        self.whole_answers = whole_answers  # in flight, answers still arrive whole (routed experts come only so)
        # id(request) -> (request, its streamed answers: one, or one per completion a resumed group continues)
        self._answers: dict[int, tuple[GroupRequest, list[StreamedAnswer]]] = {}
        self._received = 0  # bytes of streamed answers received: the fence waits until they stand still
        self._thread = threading.Thread(target=self._loop.run_forever, name="dapo-rollout-http", daemon=True)
        self._thread.start()
        self.progress = ServerProgress(
            self.base_url, timeout, self._metrics_text, self._fail_running, pause_timeout=pause_timeout
        )
        self.progress.report_counters()  # once, at start: what the watchdog will judge progress by
        self.pausing = ServerPause(self.base_url, self._post_control, self._get, self.progress, timeout, keep_kv_cache)
        self.pausing.resume_if_left_paused()

    def last_progress(self) -> float:
        """`time.monotonic()` when the server last made progress (for waits above the engine, e.g. a wave's)."""
        return self.progress.last_progress

    def _metrics_text(self) -> str | None:
        status, body = self._get("/metrics", timeout=min(self.timeout, 10.0))
        return body.decode(errors="replace") if status == 200 else None

    def _fail_running(self, message: str) -> None:
        """The server stalled (`progress`): fail every request of ours that is running or waiting for a connection."""

        def fail() -> None:
            for request_id, task in list(self._tasks.items()):
                self._stalled[request_id] = message
                task.cancel()

        if not self._closed:
            self._loop.call_soon_threadsafe(fail)

    def _model_name(self) -> str:
        status, body = self._get("/v1/models")
        if status != 200:
            raise RuntimeError(f"GET {self.base_url}/v1/models: HTTP {status}: {body[:500]!r}")
        return json.loads(body)["data"][0]["id"]

    def _connection(self, timeout: float) -> http.client.HTTPConnection:
        """A blocking connection to the server (TLS for an https:// URL), for the small requests."""
        if self._ssl is None:
            return http.client.HTTPConnection(self._host, self._port, timeout=timeout)
        return http.client.HTTPSConnection(self._host, self._port, timeout=timeout, context=self._ssl)

    def _get(self, path: str, timeout: float | None = None) -> tuple[int, bytes]:
        timeout = self.timeout if timeout is None else timeout
        connection = self._connection(timeout)
        try:
            connection.request("GET", self._path + path)
            answer = connection.getresponse()
            return answer.status, answer.read()
        except ssl.SSLCertVerificationError as exc:  # not a server gone: waiting for it would not help
            raise RuntimeError(untrusted(f"GET {self.base_url}{path}", exc)) from exc
        except TimeoutError as exc:  # connected, no answer: a stalled server, not one restarting
            raise RuntimeError(
                f"GET {self.base_url}{path}: the vLLM server at {self.base_url} did not answer within {timeout:g} s "
                "(vllm_request_timeout): it is frozen or overloaded"
            ) from exc
        except (OSError, http.client.HTTPException) as exc:
            raise EngineUnavailable(f"GET {self.base_url}{path}: cannot reach the vLLM server ({exc})") from exc
        finally:
            connection.close()

    # ---------------------------------------------------------------------------------------------- caller side
    def start(self, request: GroupRequest, done: Callback) -> None:
        if self._closed:
            raise RuntimeError(f"the rollout engine for {self.base_url} is closed")
        with self._queued_lock:
            self._queued += 1
        self._loop.call_soon_threadsafe(self._launch, request, done)

    def cancel(self, request: GroupRequest) -> None:
        """Cancel `request` (started earlier from any thread: the loop runs calls in the order they were made)."""
        if not self._closed:
            self._loop.call_soon_threadsafe(self._cancel, id(request))

    def running(self) -> int:
        """Requests of ours started and not yet over (cancelled ones included until their connection is closed)."""
        with self._queued_lock:
            return self._queued + len(self._tasks)

    @property
    def partial_rollouts(self) -> bool:
        """Whether running groups are known as far as they were sampled (streamed answers), for a checkpoint."""
        return self.updates_in_flight and not self.whole_answers

    def request_payload(self, request: GroupRequest) -> dict[str, Any]:
        """The JSON body of one group's request (override to change sampling per group). With `keep_kv_cache` the
        pauses keep the prefix cache, so each weights version gets a cache of its own (vLLM's `cache_salt`, keyed by
        the version the request starts under): a new request never reuses prompt blocks an older version computed."""
        payload = self.sampling.payload(self.model, request)
        if self.keep_kv_cache:
            payload["cache_salt"] = f"dapo-trl-weights-v{request.version}"
        return {**payload, "stream": True} if self.partial_rollouts else payload

    def load_weights(self, version: int) -> None:
        if self._reload is None or self.weights_server_root is None:
            raise RuntimeError("this VLLMServerEngine was built without a weights directory to reload versions from")
        local = (
            None if self.weights_local_root is None else self.weights_local_root / f"v{version}" / "model.safetensors"
        )
        if local is not None and not local.exists():  # a reload from a missing directory kills vLLM's engine
            raise RuntimeError(
                f"weights version {version} is not in {local.parent}: a resumed run with rollout_max_staleness k "
                "needs the k versions before its checkpoint (saved in checkpoint/rollout_weights)"
            )
        if self.updates_in_flight and self.running():
            self._load_in_flight(version)
            return
        self.wait_server_idle()
        self._reload(self.base_url, f"{self.weights_server_root}/v{version}", self.timeout)

    def _load_in_flight(self, version: int) -> None:
        """Pause the server with our requests kept, reload, mark the switch in every answer, resume."""
        try:
            self.pause()
            # The pause cleared the prefix cache, or kept it with the running requests' KV cache (vLLM refuses a reset
            # while they hold blocks): either way, no reset now.
            self._reload(self.base_url, f"{self.weights_server_root}/v{version}", self.timeout, False)
        except BaseException:
            with contextlib.suppress(Exception):  # a server that lost its weights is dead; this error says why
                self.resume(None)
            raise
        self.resume(version)

    def pause(self) -> None:
        """Pause the server with our requests kept, for a weights load (`ServerPause.pause`)."""
        self.pausing.pause()

    def resume(self, version: int | None) -> None:
        """Version `version` is loaded: mark where it takes over in every running answer, and resume them (None: a
        load that failed; resumed only so that no paused server is left behind). `/resume` is posted whatever the
        fence does (a fence that times out raises after it)."""
        try:
            if version is not None and self.partial_rollouts:  # whole answers: no switch to mark
                asyncio.run_coroutine_threadsafe(self._fence(version), self._loop).result(self.timeout)
        finally:
            self.pausing.resume()

    @property
    def paused_by_us(self) -> bool:
        """Whether this engine paused the server and has not resumed it yet."""
        return self.pausing.paused_by_us

    def release_pause(self, why: str, wait: float = 0.0) -> bool:
        """Resume the server if this engine left it paused (an exit path: `why`; `ServerPause.release`)."""
        return self.pausing.release(why, wait)

    async def _fence(self, version: int, quiet: float = 0.05) -> None:
        """Once what the paused server sent has arrived (no answer of ours received a byte for `quiet` seconds),
        every running answer's later tokens are `version`'s."""
        while True:
            before = self._received
            await asyncio.sleep(quiet)
            if self._received == before:
                break
        for _, answers in self._answers.values():
            for answer in answers:
                answer.fence(version)

    def partial_groups(self) -> dict[tuple, PartialGroup]:
        """Every running group's completions as far as they arrived (in-flight updates: streamed answers), for a
        checkpoint: a resumed run continues them (`GroupRequest.partial`) instead of generating them again."""

        async def collect() -> dict[tuple, PartialGroup]:
            most = self.sampling.max_tokens
            return {request.key: group_so_far(request, answers, most) for request, answers in self._answers.values()}

        return asyncio.run_coroutine_threadsafe(collect(), self._loop).result(self.timeout)

    def _continuation(self, request: GroupRequest, index: int) -> dict[str, Any]:
        """The request that continues completion `index` of a resumed group: its prompt and kept tokens as the
        prompt, the tokens it has left, one completion, a seed of its own."""
        kept = request.partial.token_ids[index]
        seed = None if request.seed is None else hash((request.seed, index)) & 0x7FFFFFFF
        prompt = [*request.prompt_ids, *kept.tolist()]
        payload = self.request_payload(replace(request, prompt_ids=prompt, seed=seed, partial=None))
        return {**payload, "n": 1, "max_tokens": payload["max_tokens"] - len(kept)}

    def _post_control(self, path: str, timeout: float | None = None) -> None:
        """POST to a dev-mode control endpoint (`/pause`, `/resume`); an error answer names the endpoint."""
        connection = self._connection(self.timeout if timeout is None else timeout)
        try:
            connection.request("POST", self._path + path)
            answer = connection.getresponse()
            status, body = answer.status, answer.read()
        except (OSError, http.client.HTTPException) as exc:
            raise EngineUnavailable(f"POST {self.base_url}{path}: cannot reach the vLLM server ({exc})") from exc
        finally:
            connection.close()
        if status != 200:
            raise RuntimeError(
                f"POST {self.base_url}{path}: HTTP {status}: {body[:500]!r} (in-flight weight updates need vLLM >= "
                "0.31 served with VLLM_SERVER_DEV_MODE=1)"
            )

    def wait_server_idle(self, poll: float = 0.05, recover_within: float = 0.0) -> None:
        """Return once none of our connections is open and the server reports no running or waiting request: a
        request still running under the old weights would hold KV blocks (the prefix-cache reset is refused) and
        finish with tokens of two versions. A server that cannot be reached is waited for up to `recover_within`
        seconds (a restarted one runs nothing)."""
        deadline = time.monotonic() + self.timeout
        while True:
            ours = self.running()
            try:
                theirs = self.server_requests() if ours == 0 else None
            except EngineUnavailable:
                if recover_within <= 0:
                    raise
                self.wait_available(recover_within)
                recover_within, deadline = 0.0, time.monotonic() + self.timeout
                continue
            if ours == 0 and not theirs:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"the vLLM server at {self.base_url} still runs requests {self.timeout:g} s after ours were "
                    f"cancelled ({ours} connections of ours open, server reports {theirs}): another client shares "
                    "it, or it is stuck; weights cannot be reloaded under running requests"
                )
            time.sleep(poll)

    def server_requests(self) -> int | None:
        """Requests the server runs or queues (`vllm:num_requests_running` + `_waiting` of `/metrics`), or None when
        it exports no such metric (not a vLLM server: nothing to ask)."""
        status, body = self._get("/metrics")
        total = metric_sum(body.decode(errors="replace"), QUEUE_METRICS) if status == 200 else None
        return None if total is None else int(total)

    def wait_available(self, timeout: float, poll: float = 1.0) -> None:
        """Return once the server answers GET /health again (a restarted server: model loaded), or raise
        EngineUnavailable naming it after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                if self._get("/health")[0] == 200:
                    return
            except (EngineUnavailable, RuntimeError):  # refused, or not answering yet: still coming back
                pass
            if time.monotonic() > deadline:
                raise EngineUnavailable(
                    f"the vLLM server at {self.base_url} did not come back within "
                    f"vllm_server_recovery_timeout={timeout:g} s"
                )
            time.sleep(poll)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.progress.close()

        async def stop() -> None:
            for task in list(self._tasks.values()):
                task.cancel()
            await asyncio.gather(*self._tasks.values(), return_exceptions=True)
            self._loop.stop()

        self._loop.call_soon_threadsafe(lambda: self._loop.create_task(stop()))
        self._thread.join(timeout=10)

    # ------------------------------------------------------------------------------------------- the event loop
    def _launch(self, request: GroupRequest, done: Callback) -> None:
        if self.partial_rollouts:  # registered before a fence can run on this loop
            answers = [StreamedAnswer(self.sampling.n, request.version)]
            if request.partial is not None:
                continued = continued_completions(request, self.sampling.max_tokens)
                answers = [StreamedAnswer(1, request.version) for _ in continued]
            self._answers[id(request)] = (request, answers)
        task = self._loop.create_task(self._run(request, done))
        with self._queued_lock:
            self._tasks[id(request)], self._queued = task, self._queued - 1

        def forget(_: asyncio.Task) -> None:
            self._tasks.pop(id(request), None)
            self._answers.pop(id(request), None)

        task.add_done_callback(forget)

    def _cancel(self, request_id: int) -> None:
        task = self._tasks.get(request_id)
        if task is not None:
            task.cancel()

    async def _run(self, request: GroupRequest, done: Callback) -> None:
        started, answered = time.monotonic(), False
        self.progress.begin()
        try:
            _, answers = self._answers.get(id(request), (request, None))
            async with self._connections:
                if answers is not None and request.partial is not None:  # a resumed group: continue what it kept
                    continued = continued_completions(request, self.sampling.max_tokens)
                    posts = [self._continuation(request, index) for index in continued]
                    sent = [
                        self._post("/v1/completions", post, answer) for post, answer in zip(posts, answers, strict=True)
                    ]
                    failed = (got for got in await asyncio.gather(*sent) if got[0] != 200)
                    status, raw = next(failed, (200, b""))
                else:
                    answer = None if answers is None else answers[0]
                    status, raw = await self._post("/v1/completions", self.request_payload(request), answer)
            answered = True
            if status != 200:
                raise RuntimeError(f"POST {self.base_url}/v1/completions: HTTP {status}: {raw[:2000]!r}")
            seconds = time.monotonic() - started
            result: GroupResult | BaseException = (
                group_result(request, raw, seconds)
                if answers is None
                else group_so_far(request, answers, self.sampling.max_tokens).result(request.key, seconds)
            )
        except asyncio.CancelledError:
            stalled = self._stalled.pop(id(request), None)
            if stalled is None:
                return  # cancelled: the connection is closed, the driver expects no answer
            result = RuntimeError(f"POST {self.base_url}/v1/completions: {stalled}")
        except RuntimeError as exc:
            result = exc
        except ssl.SSLCertVerificationError as exc:
            result = RuntimeError(untrusted(f"POST {self.base_url}/v1/completions", exc))
        except (OSError, asyncio.IncompleteReadError) as exc:  # refused, reset, closed mid-answer: the server went away
            result = EngineUnavailable(
                f"POST {self.base_url}/v1/completions: the vLLM server went away ({type(exc).__name__}: {exc})"
            )
        except Exception as exc:  # noqa: BLE001 - a malformed answer: the run must stop now
            result = RuntimeError(f"POST {self.base_url}/v1/completions failed: {type(exc).__name__}: {exc}")
        finally:
            self.progress.end(answered)
        done(request, result)

    async def _post(self, path: str, payload: dict[str, Any], answer: StreamedAnswer | None) -> tuple[int, bytes]:
        """One HTTP/1.1 POST on a connection of its own (closed after the answer, or when the task is cancelled); a
        streamed answer's body goes to `answer` as it arrives (then b"" is returned for it)."""
        reader, writer = await asyncio.open_connection(self._host, self._port, ssl=self._ssl)
        try:
            body = json.dumps(payload).encode()
            head = (
                f"POST {self._path}{path} HTTP/1.1\r\nHost: {self._host_header}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
            )
            writer.write(head.encode() + body)
            await writer.drain()
            status_line = await reader.readline()  # the answer begins (vLLM answers once the group is done)
            if answer is not None and status_line.split(b" ")[1:2] == [b"200"]:
                return await read_response(reader, status_line, self._streamed_into(answer))
            async with self._reading:
                return await read_response(reader, status_line)
        finally:
            writer.close()

    def _streamed_into(self, answer: StreamedAnswer) -> Callable[[bytes], None]:
        def feed(data: bytes) -> None:
            self._received += len(data)
            self.progress.progressed()  # a streamed byte is progress: the timeout bounds silence, not length
            answer.feed(data)

        return feed
