"""The bound on waiting for an engine that went away (`RolloutDriver`'s recovery).

Recovery is bounded, so that a request that crashes the server (under a supervisor that restarts it) cannot loop: a
group lost with the engine `limit` times fails the run naming it (a poison request), and so does the engine going
away that many times with no group finishing in between (a weights reload that crashes it); the waits for the engine
since a group last finished share one `recovery_timeout`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from .rollout_engine import EngineUnavailable

logger = logging.getLogger(__name__)

MAX_ENGINE_LOSSES = 3  # a group lost with the engine this often (or losses in a row without progress) fails the run


class EngineLosses:
    """Which groups were lost with the engine and how often, and the recovery time spent since a group finished."""

    def __init__(self, limit: int, recovery_timeout: float):
        self.limit, self.recovery_timeout = limit, recovery_timeout
        self.recoveries = 0  # the engine came back this many times
        self.in_a_row = 0  # engine losses since a group last finished
        self.spent = 0.0  # seconds waited for the engine since a group last finished
        self._lost: dict[tuple, int] = {}  # key -> times lost with the engine (until it finishes or is dropped)
        self._sent_after: dict[tuple, int] = {}  # key -> recoveries before it was last sent

    def sent(self, key: tuple) -> None:
        self._sent_after[key] = self.recoveries

    def sent_before_the_last_recovery(self, key: tuple) -> bool:
        """Whether `key` reports a loss late: it was lost with the engine that recovery waited for, and counted."""
        return self._sent_after.get(key) != self.recoveries

    def forget(self, key: tuple) -> None:
        self._lost.pop(key, None)
        self._sent_after.pop(key, None)

    def finished(self, key: tuple) -> None:
        """A group finished: progress, so recovery starts afresh."""
        self.in_a_row, self.spent = 0, 0.0
        self._lost.pop(key, None)

    def recovered(self, seconds: float) -> None:
        self.spent += seconds
        self.recoveries += 1

    @property
    def remaining(self) -> float:
        return self.recovery_timeout - self.spent

    def count(
        self, exc: EngineUnavailable, lost: list[tuple], loading: int | None, order: Callable[[tuple], int], where: str
    ) -> EngineUnavailable | None:
        """Count a new loss of the engine (`where`) with the groups `lost` in flight; the error that ends the run
        once a group has been lost `limit` times (it may crash the server), or the engine that often with no group
        finishing in between (a reload that crashes it), else None."""
        self.in_a_row += 1
        for key in lost:
            self._lost[key] = self._lost.get(key, 0) + 1
        suspects = sorted((key for key in lost if self._lost[key] >= self.limit), key=order)
        if suspects:
            named = ", ".join(map(str, suspects[:4])) + (f" and {len(suspects) - 4} more" if len(suspects) > 4 else "")
            which = ("group", "it") if len(suspects) == 1 else ("groups", "one of them")
            return EngineUnavailable(
                f"{where} went away {self.limit} times with {which[0]} {named} in flight (sent again after each "
                f"recovery; last: {exc}): {which[1]} likely crashes the server (see its log); the run stops instead "
                "of sending it again"
            )
        if self.in_a_row >= self.limit:
            during = (
                f"while loading weights version {loading}" if loading is not None else f"with {len(lost)} in flight"
            )
            return EngineUnavailable(
                f"{where} went away {self.in_a_row} times with no group finishing in between (the last "
                f"{during}: {exc}): it crashes on what it is sent, not just restarts; see its log for the cause"
            )
        logger.warning("%s; waiting up to %g s for it to come back", exc, self.remaining)
        return None

    def spent_error(self, exc: EngineUnavailable) -> EngineUnavailable:
        """`exc` of a wait for the engine that ran out, saying that several recoveries shared the timeout."""
        if self.in_a_row <= 1:
            return exc
        return EngineUnavailable(
            f"{exc} ({self.in_a_row} recoveries with no group finishing in between share "
            f"vllm_server_recovery_timeout={self.recovery_timeout:g} s, which they spent)"
        )
