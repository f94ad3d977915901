"""The streaming driver at DAPO scale on one process: GROUPS groups x 16 responses x TOKENS tokens each pass through
`RolloutDriver` (admitted, finished, held, taken in waves of a quarter of the round, as `StreamingRollout` takes
them) against an engine that answers at once with arrays. Prints one JSON line: tokens moved, peak RSS growth (MB),
peak Python threads and wall time.

Usage: python rollout_scale_run.py [GROUPS=512] [TOKENS=16384] [IN_FLIGHT=64]
"""

import json
import queue
import sys
import threading
import time

import numpy as np

from dapo_trl.training.rollout.rollout_driver import RolloutDriver
from dapo_trl.training.rollout.rollout_engine import GroupRequest, GroupResult
from dapo_trl.training.rollout.rollout_stream import MAX_WAVES_PER_ROUND

GROUP = 16


def peak_rss_mb() -> float:
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmHWM:"))
    return int(line.split()[1]) / 1024


class ArrayEngine:
    """Answers every group with GROUP completions of `tokens` tokens, built as arrays on one worker thread."""

    def __init__(self, tokens: int):
        self.tokens, self.jobs = tokens, queue.Queue()
        self.worker = threading.Thread(target=self._work, daemon=True)
        self.worker.start()

    def _work(self) -> None:
        while (job := self.jobs.get()) is not None:
            request, done = job
            total = GROUP * self.tokens
            ids = np.arange(total, dtype=np.int32) % 50000
            logprobs = np.full(total, -0.5, dtype=np.float32)
            done(request, GroupResult.from_arrays(request.key, request.version, ids, logprobs, [self.tokens] * GROUP))

    def start(self, request, done):
        self.jobs.put((request, done))

    def cancel(self, request):
        pass

    def load_weights(self, version):
        pass

    def close(self):
        self.jobs.put(None)


def main() -> None:
    groups, tokens, in_flight = (int(arg) for arg in (sys.argv[1:] + ["512", "16384", "64"][len(sys.argv) - 1 :]))
    baseline, started = peak_rss_mb(), time.monotonic()
    held = in_flight * GROUP * tokens  # finished groups held: as many as run (the trainer's default is a batch's)
    driver = RolloutDriver(ArrayEngine(tokens), in_flight, max_held_bytes=8 * held)
    driver.loaded_externally(0)
    keys = [("stream", n) for n in range(groups)]
    driver.plan([GroupRequest(key, [1, 2, 3], n, 0) for n, key in enumerate(keys)])
    threads, moved, start = threading.active_count(), 0, 0
    least = max(1, groups // MAX_WAVES_PER_ROUND)
    while start < groups:
        ready = driver.ready_prefix(keys[start:], min(least, groups - start), timeout=600)
        threads = max(threads, threading.active_count())
        for result in driver.take(keys[start : start + ready]):
            moved += result.tokens
            result.completion_ids  # noqa: B018 - what a wave hands TRL, one group at a time
        start += ready
    driver.close()
    print(
        json.dumps(
            {
                "groups": groups,
                "tokens": moved,
                "rss_growth_mb": round(peak_rss_mb() - baseline, 1),
                "peak_threads": threads,
                "seconds": round(time.monotonic() - started, 2),
            }
        )
    )


if __name__ == "__main__":
    main()
