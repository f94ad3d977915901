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

import contextlib
import http.client
import json
import logging
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GroupRequest:
    """One prompt's group: where it sits in the prompt stream (`key`), its token ids, seed and weights version."""

    key: tuple
    prompt_ids: list[int]
    seed: int
    version: int


@dataclass
class GroupResult:
    """The completions of one `GroupRequest`, with the sampled tokens' log-probs and the version that sampled them."""

    key: tuple
    version: int
    completion_ids: list[list[int]]
    logprobs: list[list[float]]
    seconds: float = 0.0

    @property
    def tokens(self) -> int:
        return sum(len(ids) for ids in self.completion_ids)


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


@dataclass
class _Call:
    """One started request: its connection (once open) and whether it was cancelled."""

    connection: http.client.HTTPConnection | None = None
    cancelled: bool = False


class VLLMServerEngine:
    """Group requests to a `vllm serve` server, each on its own connection (closed to cancel it).

    Weights: `load_weights(version)` asks the dev-mode server to reload `weights_root/v{version}` (as the server sees
    it), which the trainer wrote with `publish`, then resets the prefix cache (KV computed under the previous
    weights must not be reused). Every request and reload is bounded by `timeout`.
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
        self._pool = ThreadPoolExecutor(max_workers=max(1, max_in_flight), thread_name_prefix="dapo-rollout")
        self._calls: dict[int, _Call] = {}  # id(request) -> its connection and whether it was cancelled
        self._lock = threading.Lock()
        self.model = self._model_name()

    def _model_name(self) -> str:
        connection = http.client.HTTPConnection(self._host, self._port, timeout=self.timeout)
        try:
            connection.request("GET", "/v1/models")
            answer = connection.getresponse()
            body = answer.read()
            if answer.status != 200:
                raise RuntimeError(f"GET {self.base_url}/v1/models: HTTP {answer.status}: {body[:500]!r}")
            return json.loads(body)["data"][0]["id"]
        except (OSError, http.client.HTTPException) as exc:
            raise RuntimeError(f"GET {self.base_url}/v1/models: cannot reach the vLLM server ({exc})") from exc
        finally:
            connection.close()

    def start(self, request: GroupRequest, done: Callback) -> None:
        call = _Call()
        with self._lock:  # by request object: a cancelled group's key is requested again under the next weights
            self._calls[id(request)] = call
        self._pool.submit(self._run, request, done, call)

    def _run(self, request: GroupRequest, done: Callback, call: _Call) -> None:
        start = time.monotonic()
        connection = http.client.HTTPConnection(self._host, self._port, timeout=self.timeout)
        with self._lock:
            call.connection = connection
            cancelled = call.cancelled
        try:
            if cancelled:
                return
            body = json.dumps(self.request_payload(request))
            connection.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
            answer = connection.getresponse()
            raw = answer.read()
            if answer.status != 200:
                raise RuntimeError(f"POST {self.base_url}/v1/completions: HTTP {answer.status}: {raw[:2000]!r}")
            choices = json.loads(raw)["choices"]
            result: GroupResult | BaseException = GroupResult(
                key=request.key,
                version=request.version,
                completion_ids=[list(choice["token_ids"]) for choice in choices],
                logprobs=[_sampled_logprobs(choice) for choice in choices],
                seconds=time.monotonic() - start,
            )
        except TimeoutError as exc:
            result = RuntimeError(f"POST {self.base_url}/v1/completions: no answer within {self.timeout:g} s ({exc})")
        except (OSError, http.client.HTTPException, ValueError, KeyError, RuntimeError) as exc:
            result = exc if isinstance(exc, RuntimeError) else RuntimeError(
                f"POST {self.base_url}/v1/completions failed: {type(exc).__name__}: {exc}"
            )  # fmt: skip
        finally:
            with self._lock:
                self._calls.pop(id(request), None)
                cancelled = call.cancelled
            connection.close()
        if not cancelled:
            done(request, result)

    def request_payload(self, request: GroupRequest) -> dict[str, Any]:
        """The JSON body of one group's request (override to change sampling per group)."""
        return self.sampling.payload(self.model, request)

    def cancel(self, request: GroupRequest) -> None:
        with self._lock:
            call = self._calls.get(id(request))
            if call is None:
                return
            call.cancelled = True
            connection = call.connection
        if connection is not None and connection.sock is not None:
            try:  # the server sees the client go away and aborts the request (vLLM's with_cancellation)
                connection.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

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
        self._reload(self.base_url, f"{self.weights_server_root}/v{version}", self.timeout)

    def close(self) -> None:
        with self._lock:
            calls = list(self._calls.values())
            for call in calls:
                call.cancelled = True
        for call in calls:
            if call.connection is not None and call.connection.sock is not None:
                with contextlib.suppress(OSError):
                    call.connection.sock.shutdown(socket.SHUT_RDWR)
        self._pool.shutdown(wait=False, cancel_futures=True)


def _sampled_logprobs(choice: dict[str, Any]) -> list[float]:
    """The sampled tokens' log-probs of one OpenAI completion choice (`logprobs=0`)."""
    logprobs = choice.get("logprobs") or {}
    values = logprobs.get("token_logprobs")
    if values is None:
        raise ValueError("the vLLM server returned no token log-probs (needs logprobs=0 support)")
    return [float("-inf") if value is None else float(value) for value in values]
