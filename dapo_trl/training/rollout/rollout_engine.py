"""Generation engines for streaming dynamic sampling: one request per group, seeded, cancellable, from a given
weights version.

A `GroupEngine` samples `group_size` completions of one prompt with a per-request seed, from the weights version the
driver loaded (`load_weights`), and calls back when they are done. The streaming driver (`rollout_driver`) admits
requests to it, cancels the ones it no longer needs, and loads a weights version only while nothing of ours runs.
The engines: `server_engine.VLLMServerEngine` (a `vllm serve` server over HTTP) and
`colocate_engine.VLLMColocateEngine` (the in-process engine of colocate mode); tests plug in a deterministic fake.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np


@dataclass(frozen=True)
class GroupRequest:
    """One prompt's group: where it sits in the prompt stream (`key`), its token ids, seed and weights version, and
    what a checkpoint kept of it (`partial`: continued, not regenerated)."""

    key: tuple
    prompt_ids: list[int]
    seed: int | None  # None: unseeded (a tool loop's later turns, as TRL samples them)
    version: int
    partial: PartialGroup | None = field(default=None, compare=False)


@dataclass
class PartialGroup:
    """A group's completions as far as they were sampled when a checkpoint was written: each completion's token ids,
    the engine's log-probs, the weights version of every token, and whether it had ended (EOS or its length); a
    finished group also keeps its routed experts when the engine returned them (routing replay)."""

    token_ids: list[np.ndarray]
    logprobs: list[np.ndarray]
    versions: list[np.ndarray]
    finished: list[bool]
    routed_experts: list[np.ndarray] | None = None

    @classmethod
    def of_result(cls, result: GroupResult) -> PartialGroup:
        """A finished group as a checkpoint keeps it (its flat arrays split by completion: no Python list per token)."""
        bounds = np.cumsum(result.lengths)[:-1]
        versions = [result.token_versions(i) for i in range(len(result.lengths))]
        ids, logprobs = np.split(result.token_ids, bounds), np.split(result.token_logprobs, bounds)
        return cls(ids, logprobs, versions, [True] * len(result.lengths), result.routed_experts)

    @property
    def oldest_version(self) -> int:
        return min((int(v.min()) for v in self.versions if len(v)), default=np.iinfo(np.int64).max)

    def result(self, key: tuple, seconds: float = 0.0) -> GroupResult:
        """The group as a result (when every completion has ended)."""
        return result_with_versions(key, self.token_ids, self.logprobs, self.versions, seconds, self.routed_experts)

    def state_dict(self) -> dict[str, Any]:
        """Tensors and lists only: a checkpoint is read back with `torch.load(weights_only=True)`."""
        import torch

        names = ("token_ids", "logprobs", "versions") + (("routed_experts",) if self.routed_experts is not None else ())
        return {
            name: [torch.from_numpy(np.ascontiguousarray(array)) for array in getattr(self, name)] for name in names
        } | {"finished": list(self.finished)}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> PartialGroup:
        names = ("token_ids", "logprobs", "versions", "routed_experts")
        arrays = {name: [tensor.numpy() for tensor in state[name]] for name in names if name in state}
        return cls(**arrays, finished=[bool(done) for done in state["finished"]])


def result_with_versions(
    key: tuple,
    token_ids: list[np.ndarray],
    logprobs: list[np.ndarray],
    versions: list[np.ndarray],
    seconds: float = 0.0,
    routed_experts: list[np.ndarray] | None = None,
) -> GroupResult:
    """A `GroupResult` of per-completion arrays with the weights version of every token: its `version` is the oldest
    token's, and `switches` say where a newer one took over in each completion (at its first token, for one that
    began after a switch)."""
    lengths = np.array([len(ids) for ids in token_ids], dtype=np.int64)
    flat_versions = np.concatenate(versions) if len(versions) else np.zeros(0, dtype=np.int64)
    oldest = int(flat_versions.min()) if len(flat_versions) else 0
    result = GroupResult.from_arrays(
        key,
        oldest,
        np.concatenate(token_ids) if token_ids else np.zeros(0, dtype=np.int32),
        np.concatenate(logprobs) if logprobs else np.zeros(0, dtype=np.float32),
        lengths,
        seconds,
        routed_experts,
    )
    switches = []
    for completion, per_token in enumerate(versions):
        firsts = np.flatnonzero(np.diff(per_token) != 0) + 1
        if len(per_token) and per_token[0] != oldest:
            firsts = np.concatenate([[0], firsts])
        switches.extend((completion, int(first), int(per_token[first])) for first in firsts)
    result.switches = np.array(switches, dtype=np.int64) if switches else None
    return result


class GroupResult:
    """The completions of one `GroupRequest`, with the sampled tokens' log-probs and the version that sampled them.

    Held as flat arrays (int32 token ids, float32 log-probs, one length per completion): at 16 x 20k tokens a group
    costs 8 bytes a token here, against ~70 as Python lists. `completion_ids` / `logprobs` give the lists TRL takes.
    A mixture-of-experts engine may add each completion's `routed_experts` (vLLM's array per sequence: prompt and
    completion tokens but the last, x decoder layers x top-k expert indices, in the engine's small integer type),
    which routing replay needs.

    `version` is the version that sampled its first tokens. With in-flight weight updates a newer version may take
    over inside a response: `switches` then lists each such point as (completion, first token, version).
    """

    __slots__ = ("key", "version", "token_ids", "token_logprobs", "lengths", "seconds", "routed_experts", "switches")

    def __init__(
        self,
        key: tuple,
        version: int,
        completion_ids: list[list[int]],
        logprobs: list[list[float]],
        seconds: float = 0.0,
        routed_experts: list[np.ndarray] | None = None,
    ):
        self.key, self.version, self.seconds = key, version, seconds
        self.routed_experts, self.switches = routed_experts, None
        if routed_experts is not None and len(routed_experts) != len(completion_ids):
            raise ValueError(f"group {key}: {len(routed_experts)} routings for {len(completion_ids)} completions")
        self.lengths = np.array([len(ids) for ids in completion_ids], dtype=np.int64)
        if [len(values) for values in logprobs] != self.lengths.tolist():
            raise ValueError(f"group {key}: {len(logprobs)} log-prob lists do not match its completions' lengths")
        self.token_ids = np.fromiter((t for ids in completion_ids for t in ids), dtype=np.int32, count=self.tokens)
        self.token_logprobs = np.fromiter((v for vs in logprobs for v in vs), dtype=np.float32, count=self.tokens)

    @classmethod
    def from_arrays(
        cls,
        key: tuple,
        version: int,
        token_ids: np.ndarray,
        token_logprobs: np.ndarray,
        lengths: np.ndarray,
        seconds: float = 0.0,
        routed_experts: list[np.ndarray] | None = None,
    ) -> GroupResult:
        """A result from flat arrays already (an engine that decodes into arrays: no per-token Python objects)."""
        result = cls.__new__(cls)
        result.key, result.version, result.seconds = key, version, seconds
        result.routed_experts, result.switches = routed_experts, None
        result.lengths = np.asarray(lengths, dtype=np.int64)
        result.token_ids = np.asarray(token_ids, dtype=np.int32)
        result.token_logprobs = np.asarray(token_logprobs, dtype=np.float32)
        if not len(result.token_ids) == len(result.token_logprobs) == result.tokens:
            raise ValueError(f"group {key}: {len(result.token_ids)} token ids for completions of {result.tokens}")
        return result

    @property
    def tokens(self) -> int:
        return int(self.lengths.sum())

    def without_tokens(self) -> GroupResult:
        """Its key, version and lengths only: what a process that trains none of its rows is sent of it."""
        result = GroupResult.__new__(GroupResult)
        result.key, result.version, result.seconds, result.lengths = self.key, self.version, self.seconds, self.lengths
        result.token_ids, result.token_logprobs = np.zeros(0, dtype=np.int32), np.zeros(0, dtype=np.float32)
        result.routed_experts, result.switches = None, None
        return result

    def rows(self, start: int, stop: int) -> tuple[list[list[int]], list[list[float]], list]:
        """Completions `start:stop` of the group as the lists TRL's scoring takes (token ids, log-probs, routings):
        only the rows a process trains are ever turned into Python objects."""
        offsets = np.concatenate([[0], np.cumsum(self.lengths)])
        ids = [self.token_ids[offsets[i] : offsets[i + 1]].tolist() for i in range(start, stop)]
        logprobs = [self.token_logprobs[offsets[i] : offsets[i + 1]].tolist() for i in range(start, stop)]
        routings = self.routed_experts[start:stop] if self.routed_experts is not None else [None] * (stop - start)
        return ids, logprobs, list(routings)

    def _split(self, flat: np.ndarray) -> list[list]:
        return [part.tolist() for part in np.split(flat, np.cumsum(self.lengths)[:-1])] if len(self.lengths) else []

    @property
    def completion_ids(self) -> list[list[int]]:
        return self._split(self.token_ids)

    @property
    def logprobs(self) -> list[list[float]]:
        return self._split(self.token_logprobs)

    def token_versions(self, completion: int) -> np.ndarray:
        """The weights version that sampled each token of completion `completion`."""
        versions = np.full(int(self.lengths[completion]), self.version, dtype=np.int64)
        for index, first, version in self.switches if self.switches is not None else ():
            if index == completion:
                versions[first:] = version
        return versions

    @property
    def nbytes(self) -> int:
        routed = sum(routing.nbytes for routing in self.routed_experts or ())
        switches = 0 if self.switches is None else self.switches.nbytes
        return self.token_ids.nbytes + self.token_logprobs.nbytes + self.lengths.nbytes + routed + switches


Callback = Callable[[GroupRequest, "GroupResult | BaseException"], None]


class EngineUnavailable(RuntimeError):
    """The engine cannot be reached (a server that died, or restarts): unlike a timeout or an error answer, it may
    come back, and the driver then waits for it (`vllm_server_recovery_timeout`)."""


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

    # Optional: `wait_available(timeout)` returns once an engine that raised EngineUnavailable answers again, or
    # raises EngineUnavailable after `timeout` seconds. Engines without it are never waited for.


@dataclass
class RequestSampling:
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
