"""Generation engines for streaming dynamic sampling: one request per group, seeded, cancellable, from a given
weights version.

A `GroupEngine` samples `group_size` completions of one prompt with a per-request seed, from the weights version the
driver loaded (`load_weights`), and calls back when they are done. The streaming driver (`rollout_stream`) admits
requests to it, cancels the ones it no longer needs, and loads a weights version only while nothing is in flight.
`VLLMServerEngine` talks to a `vllm serve` server (OpenAI `/v1/completions` with prompt token ids, `n`, `seed`,
`max_tokens`, sampled-token log-probs): one HTTP connection per request, so a cancelled request is a closed
connection, which vLLM answers by aborting the request. Tests plug in a deterministic fake with the same protocol.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import logging
import math
import threading
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GroupRequest:
    """One prompt's group: where it sits in the prompt stream (`key`), its token ids, seed and weights version."""

    key: tuple
    prompt_ids: list[int]
    seed: int | None  # None: unseeded (a tool loop's later turns, as TRL samples them)
    version: int


class GroupResult:
    """The completions of one `GroupRequest`, with the sampled tokens' log-probs and the version that sampled them.

    Held as flat arrays (int32 token ids, float32 log-probs, one length per completion): at 16 x 20k tokens a group
    costs 8 bytes a token here, against ~70 as Python lists. `completion_ids` / `logprobs` give the lists TRL takes.
    """

    __slots__ = ("key", "version", "token_ids", "token_logprobs", "lengths", "seconds")

    def __init__(self, key: tuple, version: int, completion_ids: list[list[int]], logprobs: list[list[float]],
                 seconds: float = 0.0):  # fmt: skip
        self.key, self.version, self.seconds = key, version, seconds
        self.lengths = np.array([len(ids) for ids in completion_ids], dtype=np.int64)
        if [len(values) for values in logprobs] != self.lengths.tolist():
            raise ValueError(f"group {key}: {len(logprobs)} log-prob lists do not match its completions' lengths")
        self.token_ids = np.fromiter((t for ids in completion_ids for t in ids), dtype=np.int32, count=self.tokens)
        self.token_logprobs = np.fromiter((v for vs in logprobs for v in vs), dtype=np.float32, count=self.tokens)

    @property
    def tokens(self) -> int:
        return int(self.lengths.sum())

    def _split(self, flat: np.ndarray) -> list[list]:
        return [part.tolist() for part in np.split(flat, np.cumsum(self.lengths)[:-1])] if len(self.lengths) else []

    @property
    def completion_ids(self) -> list[list[int]]:
        return self._split(self.token_ids)

    @property
    def logprobs(self) -> list[list[float]]:
        return self._split(self.token_logprobs)

    @property
    def nbytes(self) -> int:
        return self.token_ids.nbytes + self.token_logprobs.nbytes + self.lengths.nbytes


Callback = Callable[[GroupRequest, "GroupResult | BaseException"], None]


class GroupEngine(Protocol):
    """What the streaming driver needs from a generation engine."""

    def start(self, request: GroupRequest, done: Callback) -> None:
        """Begin sampling `request` (returns at once); `done(request, result or exception)` is called once."""

    def cancel(self, request: GroupRequest) -> None:
        """Stop sampling `request` if it still runs; its `done` may still be called, and is then ignored."""

    def load_weights(self, version: int) -> None:
        """Sample from weights `version` from now on (called only while nothing is in flight; blocks)."""

    def close(self) -> None:
        """Cancel everything and release threads."""


@dataclass
class SamplingSettings:
    """The sampling parameters TRL's server mode sends, per group (`n` completions of one prompt)."""

    n: int
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    extra: dict[str, Any] = field(default_factory=dict)  # TRL's generation_kwargs, passed as they are

    def payload(self, model: str, request: GroupRequest) -> dict[str, Any]:
        return {
            "model": model,
            "prompt": [request.prompt_ids],
            "n": self.n,
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
            "logprobs": 0,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
            **self.extra,
            "seed": request.seed,
        }


class VLLMServerEngine:
    """Group requests to a `vllm serve` server, all on one event loop (one thread, however many groups run), each
    request on its own connection, at most `max_in_flight` open at once; cancelling a request closes its connection,
    which vLLM answers by aborting it (its `with_cancellation`), and a request cancelled before it connected is never
    sent.

    Weights: `load_weights(version)` waits until the server runs no request (it asks `/metrics`: an aborted request
    may still hold KV blocks for a moment), then asks the dev-mode server to reload `weights_root/v{version}` (as the
    server sees it), which the trainer wrote with `publish`, and resets the prefix cache (KV computed under the
    previous weights must not be reused). Every request and reload is bounded by `timeout`.
    """

    def __init__(
        self,
        base_url: str,
        sampling: SamplingSettings,
        max_in_flight: int,
        timeout: float,
        weights_server_root: str | Path | None = None,
        reload: Callable[[str, str, float], None] | None = None,
        weights_local_root: str | Path | None = None,
    ):
        self.base_url = base_url.rstrip("/")
        parsed = urllib.parse.urlparse(self.base_url)
        self._host, self._port = parsed.hostname or "localhost", parsed.port or 80
        self.sampling = sampling
        self.timeout = timeout
        self.weights_server_root = None if weights_server_root is None else str(weights_server_root)
        self._reload = reload
        self.weights_local_root = None if weights_local_root is None else Path(weights_local_root)
        self.model = self._model_name()
        self._max_in_flight = max(1, max_in_flight)
        self._tasks: dict[int, asyncio.Task] = {}  # id(request) -> its task (a cancelled key is requested again)
        self._closed = False
        self._loop = asyncio.new_event_loop()
        self._connections = asyncio.Semaphore(self._max_in_flight)
        self._thread = threading.Thread(target=self._loop.run_forever, name="dapo-rollout-http", daemon=True)
        self._thread.start()

    def _model_name(self) -> str:
        status, body = self._get("/v1/models")
        if status != 200:
            raise RuntimeError(f"GET {self.base_url}/v1/models: HTTP {status}: {body[:500]!r}")
        return json.loads(body)["data"][0]["id"]

    def _get(self, path: str) -> tuple[int, bytes]:
        connection = http.client.HTTPConnection(self._host, self._port, timeout=self.timeout)
        try:
            connection.request("GET", path)
            answer = connection.getresponse()
            return answer.status, answer.read()
        except (OSError, http.client.HTTPException) as exc:
            raise RuntimeError(f"GET {self.base_url}{path}: cannot reach the vLLM server ({exc})") from exc
        finally:
            connection.close()

    # ---------------------------------------------------------------------------------------------- caller side
    def start(self, request: GroupRequest, done: Callback) -> None:
        if self._closed:
            raise RuntimeError(f"the rollout engine for {self.base_url} is closed")
        self._loop.call_soon_threadsafe(self._launch, request, done)

    def cancel(self, request: GroupRequest) -> None:
        """Cancel `request` (started earlier from any thread: the loop runs calls in the order they were made)."""
        if not self._closed:
            self._loop.call_soon_threadsafe(self._cancel, id(request))

    def running(self) -> int:
        """Requests of ours still open (cancelled ones included until their connection is closed)."""
        return len(self._tasks)

    def request_payload(self, request: GroupRequest) -> dict[str, Any]:
        """The JSON body of one group's request (override to change sampling per group)."""
        return self.sampling.payload(self.model, request)

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
        self.wait_server_idle()
        self._reload(self.base_url, f"{self.weights_server_root}/v{version}", self.timeout)

    def wait_server_idle(self, poll: float = 0.05) -> None:
        """Return once none of our connections is open and the server reports no running or waiting request: a
        request still running under the old weights would hold KV blocks (the prefix-cache reset is refused) and
        finish with tokens of two versions."""
        deadline = time.monotonic() + self.timeout
        while True:
            ours = self.running()
            theirs = self.server_requests() if ours == 0 else None
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
        if status != 200:
            return None
        total, seen = 0.0, False
        for line in body.decode(errors="replace").splitlines():
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
                total += float(line.rsplit(" ", 1)[1])
                seen = True
        return int(total) if seen else None

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True

        async def stop() -> None:
            for task in list(self._tasks.values()):
                task.cancel()
            await asyncio.gather(*self._tasks.values(), return_exceptions=True)
            self._loop.stop()

        self._loop.call_soon_threadsafe(lambda: self._loop.create_task(stop()))
        self._thread.join(timeout=10)

    # ------------------------------------------------------------------------------------------- the event loop
    def _launch(self, request: GroupRequest, done: Callback) -> None:
        task = self._loop.create_task(self._run(request, done))
        self._tasks[id(request)] = task
        task.add_done_callback(lambda _: self._tasks.pop(id(request), None))

    def _cancel(self, request_id: int) -> None:
        task = self._tasks.get(request_id)
        if task is not None:
            task.cancel()

    async def _run(self, request: GroupRequest, done: Callback) -> None:
        started = time.monotonic()
        try:
            async with self._connections:
                post = self._post("/v1/completions", self.request_payload(request))
                status, raw = await asyncio.wait_for(post, self.timeout)
            if status != 200:
                raise RuntimeError(f"POST {self.base_url}/v1/completions: HTTP {status}: {raw[:2000]!r}")
            choices = json.loads(raw)["choices"]
            result: GroupResult | BaseException = GroupResult(
                request.key, request.version, [list(choice["token_ids"]) for choice in choices],
                [_sampled_logprobs(choice) for choice in choices], seconds=time.monotonic() - started,
            )  # fmt: skip
        except asyncio.CancelledError:
            return  # cancelled: the connection is closed, the driver expects no answer
        except asyncio.TimeoutError:  # TimeoutError's alias from Python 3.11
            result = RuntimeError(f"POST {self.base_url}/v1/completions: no answer within {self.timeout:g} s")
        except RuntimeError as exc:
            result = exc
        except (OSError, ValueError, KeyError, TypeError) as exc:
            result = RuntimeError(f"POST {self.base_url}/v1/completions failed: {type(exc).__name__}: {exc}")
        done(request, result)

    async def _post(self, path: str, payload: dict[str, Any]) -> tuple[int, bytes]:
        """One HTTP/1.1 POST on a connection of its own (closed after the answer, or when the task is cancelled)."""
        reader, writer = await asyncio.open_connection(self._host, self._port)
        try:
            body = json.dumps(payload).encode()
            head = (
                f"POST {path} HTTP/1.1\r\nHost: {self._host}:{self._port}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
            )
            writer.write(head.encode() + body)
            await writer.drain()
            return await _read_response(reader)
        finally:
            writer.close()


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    """(status, body) of an HTTP/1.1 response: Content-Length, chunked, or read to the end."""
    status_line = await reader.readline()
    parts = status_line.split(b" ", 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/"):
        raise ValueError(f"not an HTTP response: {status_line[:200]!r}")
    headers: dict[str, str] = {}
    while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    if "content-length" in headers:
        return int(parts[1]), await reader.readexactly(int(headers["content-length"]))
    if headers.get("transfer-encoding", "").lower() == "chunked":
        chunks = []
        while size := int((await reader.readline()).split(b";")[0].strip() or b"0", 16):
            chunks.append(await reader.readexactly(size))
            await reader.readline()
        return int(parts[1]), b"".join(chunks)
    return int(parts[1]), await reader.read()


def _sampled_logprobs(choice: dict[str, Any]) -> list[float]:
    """The sampled tokens' log-probs of one OpenAI completion choice (`logprobs=0`)."""
    logprobs = choice.get("logprobs") or {}
    values = logprobs.get("token_logprobs")
    if values is None:
        raise ValueError("the vLLM server returned no token log-probs (needs logprobs=0 support)")
    return [float("-inf") if value is None else float(value) for value in values]


class VLLMColocateEngine:
    """Group requests to the in-process vLLM engine of colocate mode (`LLM.llm_engine`), one engine request per group
    (`n` completions, the group's seed), stepped by a thread of its own while any runs.

    vLLM's engine is not thread-safe, so every call to it happens on that thread; `wait_idle` returns once nothing
    runs there, after which the trainer may use the engine itself (TRL's weight sync, TRL's own generation). Weights
    are loaded by the trainer that way (synchronous streaming), never through `load_weights`.
    """

    def __init__(self, llm: Any, sampling: SamplingSettings, timeout: float):
        self._engine = llm.llm_engine
        self._params, self._final_only = vllm_sampling_params()  # FINAL_ONLY: one output per group, all n in it
        self.sampling = sampling
        self.timeout = timeout
        self._pending: list[tuple[str, GroupRequest, Any]] = []  # ("start", request, (done, n)) | ("abort", ...)
        self._running: dict[str, tuple[GroupRequest, Callback, float]] = {}  # engine request id -> request, done
        self._next_id = 0
        self._stepping = False
        self._closed = False
        self._cond = threading.Condition()
        # CUDA's current device is per thread: the stepping thread must run the engine on this process's GPU.
        self._cuda_device = torch.cuda.current_device() if torch.cuda.is_available() else None
        self._thread = threading.Thread(target=self._step_loop, name="dapo-colocate-engine", daemon=True)
        self._thread.start()

    def sampling_params(self, request: GroupRequest, n: int | None = None) -> Any:
        """vLLM's SamplingParams of one group (the settings TRL's colocate mode uses, `n` and the group's seed)."""
        s = self.sampling
        params = self._params(
            n=s.n if n is None else n, max_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p,
            top_k=s.top_k, min_p=s.min_p, repetition_penalty=s.repetition_penalty, logprobs=0, **s.extra,
            seed=request.seed,
        )  # fmt: skip
        params.output_kind = self._final_only
        return params

    def start(self, request: GroupRequest, done: Callback, n: int | None = None) -> None:
        with self._cond:
            self._pending.append(("start", request, (done, n)))
            self._cond.notify_all()

    def generate_turns(self, prompt_ids: list[list[int]]) -> tuple[list[list[int]], list[list[float]]]:
        """One completion per prompt, unseeded (a tool loop's next turns, as TRL's colocate generation samples them),
        run by the stepping thread beside the streamed groups; blocks until all are done."""
        if not prompt_ids:
            return [], []
        results: dict[int, GroupResult | BaseException] = {}
        all_done = threading.Event()

        def done(request: GroupRequest, result: GroupResult | BaseException) -> None:
            with self._cond:
                results[request.key[1]] = result
                if len(results) == len(prompt_ids):
                    all_done.set()

        requests = [GroupRequest(("turn", i), list(ids), None, -1) for i, ids in enumerate(prompt_ids)]
        for request in requests:
            self.start(request, done, n=1)
        if not all_done.wait(self.timeout):
            for request in requests:
                self.cancel(request)
            raise TimeoutError(f"the colocated vLLM engine did not finish a tool loop's turn within {self.timeout:g} s")
        answers = [results[i] for i in range(len(prompt_ids))]
        errors = [answer for answer in answers if isinstance(answer, BaseException)]
        if errors:
            raise errors[0]
        return [answer.completion_ids[0] for answer in answers], [answer.logprobs[0] for answer in answers]

    def cancel(self, request: GroupRequest) -> None:
        with self._cond:
            self._pending.append(("abort", request, None))
            self._cond.notify_all()

    def load_weights(self, version: int) -> None:
        raise RuntimeError(
            "the colocated engine's weights are synced by the trainer (rollout_max_staleness 0), not loaded by version"
        )

    def wait_idle(self) -> None:
        """Block until no request runs and the stepping thread is parked (cancel everything first)."""
        deadline = time.monotonic() + self.timeout
        with self._cond:
            while self._pending or self._running or self._stepping:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"the colocated vLLM engine did not drain within {self.timeout:g} s")
                self._cond.wait(min(remaining, 1.0))

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=self.timeout)

    # ---------------------------------------------------------------------------------------------- the thread
    def _step_loop(self) -> None:
        if self._cuda_device is not None:
            torch.cuda.set_device(self._cuda_device)
        while True:
            with self._cond:
                while not (self._closed or self._pending or self._running):
                    self._cond.wait()
                if self._closed:
                    aborted = list(self._running)
                    self._running.clear()
                    if aborted:
                        self._engine.abort_request(aborted)
                    self._cond.notify_all()
                    return
                operations, self._pending = self._pending, []
                self._stepping = True
            try:
                self._apply(operations)
                if self._engine.has_unfinished_requests():
                    finished = self._finished(self._engine.step())
                elif self._running:
                    raise RuntimeError(f"{len(self._running)} requests vanished from the engine")
                else:
                    finished = []
            except Exception as exc:  # noqa: BLE001 - every running group fails with it; the driver raises it
                with self._cond:
                    failed, self._running = list(self._running.values()), {}
                    self._stepping = False
                    self._cond.notify_all()
                for request, done, _ in failed:
                    done(request, RuntimeError(f"the colocated vLLM engine failed: {type(exc).__name__}: {exc}"))
                continue
            with self._cond:
                self._stepping = False
                self._cond.notify_all()
            for request, done, result in finished:
                done(request, result)

    def _apply(self, operations: list[tuple[str, GroupRequest, Any]]) -> None:
        """Add started groups to the engine and abort cancelled ones (on the stepping thread)."""
        aborted = []
        for operation, request, started in operations:
            with self._cond:
                if operation == "abort":
                    ids = [rid for rid, (running, _, _) in self._running.items() if running is request]
                    for rid in ids:
                        del self._running[rid]
                    aborted += ids
                    continue
                (done, n), rid = started, f"dapo-group-{self._next_id}"
                self._next_id += 1
                self._running[rid] = (request, done, time.monotonic())
            params = self.sampling_params(request, n)
            self._engine.add_request(rid, {"prompt_token_ids": list(request.prompt_ids)}, params)
        if aborted:
            self._engine.abort_request(aborted)

    def _finished(self, outputs: list[Any]) -> list[tuple[GroupRequest, Callback, GroupResult]]:
        finished = []
        with self._cond:
            for output in outputs:
                if not output.finished or output.request_id not in self._running:
                    continue  # still running, or aborted meanwhile
                request, done, started = self._running.pop(output.request_id)
                completions = sorted(output.outputs, key=lambda completion: completion.index)
                result = GroupResult(
                    key=request.key, version=request.version,
                    completion_ids=[list(completion.token_ids) for completion in completions],
                    logprobs=[_sampled_token_logprobs(completion) for completion in completions],
                    seconds=time.monotonic() - started,
                )  # fmt: skip
                finished.append((request, done, result))
        return finished


def vllm_sampling_params() -> tuple[type, Any]:
    """vLLM's SamplingParams class and its FINAL_ONLY output kind (what `LLM.generate` asks for)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams, RequestOutputKind.FINAL_ONLY


def _sampled_token_logprobs(completion: Any) -> list[float]:
    """The sampled tokens' log-probs of one vLLM CompletionOutput (`logprobs=0`: each position holds the sampled
    token, and with processed log-probs possibly others)."""
    if completion.logprobs is None:
        raise ValueError("the colocated vLLM engine returned no log-probs (SamplingParams logprobs=0)")
    values = []
    for token_id, position in zip(completion.token_ids, completion.logprobs, strict=True):
        logprob = position[token_id].logprob
        values.append(float("-inf") if logprob is None or math.isnan(logprob) else float(logprob))
    return values
