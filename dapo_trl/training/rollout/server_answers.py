"""A vLLM server's `/v1/completions` answer to one group as a `GroupResult`: whole (`group_result`), or read as
server-sent events while it is generated (`StreamedAnswer`), so that a weights version loaded in the middle of it
(in-flight weight updates) tags every token with the version that sampled it.

Streamed, vLLM sends one event per choice and step (`"stream": true`; more tokens in one event when the reader
lags). The engine marks a switch with `fence(version)` while the server is paused (`/pause?mode=keep`): every byte
received until then was sampled by the old version, everything after by the new one. The bytes are parsed in batches
into flat arrays (no Python object per token is kept), with the two number lists per event cut out of the bytes as
the non-streamed answer's are (`group_result`).
"""

from __future__ import annotations

import base64
import io
import json
import re
from typing import Any

import numpy as np

from .rollout_engine import GroupRequest, GroupResult, PartialGroup, result_with_versions

PARSE_AT_BYTES = 1 << 20  # parse the received events once this many bytes wait (bounds what a running group holds)
_EVENT_END = b"\n\n"
_INDEX = re.compile(rb'"index"\s*:\s*(\d+)')
_IDS = re.compile(rb'"token_ids"\s*:\s*\[([^\]]*)\]')
_LOGPROBS = re.compile(rb'"token_logprobs"\s*:\s*\[([^\]]*)\]')
_FINISHED = re.compile(rb'"finish_reason"\s*:\s*"')
_ERROR = re.compile(rb'^data:\s*\{\s*"(?:error"|object"\s*:\s*"error")', re.M)


class StreamedAnswer:
    """The events of one streamed group answer (`n` choices), parsed as they arrive, each token tagged with the
    weights version that was loaded when the server sent it."""

    def __init__(self, n: int, version: int):
        self.n = n
        self.version = version  # of the events received from now on
        self._pending = bytearray()  # received, not yet parsed (ends inside an event)
        self._head_version: int | None = None  # of the partial event at the front of `_pending`, if a fence cut it
        self._parts: list[tuple[np.ndarray, np.ndarray, np.ndarray, int]] = []  # (choice, ids, logprobs, version)
        self.done = False  # `data: [DONE]` arrived
        self.finished = [False] * n  # a choice's last event (its finish_reason) arrived

    def feed(self, data: bytes) -> None:
        self._pending += data
        if len(self._pending) >= PARSE_AT_BYTES:
            self._parse()

    def fence(self, version: int) -> None:
        """The server is paused and what it sent before the pause has arrived: from here on, `version` samples."""
        self._parse()
        if self._pending.strip():  # an event cut in two: its start arrived before the pause, so it is the old one's
            self._head_version = self.version
        self.version = version

    def _parse(self) -> None:
        end = self._pending.rfind(_EVENT_END)
        if end < 0:
            return
        blob, self._pending = bytes(self._pending[: end + len(_EVENT_END)]), self._pending[end + len(_EVENT_END) :]
        if self._head_version is not None:  # the cut event is blob's first one: it goes with the old version
            first = blob.find(_EVENT_END) + len(_EVENT_END)
            self._parse_events(blob[:first], self._head_version)
            blob, self._head_version = blob[first:], None
        self._parse_events(blob, self.version)

    def _parse_events(self, blob: bytes, version: int) -> None:
        if b"data: [DONE]" in blob:
            self.done = True
            blob = blob.replace(b"data: [DONE]", b"")
        if error := _ERROR.search(blob):  # an event that is an error (a token's text may be the word, escaped)
            raise RuntimeError(f"the vLLM server reported an error mid-answer: {blob[error.start() :][:2000]!r}")
        if _FINISHED.search(blob):  # once per choice: its last event, read whole
            for line in blob.split(b"\n"):
                if _FINISHED.search(line) and line.startswith(b"data:"):
                    for choice in json.loads(line[5:]).get("choices") or ():
                        self.finished[choice["index"]] |= choice.get("finish_reason") is not None
        parsed = _fast_events(blob)
        if parsed is None:
            parsed = _json_events(blob)
        choices, ids, logprobs = parsed
        if len(ids):
            self._parts.append((choices, ids, logprobs, version))

    def result(self, key: tuple, seconds: float) -> GroupResult:
        """The whole answer as a `GroupResult`, each token with the version that sampled it (`result_with_versions`)."""
        self._parse()
        if self._pending.strip():
            self._parse_events(bytes(self._pending), self.version)  # a last event without its blank line
            self._pending = bytearray()
        return result_with_versions(key, *self._per_choice(), seconds)

    def partial(self) -> PartialGroup:
        """What arrived so far, by completion (the events complete by now), for a checkpoint to continue it from."""
        self._parse()
        return PartialGroup(*self._per_choice(), finished=list(self.finished))

    def _per_choice(self) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]]:
        """Each choice's token ids, log-probs and versions, in the order they came."""
        if not self._parts:
            empty = [np.zeros(0, dtype=dtype) for dtype in (np.int32, np.float32, np.int64)]
            return tuple([array.copy() for _ in range(self.n)] for array in empty)
        choices = np.concatenate([part[0] for part in self._parts])
        if choices.max() >= self.n:
            raise ValueError(f"an event names choice {choices.max()} of {self.n}")
        order = np.argsort(choices, kind="stable")  # each choice's tokens in the order they came
        versions = np.concatenate([np.full(len(part[1]), part[3], dtype=np.int64) for part in self._parts])[order]
        ids = np.concatenate([part[1] for part in self._parts])[order]
        logprobs = np.concatenate([part[2] for part in self._parts])[order]
        bounds = np.cumsum(np.bincount(choices, minlength=self.n))[:-1]
        return np.split(ids, bounds), np.split(logprobs, bounds), np.split(versions, bounds)


def _fast_events(blob: bytes) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """(choice per token, token ids, log-probs) of the events in `blob`, cut out of the bytes; None when the events
    are not laid out as vLLM's (then `_json_events` reads them)."""
    indices, id_lists, logprob_lists = _INDEX.findall(blob), _IDS.findall(blob), _LOGPROBS.findall(blob)
    if not len(indices) == len(id_lists) == len(logprob_lists):
        return None
    counts = np.array([text.count(b",") + 1 if text.strip() else 0 for text in id_lists], dtype=np.int64)
    joined_ids = b",".join(t for t in id_lists if t.strip())
    joined_logprobs = b",".join(t for t in logprob_lists if t.strip())
    ids = np.fromstring(joined_ids, dtype=np.int64, sep=",") if joined_ids else np.zeros(0, dtype=np.int64)
    text = joined_logprobs.replace(b"null", b"nan").replace(b"Infinity", b"inf")
    logprobs = np.fromstring(text, dtype=np.float64, sep=",") if text else np.zeros(0)
    if len(ids) != counts.sum() or len(logprobs) != len(ids):
        return None
    choices = np.repeat(np.array([int(i) for i in indices], dtype=np.int64), counts)
    logprobs[np.isnan(logprobs)] = -np.inf
    return choices, ids.astype(np.int32), logprobs.astype(np.float32)


def _json_events(blob: bytes) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`_fast_events` through `json` (a malformed event then says what is wrong)."""
    choices, ids, logprobs = [], [], []
    for line in blob.split(b"\n"):
        if not line.startswith(b"data:"):
            continue
        for choice in json.loads(line[5:]).get("choices") or ():
            tokens = choice.get("token_ids") or []
            values = (choice.get("logprobs") or {}).get("token_logprobs")
            if not tokens:  # an event that only finishes the choice
                continue
            if values is None or len(values) != len(tokens):
                raise ValueError("the vLLM server streamed tokens without their log-probs (needs logprobs=0)")
            choices += [choice["index"]] * len(tokens)
            ids += tokens
            logprobs += [-np.inf if value is None else value for value in values]
    return np.array(choices, dtype=np.int64), np.array(ids, dtype=np.int32), np.array(logprobs, dtype=np.float32)


_TOKEN_IDS = re.compile(rb'"token_ids"\s*:\s*\[')
_TOKEN_LOGPROBS = re.compile(rb'"token_logprobs"\s*:\s*\[')
_ROUTED_EXPERTS = re.compile(rb'"routed_experts"\s*:\s*(null|"[^"]*")')


def continued_completions(request: GroupRequest, max_tokens: int) -> list[int]:
    """The completions of a resumed group (`request.partial`) that had not ended: each is continued by a request of
    its own."""
    partial = request.partial
    return [i for i, done in enumerate(partial.finished) if not done and len(partial.token_ids[i]) < max_tokens]


def group_so_far(request: GroupRequest, answers: list[StreamedAnswer], max_tokens: int) -> PartialGroup:
    """A group's completions so far: its streamed answer's, or a resumed group's kept tokens followed by their
    continuations' (`answers`, one per `continued_completions`)."""
    if request.partial is None:
        return answers[0].partial()
    prior = request.partial
    ids, logprobs, versions = list(prior.token_ids), list(prior.logprobs), list(prior.versions)
    finished = [done or len(ids[i]) >= max_tokens for i, done in enumerate(prior.finished)]
    for index, answer in zip(continued_completions(request, max_tokens), answers, strict=True):
        more = answer.partial()
        ids[index] = np.concatenate([ids[index], more.token_ids[0]])
        logprobs[index] = np.concatenate([logprobs[index], more.logprobs[0]])
        versions[index] = np.concatenate([versions[index], more.versions[0]])
        finished[index] = more.finished[0]
    return PartialGroup(ids, logprobs, versions, finished)


def group_result(request: GroupRequest, raw: bytes, seconds: float) -> GroupResult:
    """A group's answer as flat arrays. The main process reads every generated token of a step here (~25M at the
    paper's 512 x 16 x ~3k), and vLLM's JSON spends ~100 bytes a token on text, token strings, offsets and top
    log-probs nobody reads: the two number lists that matter are cut out of the bytes and parsed by numpy, with no
    Python object per token (`_number_lists`); an answer laid out otherwise is read with `json` instead."""
    fast = _number_lists(raw, _TOKEN_IDS, np.int64), _number_lists(raw, _TOKEN_LOGPROBS, np.float64)
    if fast[0] is None or fast[1] is None or [len(ids) for ids in fast[0]] != [len(lp) for lp in fast[1]]:
        return group_result_from_json(request, raw, seconds)
    (ids, logprobs), routings = fast, _ROUTED_EXPERTS.findall(raw)
    if len(routings) not in (0, len(ids)):
        return group_result_from_json(request, raw, seconds)
    routed = _routed_experts([{"routed_experts": json.loads(value)} for value in routings]) if routings else None
    lengths = np.array([len(part) for part in ids], dtype=np.int64)
    token_ids = np.concatenate(ids).astype(np.int32) if ids else np.zeros(0, dtype=np.int32)
    token_logprobs = np.concatenate(logprobs) if logprobs else np.zeros(0)
    token_logprobs[np.isnan(token_logprobs)] = -np.inf  # a missing log-prob (null)
    return GroupResult.from_arrays(
        request.key, request.version, token_ids, token_logprobs.astype(np.float32), lengths, seconds, routed
    )


def _number_lists(raw: bytes, key: re.Pattern, dtype: Any) -> list[np.ndarray] | None:
    """Every JSON number list that follows `key` in `raw`, parsed in C (None if one is not a plain number list)."""
    lists = []
    for match in key.finditer(raw):
        end = raw.find(b"]", match.end())
        if end < 0:
            return None
        text = raw[match.end() : end].replace(b"null", b"nan").replace(b"Infinity", b"inf")
        if not text.strip():
            lists.append(np.zeros(0, dtype=dtype))
            continue
        values = np.fromstring(text, dtype=dtype, sep=",")  # malformed text stops short: counted below
        if len(values) != text.count(b",") + 1:
            return None
        lists.append(values)
    return lists


def group_result_from_json(request: GroupRequest, raw: bytes, seconds: float) -> GroupResult:
    """`_group_result` through `json` (an answer not laid out as vLLM's, or malformed: then the error says why)."""
    choices = json.loads(raw)["choices"]
    lengths = np.array([len(choice["token_ids"]) for choice in choices], dtype=np.int64)
    token_ids = np.concatenate([np.asarray(choice["token_ids"], dtype=np.int32) for choice in choices] or [[]])
    logprobs = np.concatenate([_sampled_logprobs(choice) for choice in choices] or [[]]).astype(np.float32)
    if len(logprobs) != len(token_ids):
        raise ValueError(f"{len(logprobs)} log-probs for {len(token_ids)} tokens")
    routed = _routed_experts(choices)
    return GroupResult.from_arrays(request.key, request.version, token_ids, logprobs, lengths, seconds, routed)


def _sampled_logprobs(choice: dict[str, Any]) -> np.ndarray:
    """The sampled tokens' log-probs of one OpenAI completion choice (`logprobs=0`); a missing one (None) is -inf."""
    logprobs = choice.get("logprobs") or {}
    values = logprobs.get("token_logprobs")
    if values is None:
        raise ValueError("the vLLM server returned no token log-probs (needs logprobs=0 support)")
    array = np.array(values, dtype=np.float64)  # None -> nan, in C
    array[np.isnan(array)] = -np.inf
    return array


def _routed_experts(choices: list[dict[str, Any]]) -> list[np.ndarray] | None:
    """Each choice's routed experts, when the server returns them (`vllm serve --enable-return-routed-experts`):
    base64 of a .npy array (tokens of prompt and completion but the last, decoder layers, top-k); else None."""
    encoded = [choice.get("routed_experts") for choice in choices]
    if any(value is None for value in encoded):
        return None
    return [np.load(io.BytesIO(base64.b64decode(value)), allow_pickle=False) for value in encoded]
