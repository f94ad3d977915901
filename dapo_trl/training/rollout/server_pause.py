"""A vLLM server paused for an in-flight weight load, and the promise that a server this run paused is resumed.

In-flight weight updates pause the server with the running requests kept (`/pause?mode=keep`, their KV cache too
with `keep_kv_cache`), reload, and resume. A server left paused queues every later request behind the pause, so the
next run would fail only as "frozen". Hence three paths resume it: `resume` at the end of every load (the engine
calls it in a `finally`); `release` from the exit paths of the process (a peer's failure, the grace exit, Ctrl-C,
the end of `train()`: the run guard); and `resume_if_left_paused` when an engine starts, for a server an earlier
run left paused (killed between `/pause` and `/resume`), which it asks with `/is_paused`. While the server is held
paused the progress watchdog judges the pause by its own bound, not the stall timeout (`ServerProgress.hold`).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable

from .rollout_engine import EngineUnavailable
from .server_progress import ServerProgress

RELEASE_SECONDS = 10.0  # how long an exit path waits for the server to answer `/resume` (`release`)

logger = logging.getLogger(__name__)

Post = Callable[[str, float], None]  # POST a dev-mode control path within a timeout; raises on an error answer
Get = Callable[[str, float], tuple[int, bytes]]  # GET a path within a timeout: (status, body)


class ServerPause:
    """Pauses and resumes one server (`base_url`) through its dev-mode control endpoints, and knows whether a pause
    of ours is still in force (`paused_by_us`: set before POST /pause, since an answer lost on the way may still
    have paused it; cleared once /resume answered)."""

    def __init__(
        self, base_url: str, post: Post, get: Get, progress: ServerProgress, timeout: float, keep_kv_cache: bool
    ):
        self.base_url = base_url
        self._post, self._get = post, get
        self.progress = progress
        self.timeout = timeout
        self.keep_kv_cache = keep_kv_cache
        self._paused_by_us = False

    @property
    def paused_by_us(self) -> bool:
        """Whether this run paused the server and has not resumed it yet."""
        return self._paused_by_us

    def pause(self) -> None:
        """Pause the server with our requests kept (their KV cache too with `keep_kv_cache`), for a weights load.
        The watchdog judges the pause by its own bound until `resume` (the counters stand still: no stall)."""
        self._paused_by_us = True
        self.progress.hold()
        self._post("/pause?mode=keep" + ("&clear_cache=false" if self.keep_kv_cache else ""), self.timeout)

    def resume(self, timeout: float | None = None) -> None:
        """POST /resume; once it answered, the server is no longer ours to resume and the stall clock runs again."""
        self._post("/resume", self.timeout if timeout is None else timeout)
        self._paused_by_us = False
        self.progress.release()

    def release(self, why: str, wait: float = 0.0) -> bool:
        """Resume the server if this run left it paused (an exit path: `why`), within `RELEASE_SECONDS`; whether it
        did. `wait`: seconds a load in progress (the driver's thread between its pause and resume) may take to
        resume it itself first. Never raises: it runs where the process is stopping for another error."""
        deadline = time.monotonic() + wait
        while self._paused_by_us and time.monotonic() < deadline:
            time.sleep(0.05)
        if not self._paused_by_us:
            return False
        try:
            self.resume(timeout=min(self.timeout, RELEASE_SECONDS))
        except Exception as exc:  # noqa: BLE001 - the process is stopping for another error
            logger.error(
                "the vLLM server at %s was left paused (%s) and did not answer /resume: %s", self.base_url, why, exc
            )
            return False
        logger.warning(
            "resumed the vLLM server at %s, which this run had paused for a weight update (%s)", self.base_url, why
        )
        return True

    def resume_if_left_paused(self) -> bool:
        """A server an earlier run left paused (stopped between `/pause` and `/resume`: killed, preempted) would
        queue every request of ours behind the pause: resume it, and say so; whether it was paused. A server
        without dev mode has no `/is_paused` (nor `/pause`): nothing to do."""
        try:
            status, body = self._get("/is_paused", min(self.timeout, RELEASE_SECONDS))
        except EngineUnavailable:
            return False
        try:
            paused = status == 200 and json.loads(body or b"{}").get("is_paused") is True
        except (ValueError, AttributeError):  # not vLLM's answer (a proxy's page): nothing known to resume
            paused = False
        if not paused:
            return False
        logger.warning(
            "the vLLM server at %s was paused (a run stopped between /pause and /resume?): resuming it before "
            "generating",
            self.base_url,
        )
        self.resume()
        return True
