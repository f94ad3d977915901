"""One HTTP client for the services the trainer calls: the LLM judge, the SandboxFusion sandbox, a vLLM server.

The services differ in what a retry may repeat (a judge request is harmless to send twice; a sandbox request whose
reply timed out may already have run the program; a vLLM weight reload must run once), so each client passes its
own `RetryPolicy`. The mechanics are shared here: checking a base URL before the first request, a (connect, read)
timeout on every request, retries with jittered exponential backoff on connection errors and chosen HTTP statuses,
at least the wait a Retry-After header asks for (seconds or an HTTP date), a cap on one wait, an overall deadline
and a stop event, and a `RequestFailed` error that keeps what each client needs to word its own message.
"""

from __future__ import annotations

import contextlib
import email.utils
import logging
import math
import random
import socket
import threading
import time
import urllib.parse
import weakref
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import requests
import urllib3
from requests.adapters import HTTPAdapter

logger = logging.getLogger(__name__)

RETRY_STATUSES = frozenset({429, 502, 503, 504})  # overloaded or restarting: the same request may well succeed later
TimeoutSpec = float | tuple[float, float]  # seconds for both, or (connect, read)


def checked_service_path(base_url: str, bad: Callable[[str], ValueError]) -> tuple[str, str, str]:
    """(scheme, netloc, path without trailing slash) of an http(s) URL; `bad(problem)` builds the error raised.

    Run at construction, so a typo in a service URL fails before training starts, in the caller's own words.
    """
    if not isinstance(base_url, str) or not base_url.strip():
        raise bad("is empty")
    url = base_url.strip()
    if any(c.isspace() for c in url):
        raise bad("contains whitespace")
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise bad("must start with http:// or https://")
    if not parts.hostname:
        raise bad("has no host")
    try:
        _ = parts.port  # raises ValueError for a non-numeric or out-of-range port
    except ValueError:
        raise bad("has an invalid port") from None
    if parts.query or parts.fragment:
        raise bad("must not have a query string or fragment")
    return parts.scheme, parts.netloc, parts.path.rstrip("/")


def parse_retry_after(value: str | None) -> float | None:
    """Seconds a Retry-After header asks to wait, from delta-seconds or an HTTP date; None if absent or unreadable."""
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    return max(0.0, when.timestamp() - time.time())  # a date without a zone is read as UTC


def is_read_timeout(error: BaseException | None) -> bool:
    """A timeout after the request was sent (requests wraps urllib3's in a ConnectionError while reading a body)."""
    if isinstance(error, requests.ReadTimeout):
        return True
    return isinstance(error, requests.ConnectionError) and any(
        isinstance(arg, urllib3.exceptions.ReadTimeoutError) for arg in error.args
    )


@dataclass(frozen=True)
class RetryPolicy:
    """When a failed request is sent again, and how long to wait first.

    A retry follows a connection error (refused, reset, a connect timeout, a reply cut short) or an HTTP status in
    `retry_statuses`, at most `max_retries` times. A read timeout is retried only with `retry_read_timeouts` (or the
    per-call override): the server may already have acted on the request. The wait before retry k (k = 0, 1, ...)
    is `backoff_s * 2**k` times a jitter in [0.5, 1] (so concurrent clients do not retry in lockstep), at least a
    Retry-After header's, at most `max_delay_s` (Retry-After included), and never past the call's deadline.
    """

    max_retries: int = 3
    backoff_s: float = 1.0
    retry_statuses: Collection[int] = RETRY_STATUSES
    retry_read_timeouts: bool = False
    max_delay_s: float | None = None

    def delay_s(self, retry: int, retry_after: float | None) -> float:
        cap = math.inf if self.max_delay_s is None else self.max_delay_s
        delay = min(cap, self.backoff_s * 2**retry * random.uniform(0.5, 1.0))
        return delay if retry_after is None else max(delay, min(cap, retry_after))


class RequestFailed(Exception):
    """A request that failed for good, with what a caller needs to word its own message.

    `response` is set for an HTTP error status (its body loaded), `exception` (from requests) for a transport
    failure; both are None when the deadline or a stop came before the first attempt. `retryable` says whether the
    last failure was of a kind the policy retries (so retries ran out, or `gave_up` says what cut them short:
    "deadline", or "stopped" for the stop event). `timeout_s` is the last attempt's read timeout.
    """

    def __init__(
        self,
        method: str,
        url: str,
        attempts: int,
        *,
        response: requests.Response | None = None,
        exception: requests.RequestException | None = None,
        timeout_s: float | None = None,
        retryable: bool = False,
    ) -> None:
        self.method, self.url, self.attempts = method, url, attempts
        self.response, self.exception, self.timeout_s, self.retryable = response, exception, timeout_s, retryable
        self.gave_up: Literal["deadline", "stopped"] | None = None
        super().__init__(self.describe())

    @property
    def status(self) -> int | None:
        return None if self.response is None else self.response.status_code

    @property
    def read_timeout(self) -> bool:
        return is_read_timeout(self.exception)

    @property
    def timed_out(self) -> bool:
        """A connect or read timeout."""
        return isinstance(self.exception, requests.Timeout) or self.read_timeout

    @property
    def retry_after_s(self) -> float | None:
        return None if self.response is None else parse_retry_after(self.response.headers.get("Retry-After"))

    def detail(self, limit: int) -> str:
        """The head of the error reply's body (servers put the reason there)."""
        return "" if self.response is None else self.response.text[:limit].strip()

    def describe(self, detail_chars: int = 300) -> str:
        """ "HTTP 503 Service Unavailable: <body head>", "ConnectionError: ...", or that no attempt was made."""
        if self.response is not None:
            detail = self.detail(detail_chars)
            return f"HTTP {self.status} {self.response.reason}" + (f": {detail}" if detail else "")
        if self.exception is not None:
            return f"{type(self.exception).__name__}: {self.exception}"
        return "no attempt was made before the deadline"

    def root_cause(self) -> BaseException | None:
        """The innermost error under requests' and urllib3's wrappers, e.g. ConnectionRefusedError."""
        error: BaseException | None = self.exception
        seen: set[int] = set()
        while error is not None and id(error) not in seen:
            seen.add(id(error))
            reason = getattr(error, "reason", None)  # urllib3's MaxRetryError
            inner = reason if isinstance(reason, BaseException) else error.__cause__ or error.__context__
            inner = inner or next((arg for arg in error.args if isinstance(arg, BaseException)), None)
            if inner is None:
                break
            error = inner
        return error


class HTTPClient:
    """A requests session plus a RetryPolicy: `request` times out, retries and waits as the policy says.

    Safe for concurrent `request` calls from threads (urllib3's pool is); `pool_maxsize` should cover them, else
    surplus connections are opened and dropped. A given `session` is used as it is and left open by `close`.
    """

    def __init__(self, policy: RetryPolicy, *, session: requests.Session | None = None, pool_maxsize: int = 10) -> None:
        self.policy = policy
        self._owns_session = session is None
        if session is None:
            session = requests.Session()
            adapter = HTTPAdapter(pool_connections=1, pool_maxsize=pool_maxsize, max_retries=0)
            session.mount("http://", adapter)
            session.mount("https://", adapter)
        self.session = session

    def close(self) -> None:
        if self._owns_session:
            self.session.close()

    def __enter__(self) -> HTTPClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def request(
        self,
        method: str,
        url: str,
        *,
        timeout: TimeoutSpec,
        json: Any = None,
        headers: Mapping[str, str] | None = None,
        deadline: float | None = None,
        stop: threading.Event | None = None,
        retry_read_timeouts: bool | None = None,
        on_retry: Callable[[RequestFailed, float], None] | None = None,
    ) -> requests.Response:
        """The 2xx response (body loaded), or RequestFailed once the policy gives up.

        `deadline` (a `time.monotonic()` value) bounds the whole call: each attempt's timeout and each wait are cut
        to it. A set `stop` event ends the call before its next attempt or during a wait. `on_retry(failure,
        delay_s)` is called before each wait.
        """
        policy = self.policy
        retry_read = policy.retry_read_timeouts if retry_read_timeouts is None else retry_read_timeouts
        connect_s, read_s = (timeout, timeout) if isinstance(timeout, (int, float)) else timeout
        failure: RequestFailed | None = None
        attempts = 0
        while True:
            remaining = math.inf if deadline is None else deadline - time.monotonic()
            stopped = stop is not None and stop.is_set()
            if remaining <= 0 or stopped:
                failure = failure or RequestFailed(method, url, attempts)
                failure.gave_up = "stopped" if stopped else "deadline"
                raise failure
            attempts += 1
            limits = (min(connect_s, remaining), min(read_s, remaining))
            try:
                return self._attempt(method, url, attempts, limits, retry_read, json, headers)
            except RequestFailed as error:
                if not error.retryable or attempts > policy.max_retries:
                    raise
                failure = error
            delay = policy.delay_s(attempts - 1, failure.retry_after_s)
            if deadline is not None:
                delay = min(delay, deadline - time.monotonic())
            logger.debug("%s %s failed (%s); retrying in %.2f s", method, url, failure, delay)
            if on_retry is not None:
                on_retry(failure, delay)
            if delay > 0:
                if stop is None:
                    time.sleep(delay)
                elif stop.wait(delay):
                    failure.gave_up = "stopped"
                    raise failure

    def _attempt(
        self,
        method: str,
        url: str,
        attempts: int,
        timeout: tuple[float, float],
        retry_read: bool,
        json: Any,
        headers: Mapping[str, str] | None,
    ) -> requests.Response:
        try:
            response = self.session.request(method, url, json=json, headers=headers, timeout=timeout)
        except requests.RequestException as error:
            transient = isinstance(
                error, (requests.ConnectionError, requests.Timeout, requests.exceptions.ChunkedEncodingError)
            )
            retryable = retry_read if is_read_timeout(error) else transient
            raise RequestFailed(
                method, url, attempts, exception=error, timeout_s=timeout[1], retryable=retryable
            ) from error
        if 200 <= response.status_code < 300:
            return response
        response.close()  # the body is loaded already; the connection goes back to the pool
        retryable = response.status_code in self.policy.retry_statuses
        raise RequestFailed(method, url, attempts, response=response, retryable=retryable)


class TimeoutAdapter(HTTPAdapter):
    """An HTTPAdapter that gives every request `timeout` when its caller gives none, and may rewrap its errors.

    Mounted on a session this code does not call itself (TRL's `VLLMClient`), it bounds every request made through
    it; `wrap_error(request, error)` turns a failure into the caller's own exception (naming the URL).
    """

    def __init__(
        self,
        timeout: TimeoutSpec,
        wrap_error: Callable[[requests.PreparedRequest, requests.RequestException], Exception] | None = None,
        **kwargs: Any,
    ) -> None:
        self.default_timeout = timeout
        self.wrap_error = wrap_error
        self._connections: weakref.WeakSet = weakref.WeakSet()  # every connection opened through this adapter
        self._connections_lock = threading.Lock()
        super().__init__(**kwargs)

    def init_poolmanager(self, *args: Any, **kwargs: Any) -> None:
        super().init_poolmanager(*args, **kwargs)
        self.poolmanager.pool_classes_by_scheme = {
            "http": _recording_pool(urllib3.HTTPConnectionPool, self._record),
            "https": _recording_pool(urllib3.HTTPSConnectionPool, self._record),
        }

    def _record(self, connection: Any) -> None:
        with self._connections_lock:
            self._connections.add(connection)

    def abort(self) -> int:
        """Shut every open connection down, so that requests waiting on a hung server fail at once (an interrupt
        must not wait for their timeout: TRL's client waits for its worker threads). The number shut down."""
        with self._connections_lock:
            connections = list(self._connections)
        aborted = 0
        for connection in connections:
            sock = getattr(connection, "sock", None)
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                    aborted += 1
        return aborted

    def send(self, request: requests.PreparedRequest, timeout: Any = None, **kwargs: Any) -> requests.Response:
        timeout = self.default_timeout if timeout is None else timeout
        try:
            return super().send(request, timeout=timeout, **kwargs)
        except requests.RequestException as error:
            if self.wrap_error is None:
                raise
            raise self.wrap_error(request, error) from error


def _recording_pool(base: type, record: Callable[[Any], None]) -> type:
    """`base` (an urllib3 connection pool class) that hands each new connection to `record`."""

    class RecordingPool(base):
        def _new_conn(self) -> Any:
            connection = super()._new_conn()
            record(connection)
            return connection

    return RecordingPool


_RUN_CODE_URL_EXAMPLE = "'http://127.0.0.1:8080' (the SandboxFusion server's root; a trailing '/run_code' is accepted)"


def run_code_url(base_url: str) -> str:
    """A SandboxFusion service's `{base_url}/run_code`, after checking that `base_url` is an http(s) URL."""

    def bad(problem: str) -> ValueError:
        return ValueError(
            f"sandbox_url={base_url!r} {problem}; give the sandbox service's URL, e.g. {_RUN_CODE_URL_EXAMPLE}"
        )

    scheme, netloc, path = checked_service_path(base_url, bad)
    if path.endswith("/run_code"):
        path = path[: -len("/run_code")]
    return urllib.parse.urlunsplit((scheme, netloc, f"{path}/run_code", "", ""))
