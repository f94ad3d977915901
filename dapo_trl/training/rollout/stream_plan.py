"""The streaming rollout's plan, apart from its waits: each group's key and seed, the prompt stream with a look-ahead,
how many groups to admit ahead, and which of a wave's rows each process trains. Pure functions and one small class,
no engine, no trainer."""

from __future__ import annotations

import hashlib
import math
from collections import deque
from collections.abc import Callable, Container
from typing import Any

PLAN_CONFIDENCE_Z = 1.28  # groups admitted ahead: enough to fill the batch with ~90% odds at the running keep rate


def group_seed(run_seed: int, key: tuple) -> int:
    """The sampling seed of the group at `key`: the same in every run with this seed, and on resume."""
    digest = hashlib.sha256(repr((run_seed, key)).encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


def share_spans(group_count: int, group_size: int, index: int, processes: int) -> list[tuple[int, int, int]]:
    """(group, first row, row stop) of each group that has rows in process `index`'s equal share of a wave of
    `group_count` groups of `group_size` rows, in order (a group may straddle two processes)."""
    share = group_count * group_size // processes
    begin, end = index * share, (index + 1) * share
    spans = []
    for group in range(begin // group_size, -(-end // group_size)):
        first, stop = max(begin, group * group_size), min(end, (group + 1) * group_size)
        spans.append((group, first - group * group_size, stop - group * group_size))
    return spans


def plan_horizon(missing: float, keep_rate: float, z: float = PLAN_CONFIDENCE_Z) -> int:
    """The fewest groups g with g p - z sqrt(g p (1 - p)) >= missing (p = keep_rate): enough to keep `missing` groups
    at the one-sided normal bound. About missing / p when many are missing (a 512-group batch at p = 0.5: 1.04x), a
    wider margin when few are (4 groups: 13, not 8), so a small batch rarely waits for a second planning."""
    if missing <= 0:
        return 0
    p = min(max(keep_rate, 1e-3), 1.0)
    spread = z * math.sqrt(p * (1 - p))
    root = (spread + math.sqrt(spread**2 + 4 * p * missing)) / (2 * p)
    return math.ceil(root**2 - 1e-9)


# Prompt triage's decision for the stream's item at an index: (index, item, decide) -> skipped. `decide=False`
# predicts (planning ahead, nothing counted); `decide=True` is the decision, made when a round takes the item.
Skip = Callable[[int, Any, bool], bool]


class StreamCursor:
    """The sampler's prompt stream with a look-ahead: the main process peeks at prompts it admits early; every
    process takes them, in the same order, when a round consumes them. Drawn-but-untaken prompts are saved.

    With prompt triage (`skip`), a take passes over the items triage skips at that moment (every process decides
    the same: the decision reads the history frozen at the step's start) and keeps them in `skipped` for the
    caller to cancel; a peek passes over those it would skip now, a prediction the take may overturn (the history
    moves by a step between planning a batch ahead and taking it), which costs only what was generated for it."""

    def __init__(self, stream: Any, skip: Skip | None = None):
        self.stream = stream
        self.skip = skip
        self.lookahead: deque[tuple[int, Any]] = deque()
        self.drawn = 0
        self.skipped: list[tuple[int, Any]] = []  # taken past since the caller last cleared it

    def _fill(self, size: int) -> None:
        while len(self.lookahead) < size:
            (item,) = self.stream.draw(1)
            self.lookahead.append((self.drawn, item))
            self.drawn += 1

    def peek(self, count: int) -> list[tuple[int, Any]]:
        """The next `count` (index, item) pairs (triage: those it would not skip now) without consuming them."""
        if self.skip is None:
            self._fill(count)
            return [self.lookahead[i] for i in range(count)]
        peeked, position = [], 0
        while len(peeked) < count:
            self._fill(position + 1)
            index, item = self.lookahead[position]
            position += 1
            if not self.skip(index, item, False):
                peeked.append((index, item))
        return peeked

    def take(self, count: int) -> list[tuple[int, Any]]:
        """Consume the next `count` (index, item) pairs (triage: those it does not skip; the skipped ones are
        consumed too, into `skipped`)."""
        taken = []
        while len(taken) < count:
            self._fill(1)
            index, item = self.lookahead.popleft()
            if self.skip is not None and self.skip(index, item, True):
                self.skipped.append((index, item))
            else:
                taken.append((index, item))
        return taken

    def state_dict(self) -> dict[str, Any]:
        return {"lookahead": list(self.lookahead), "drawn": self.drawn}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.lookahead, self.drawn = deque(state["lookahead"]), state["drawn"]


def done_prefix(keys: list[tuple], done: Container[tuple]) -> int:
    """How many leading keys of `keys` are in `done` (the in-order prefix a reorder buffer may pass on)."""
    count = 0
    while count < len(keys) and keys[count] in done:
        count += 1
    return count
