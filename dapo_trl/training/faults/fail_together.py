"""Every process fails together, with the first failure's message, instead of waiting for a collective's timeout.

An exception on one process (a reward function, the tokenizer, an engine timeout, the rollout driver on the main
process, an evaluation) leaves the others inside their next collective: NCCL waits for its timeout (10 minutes or
more), and the log shows a timeout rather than the cause. Here the failing process records its error in the
rendezvous store every launcher already runs (torchrun's TCPStore, at MASTER_ADDR:MASTER_PORT) before it raises;
each other process watches that store from a thread. One that sees a failure says which process failed and why,
lets its own main thread end by itself for a moment (gloo notices a closed socket at once, and the error raised there
is replaced by the first failure's), and otherwise exits with code 1, so the launcher stops the run in seconds.
"""

from __future__ import annotations

import datetime
import logging
import os
import sys
import threading
import traceback
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

POLL_SECONDS = 1.0  # how often a process looks for another's failure (one small request to the store)
OWN_EXIT_SECONDS = 3.0  # how long a process whose peer failed waits for its main thread to end by itself


class PeerProcessFailed(RuntimeError):
    """Another training process failed first; the message is its error."""


def describe(exc: BaseException) -> str:
    """`Type: message (file:line in function)`, the innermost frame of the traceback."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" ({os.path.basename(frames[-1].filename)}:{frames[-1].lineno} in {frames[-1].name})" if frames else ""
    text = str(exc) if len(str(exc)) <= 2000 else str(exc)[:2000] + " ..."
    return f"{type(exc).__name__}: {text}{where}"


# How a collective reports a peer whose process is gone: gloo's socket errors, NCCL's for a remote exit.
VANISHED_PEER = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "remote process exited")


def peer_vanished(exc: BaseException) -> bool:
    """Whether `exc` is a collective broken by a peer that died without recording a failure (nothing in the store)."""
    return isinstance(exc, RuntimeError) and any(words in str(exc) for words in VANISHED_PEER)


def launcher_store() -> Callable[[], Any] | None:
    """A factory of clients of the launcher's store (torchrun / accelerate launch set MASTER_ADDR and MASTER_PORT),
    or None when this process was not started by such a launcher."""
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not host or not port:
        return None

    def connect() -> Any:
        import torch.distributed as dist

        return dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=30))

    return connect


class FailTogether:
    """`run(train)`: calls `train()`; a failure on any process ends every process with the first failure's message."""

    def __init__(
        self,
        process_index: int,
        num_processes: int,
        connect: Callable[[], Any] | None,
        on_peer_failure: Callable[[], None] = lambda: None,
        exit_process: Callable[[int], Any] = os._exit,
        poll_seconds: float = POLL_SECONDS,
        own_exit_seconds: float = OWN_EXIT_SECONDS,
    ):
        self.process_index = process_index
        self.enabled = num_processes > 1 and connect is not None
        self.connect = connect
        self.on_peer_failure = on_peer_failure  # e.g. cancel the rollout's in-flight requests
        self.exit_process = exit_process
        self.poll_seconds = poll_seconds
        self.own_exit_seconds = own_exit_seconds
        self._runs = 0  # train() calls: each has its own key, the same on every process

    def run(self, train: Callable[[], Any]) -> Any:
        if not self.enabled:
            return train()
        self._runs += 1
        # torchrun's store outlives a restart of the worker group (--max_restarts): each attempt has its own key.
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        key = f"dapo_trl/failure/{attempt}/{self._runs}"
        ended = threading.Event()
        watcher = threading.Thread(target=self._watch, args=(key, ended), name="dapo-fail-together", daemon=True)
        watcher.start()
        try:
            return train()
        except BaseException as exc:
            first = self._report(key, exc)
            if first is not None and not first.startswith(f"process {self.process_index} "):
                raise PeerProcessFailed(first) from exc
            if peer_vanished(exc):
                raise PeerProcessFailed(
                    f"another process ended without a word while process {self.process_index} waited for it in a "
                    "collective: killed by a signal (kill -9, the out-of-memory killer) or its machine lost; the "
                    f"launcher's summary names it and its exit code ({describe(exc)})"
                ) from exc
            raise
        finally:
            ended.set()

    def _report(self, key: str, exc: BaseException) -> str | None:
        """Record this process's failure unless another's is there first; the first failure's message."""
        try:
            store = self.connect()
            mine = f"process {self.process_index} failed: {describe(exc)}"
            return store.compare_set(key, "", mine).decode()
        except Exception as store_error:  # the store is gone (the launcher is stopping): nothing to tell
            logger.debug("could not record the failure in the launcher's store: %s", store_error)
            return None

    def _watch(self, key: str, ended: threading.Event) -> None:
        try:
            store = self.connect()
            while not ended.wait(self.poll_seconds):
                if store.check([key]):
                    first = store.get(key).decode()
                    if not first.startswith(f"process {self.process_index} "):
                        return self._stop_for(first, ended)
        except Exception as store_error:  # the launcher's store went away: the launcher is ending the run
            logger.debug("stopped watching for failures of other processes: %s", store_error)

    def _stop_for(self, first: str, ended: threading.Event) -> None:
        print(f"error: process {self.process_index} stops because {first}", file=sys.stderr, flush=True)
        cleanup = threading.Thread(target=self._clean_up, name="dapo-fail-together-cleanup", daemon=True)
        cleanup.start()  # bounded below: the exit must not wait on a stuck engine
        if ended.wait(self.own_exit_seconds):  # the main thread raised by itself (e.g. gloo saw the closed socket)
            return
        sys.stdout.flush()
        self.exit_process(1)

    def _clean_up(self) -> None:
        try:
            self.on_peer_failure()
        except Exception as close_error:
            logger.debug("cleaning up after another process's failure failed: %s", close_error)
