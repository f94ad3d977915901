"""The streaming rollout's engine for colocate mode: the trainer process's own vLLM engine (`LLM.llm_engine`), one
engine request per group, stepped by a thread of its own (vLLM's engine is not thread-safe).
"""

from __future__ import annotations

import math
import threading
import time
from typing import Any

import torch

from .rollout_engine import Callback, GroupRequest, GroupResult, RequestSampling


class VLLMColocateEngine:
    """Group requests to the in-process vLLM engine of colocate mode (`LLM.llm_engine`), one engine request per group
    (`n` completions, the group's seed), stepped by a thread of its own while any runs.

    vLLM's engine is not thread-safe, so every call to it happens on that thread; `wait_idle` returns once nothing
    runs there, after which the trainer may use the engine itself (TRL's weight sync, TRL's own generation). Weights
    are loaded by the trainer that way (synchronous streaming), never through `load_weights`.
    """

    def __init__(self, llm: Any, sampling: RequestSampling, timeout: float):
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
            n=s.n if n is None else n,
            max_tokens=s.max_tokens,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,
            min_p=s.min_p,
            repetition_penalty=s.repetition_penalty,
            logprobs=0,
            **s.extra,
            seed=request.seed,
        )
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

    def _finished(self, outputs: list[Any]) -> list[tuple[GroupRequest, Callback, GroupResult | BaseException]]:
        """The finished groups' results; one that cannot be read (no log-probs) answers with its error, so that no
        group is left without an answer."""
        finished = []
        with self._cond:
            for output in outputs:
                if not output.finished or output.request_id not in self._running:
                    continue  # still running, or aborted meanwhile
                request, done, started = self._running.pop(output.request_id)
                try:
                    completions = sorted(output.outputs, key=lambda completion: completion.index)
                    result: GroupResult | BaseException = GroupResult(
                        key=request.key,
                        version=request.version,
                        completion_ids=[list(completion.token_ids) for completion in completions],
                        logprobs=[_sampled_token_logprobs(completion) for completion in completions],
                        seconds=time.monotonic() - started,
                        routed_experts=_routed_experts(completions),
                    )
                except Exception as exc:  # noqa: BLE001 - handed to the waiting caller
                    result = RuntimeError(f"the colocated vLLM engine's answer to {request.key}: {exc}")
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


def _routed_experts(completions: list[Any]) -> list[Any] | None:
    """Each completion's routed experts when the engine records them (`enable_return_routed_experts`); else None."""
    routings = [getattr(completion, "routed_experts", None) for completion in completions]
    return None if any(routing is None for routing in routings) else routings
