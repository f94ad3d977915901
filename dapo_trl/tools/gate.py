"""Admission control shared by every sandbox call of a process: a concurrency cap and a token-bucket rate limit."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator


class TokenBucket:
    """`rate` admissions per second on average, at most `burst` at once; `acquire` blocks until one is free.

    Unlike verl's "rate limiter" (a semaphore, i.e. a concurrency cap), this bounds calls per second, which is what
    a shared remote service's quota is stated in.
    """

    def __init__(
        self,
        rate: float,
        burst: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if rate <= 0:
            raise ValueError(f"rate must be > 0 calls per second, got {rate}")
        self.rate = float(rate)
        self.burst = float(burst if burst is not None else max(1, round(rate)))
        if self.burst < 1:
            raise ValueError(f"burst must be >= 1, got {burst}")
        self._clock = clock
        self._sleep = sleep
        self._tokens = self.burst
        self._stamp = clock()
        self._lock = threading.Lock()

    def acquire(self) -> None:
        while True:
            with self._lock:
                now = self._clock()
                self._tokens = min(self.burst, self._tokens + (now - self._stamp) * self.rate)
                self._stamp = now
                if self._tokens >= 1:
                    self._tokens -= 1
                    return
                wait = (1 - self._tokens) / self.rate
            self._sleep(wait)


class ExecutionGate:
    """At most `max_concurrency` calls in flight and, if `rate_limit` is set, at most that many starts per second.

    One gate is shared by all the calls of a sandbox backend, whether they come from the training loop's prefetch
    threads, TRL's own tool loop or user code. `peak_in_flight` records the highest concurrency seen (tests read it).
    """

    def __init__(self, max_concurrency: int = 128, rate_limit: float | None = None, burst: int | None = None) -> None:
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        self.max_concurrency = max_concurrency
        self._slots = threading.BoundedSemaphore(max_concurrency)
        self._bucket = TokenBucket(rate_limit, burst) if rate_limit else None
        self._lock = threading.Lock()
        self.in_flight = 0
        self.peak_in_flight = 0

    @contextlib.contextmanager
    def admit(self) -> Iterator[None]:
        with self._slots:
            if self._bucket is not None:
                self._bucket.acquire()
            with self._lock:
                self.in_flight += 1
                self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
            try:
                yield
            finally:
                with self._lock:
                    self.in_flight -= 1
