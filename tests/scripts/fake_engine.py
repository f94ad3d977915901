"""A deterministic stand-in for a vLLM server in streaming-rollout tests.

A group's completions are a hash of (the request's seed, prompt token ids, weights version, index in the group), as a
seeded, batch-invariant engine would sample them: the same whatever the timing, so a streamed run and a
round-by-round one can be compared batch for batch, and a group sent with another seed gets other completions (a
broken per-group seed fails the tests). An unseeded request (a tool loop's later turns) hashes the prompt alone. Each
request finishes after a random delay (from `timing_seed`), so groups complete out of order and differently in every
run.
"""

from __future__ import annotations

import hashlib
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from dapo_trl.training.rollout.rollout_engine import GroupRequest, GroupResult

COMPLETION_TOKENS = range(10, 60)


def fake_completion(
    prompt_ids: list[int],
    seed: int | None,
    version: int,
    index: int,
    eos_id: int,
    max_tokens: int,
    tool_call_ids: list[int] | None = None,
):
    """(token ids, log-probs) of completion `index` of a prompt sampled with `seed` under weights `version`; with
    `tool_call_ids`, half of the completions are that tool call."""
    digest = hashlib.sha256(repr((seed, list(prompt_ids), version, index)).encode()).digest()
    if tool_call_ids is not None and digest[30] % 2 == 0:
        return list(tool_call_ids), [-0.1] * len(tool_call_ids)
    length = 2 + digest[0] % (max_tokens - 1)
    data = digest + b"".join(hashlib.sha256(digest + bytes([k])).digest() for k in range(max_tokens // 32 + 1))
    ids = [COMPLETION_TOKENS[data[1 + k] % len(COMPLETION_TOKENS)] for k in range(length)]
    if digest[31] % 3:  # two thirds end with EOS, the others are truncated
        ids[-1] = eos_id
    logprobs = [-0.05 - (data[1 + k] % 7) / 10 for k in range(length)]
    return ids, logprobs


def fake_routing(prompt_ids: list[int], completion_ids: list[int], seed, version: int, index: int, routing):
    """What a mixture-of-experts engine returns for a completion (vLLM's shape): for every token but the last,
    `routing.top_k` distinct experts per decoder layer, a hash of the same key as the completion's."""
    digest = hashlib.sha256(repr((seed, list(prompt_ids), version, index, "routing")).encode()).digest()
    rng = random.Random(digest)
    tokens = len(prompt_ids) + len(completion_ids) - 1
    experts = range(routing.num_experts)
    choices = [rng.sample(experts, routing.top_k) for _ in range(tokens * routing.layers)]
    return np.array(choices, dtype=np.uint8).reshape(tokens, routing.layers, routing.top_k)


class FakeEngine:
    """`GroupEngine` protocol; `loads` records every weights version loaded, `max_seen_in_flight` the concurrency."""

    def __init__(
        self,
        group_size: int,
        eos_id: int,
        max_tokens: int,
        timing_seed: int,
        max_delay: float = 0.03,
        tool_call_ids: list[int] | None = None,
        routing=None,
    ):
        self.group_size, self.eos_id, self.max_tokens = group_size, eos_id, max_tokens
        self.routing = routing  # a `moe.architecture.Routing`: answers carry routed experts, as vLLM's can
        self.tool_call_ids = tool_call_ids
        self.version: int | None = None
        self.loads: list[int] = []
        self.rng = random.Random(timing_seed)
        self.max_delay = max_delay
        self.pool = ThreadPoolExecutor(max_workers=16)
        self.lock = threading.Lock()
        self.in_flight = 0
        self.max_seen_in_flight = 0

    def start(self, request: GroupRequest, done) -> None:
        if request.version != self.version:
            raise AssertionError(f"group {request.key} of version {request.version} started on {self.version}")
        with self.lock:
            delay = self.rng.random() * self.max_delay
            self.in_flight += 1
            self.max_seen_in_flight = max(self.max_seen_in_flight, self.in_flight)
        self.pool.submit(self._run, request, done, delay)

    def _run(self, request: GroupRequest, done, delay: float) -> None:
        time.sleep(delay)
        pairs = [
            fake_completion(
                request.prompt_ids, request.seed, request.version, i, self.eos_id, self.max_tokens, self.tool_call_ids
            )
            for i in range(self.group_size)
        ]
        routings = None
        if self.routing is not None:
            key = (request.prompt_ids, request.seed, request.version)
            routings = [fake_routing(key[0], ids, *key[1:], i, self.routing) for i, (ids, _) in enumerate(pairs)]
        with self.lock:
            self.in_flight -= 1
        completions, logprobs = [ids for ids, _ in pairs], [lp for _, lp in pairs]
        done(request, GroupResult(request.key, request.version, completions, logprobs, routed_experts=routings))

    def cancel(self, request: GroupRequest) -> None:
        pass  # the driver ignores its answer

    def load_weights(self, version: int) -> None:
        self.version = version
        self.loads.append(version)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
