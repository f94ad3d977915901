"""Whether a vLLM server is making progress, so that a request fails when the server has stalled, never because its
response is long.

At the paper's settings a sequence decodes at ~20-30 tokens/s under a full KV cache: a 20k-token response takes
700-1,000 s, a batched round of them 25-50 minutes (estimates: docs/figures.md). A timeout on the whole HTTP request
(or on a socket read, which for a non-streamed completion is the same thing) fails those, however healthy the
server. What a stalled server lacks is progress: `ServerProgress` polls the server's `/metrics` while requests of
ours are outstanding and records progress when its token counters move (`vllm:generation_tokens_total`,
`vllm:prompt_tokens_total`: decoding or prefill, for anyone's request: vLLM schedules first come, first served) or
when a request of ours is answered. After `stall_timeout` seconds without either, it calls `on_stall(message)`: the
clients fail their outstanding requests with that message, naming the server's URL. A frozen server (its process
stopped) answers no poll, which counts as no progress. A server without vLLM's counters (another engine, a proxy
that hides /metrics) is judged by what it sends us alone (answers, and the bytes of streamed answers), which
`report_counters` says once at start.

While we hold the server paused for a weight update (`hold` ... `release`), its counters stand still by design: the
watchdog then judges the pause by its own bound (`pause_timeout`, a weight transfer's: a ZeRO-3 gather of every
parameter and the broadcast), with its own message, not by `stall_timeout`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from ..faults.preemption import AbandonedRound

logger = logging.getLogger(__name__)

PROGRESS_COUNTERS = ("vllm:generation_tokens_total", "vllm:prompt_tokens_total")
MAX_POLL_SECONDS = 5.0  # how often the counters are read while requests are outstanding (less for short timeouts)
ABANDON_POLL_SECONDS = 0.5  # at most this long between ticks while a request is being abandoned


def token_counters(metrics_text: str) -> float | None:
    """The sum of the server's token counters (all label sets) in a Prometheus text answer, or None without them."""
    return metric_sum(metrics_text, PROGRESS_COUNTERS)


def metric_sum(metrics_text: str, names: tuple[str, ...]) -> float | None:
    """The sum of the metrics `names` (all label sets) in a Prometheus text answer, or None when it has none."""
    total, seen = 0.0, False
    for line in metrics_text.splitlines():
        if line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in names:
            try:
                total += float(line.rsplit(" ", 1)[1])
            except (IndexError, ValueError):
                continue
            seen = True
    return total if seen else None


class ServerProgress:
    """A watchdog over one server's progress while `busy()` requests are outstanding (see the module docstring).

    `read_metrics()` returns the `/metrics` text, None when the server has no such endpoint, and raises when the
    server does not answer (each read bounded by its own timeout). `on_stall(message)` is called from the watchdog's
    thread once per stall; the clock then restarts (a later request gets a full window). While `abandon_when()` is
    true (a preemption signal), `on_abandon()` is called on every tick, before any poll (a frozen server holds one
    for up to 10 s): the requests outstanding are to be given up.
    """

    def __init__(
        self,
        url: str,
        stall_timeout: float,
        read_metrics: Callable[[], str | None],
        on_stall: Callable[[str], None] | None = None,
        poll_seconds: float | None = None,
        on_abandon: Callable[[], None] | None = None,
        pause_timeout: float | None = None,
    ):
        self.url = url
        self.pause_timeout = stall_timeout if pause_timeout is None else max(pause_timeout, stall_timeout)
        self._held_since: float | None = None  # `hold()`: we hold the server paused since then
        self.stall_timeout = stall_timeout
        self.read_metrics = read_metrics
        self.on_stall = on_stall
        self.abandon_when: Callable[[], bool] | None = None  # set later (the trainer's preemption flag)
        self.on_abandon = on_abandon
        self.poll_seconds = poll_seconds or min(MAX_POLL_SECONDS, max(stall_timeout / 5, 0.05))
        self.counters_available = True  # until the server shows it has none
        self.stalls = 0
        self._outstanding = 0
        self._last_progress = time.monotonic()
        self._last_total: float | None = None
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._closed = False
        self._thread = threading.Thread(target=self._watch, name="dapo-server-progress", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------------------------------- callers
    def begin(self) -> None:
        """A request of ours is outstanding (from idle, the stall clock starts now)."""
        with self._lock:
            if self._outstanding == 0:
                self._last_progress = time.monotonic()
            self._outstanding += 1
            self._wake.notify()

    def end(self, answered: bool = True) -> None:
        """A request of ours is over; an answer from the server is progress."""
        with self._lock:
            self._outstanding = max(0, self._outstanding - 1)
            if answered:
                self._last_progress = time.monotonic()

    def progressed(self) -> None:
        """Something the server sent counts as progress (e.g. an answer to a reload)."""
        with self._lock:
            self._last_progress = time.monotonic()

    def hold(self) -> None:
        """We pause the server (a weight update): the stall clock stops; the pause is bounded by `pause_timeout`."""
        with self._lock:
            self._held_since = time.monotonic()

    def release(self) -> None:
        """We resumed the server: the stall clock restarts now."""
        with self._lock:
            self._held_since = None
            self._last_progress = time.monotonic()

    def held_for(self) -> float:
        with self._lock:
            return 0.0 if self._held_since is None else time.monotonic() - self._held_since

    def report_counters(self) -> bool:
        """Read the server's counters once (at start) and say, once, when it has none: then the watchdog judges by
        what the server sends us (answers, streamed bytes). Whether it has them."""
        self._poll()
        with self._lock:
            self._last_total = None  # the next busy period compares against a fresh reading
        return self.counters_available

    @property
    def last_progress(self) -> float:
        """`time.monotonic()` of the last progress (or of the start of the current busy period)."""
        with self._lock:
            return self._last_progress

    def stalled_for(self) -> float:
        """Seconds without progress while requests are outstanding (0 while we hold the server paused)."""
        with self._lock:
            if self._held_since is not None or not self._outstanding:
                return 0.0
            return time.monotonic() - self._last_progress

    def pause_message(self, seconds: float) -> str:
        return (
            f"the vLLM server at {self.url} has been paused for a weight update for {seconds:.0f} s, past its bound "
            f"of {self.pause_timeout:g} s (the process-group timeout, ddp_timeout): the weight transfer or reload did "
            "not finish. Our requests there are failed; the server is resumed as the run stops."
        )

    def stall_message(self, seconds: float) -> str:
        measured = "its token counters (/metrics) did not move and " if self.counters_available else ""
        return (
            f"the vLLM server at {self.url} made no progress for {seconds:.0f} s ({measured}no request of ours was "
            f"answered) with requests outstanding: it is frozen or overloaded. vllm_request_timeout="
            f"{self.stall_timeout:g} s bounds a stall, not a response's length: raise it if the server is only slow."
        )

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._wake.notify()

    # ----------------------------------------------------------------------------------------- the watchdog
    def _watch(self) -> None:
        while True:
            with self._lock:
                while not self._closed and self._outstanding == 0:
                    self._last_total = None  # idle: the next busy period compares against a fresh reading
                    self._wake.wait()
                if self._closed:
                    return
            if self._abandoning():
                self.on_abandon()  # on every tick: a connection opened since the last one is shut too
                time.sleep(min(self.poll_seconds, ABANDON_POLL_SECONDS))
                continue
            held = self.held_for()
            if held > self.pause_timeout:
                with self._lock:
                    self._held_since = time.monotonic()  # reported once per bound
                self._stalled(self.pause_message(held))
            elif not held:  # (paused by us: the counters stand still by design)
                self._poll()
                stalled = self.stalled_for()
                if stalled > self.stall_timeout:
                    with self._lock:
                        self._last_progress = time.monotonic()  # the clock restarts: a later request's full window
                    self._stalled(self.stall_message(stalled))
            self._nap(self.poll_seconds)

    def _stalled(self, message: str) -> None:
        self.stalls += 1
        logger.error("%s", message)
        if self.on_stall is not None:
            self.on_stall(message)

    def _nap(self, seconds: float) -> None:
        """Sleep between polls, waking for `abandon_when()` within `ABANDON_POLL_SECONDS`."""
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            if self._abandoning():
                return
            time.sleep(min(left, ABANDON_POLL_SECONDS))

    def _abandoning(self) -> bool:
        """A preemption was signalled and the requests outstanding are to be given up (`on_abandon`)."""
        abandon_when = self.abandon_when
        return abandon_when is not None and self.on_abandon is not None and abandon_when()

    def _poll(self) -> None:
        if not self.counters_available:
            return
        try:
            text = self.read_metrics()
        except Exception:  # noqa: BLE001 - no answer from the server: no progress
            return
        total = None if text is None else token_counters(text)
        if total is None:
            if self.counters_available:
                logger.warning(
                    "%s exports no vLLM token counters on /metrics (a proxy that does not forward it, or another "
                    "engine): its progress is judged by what it sends us alone, so vllm_request_timeout=%g s bounds "
                    "the silence of a streamed answer, and the whole length of an answer that is not streamed",
                    self.url,
                    self.stall_timeout,
                )
            self.counters_available = False
            return
        with self._lock:
            if self._last_total is not None and total != self._last_total:
                self._last_progress = time.monotonic()
            self._last_total = total


def watch_generation(client: Any, timeout: float, error: type[Exception]) -> None:
    """Bound TRL's generation requests by the server's progress, not their length (`server_progress`).

    TRL's `VLLMClient.generate` is one POST /v1/completions for a whole round, answered when its longest response
    ends: 25-50 minutes at the paper's scale. While it runs, reads have no timeout; a watchdog reads the server's
    /metrics and, when the server has made no progress for `timeout` seconds, shuts the request's connection and the
    call raises `error` saying so, naming the URL (not one that means "unreachable": a stalled server is not waited
    for as a restart). `vllm_backends.add_timeouts` must have mounted its adapter first.

    A preemption signal (`client.generation_progress.abandon_when()`, set by `RunGuard`) also shuts the request's
    connection, within ~0.5 s, and the call returns `abandoned_round` instead of raising: TRL's broadcast then hands
    every process the markers (the others wait in it while the main process POSTs), and each abandons the step.
    """
    import requests

    adapter = client.session.get_adapter("http://")
    generate, base_url = client.generate, client.base_url.rstrip("/")

    def metrics() -> str | None:
        answer = requests.get(f"{base_url}/metrics", timeout=min(timeout, 10.0))
        return answer.text if answer.status_code == 200 else None

    stalled: list[str] = []
    abandoned: list[bool] = []

    def abandon() -> None:
        abandoned.append(True)
        adapter.abort()

    progress = ServerProgress(
        base_url, timeout, metrics, lambda message: (stalled.append(message), adapter.abort()), on_abandon=abandon
    )

    def watched(*args: Any, **kwargs: Any) -> Any:
        if progress.abandon_when is not None and progress.abandon_when():
            return abandoned_round(*args, **kwargs)  # preempted before the POST: no request is sent
        bounded, adapter.default_timeout = adapter.default_timeout, (timeout, None)  # connect bounded, reads not
        stalled.clear()
        abandoned.clear()
        progress.begin()
        try:
            return generate(*args, **kwargs)  # an answer that arrives anyway is used: the next safe point abandons
        except Exception as exc:
            if abandoned:
                return abandoned_round(*args, **kwargs)
            if stalled:
                raise error(f"POST {base_url}/v1/completions: {stalled[0]}") from exc
            raise
        finally:
            progress.end()
            adapter.default_timeout = bounded

    client.generate = watched
    client.generation_progress = progress  # `abandon_when` is set by the trainer's `RunGuard`


def abandoned_round(prompts: list | None = None, *args: Any, n: int = 1, **kwargs: Any) -> dict[str, Any]:
    """What `VLLMClient.generate` answers for a round abandoned for a preemption: `AbandonedRound` markers, one per
    completion, which TRL broadcasts to every process as it would the completions (all see them at the same point:
    `DAPOTrainer._generate_single_turn` then abandons the step on all)."""
    prompts = list(prompts or [])
    rows = len(prompts) * n
    return {
        "prompt_ids": prompts,
        "completion_ids": [AbandonedRound() for _ in range(rows)],
        "logprobs": [[] for _ in range(rows)],
        "logprob_token_ids": None,
    }
