"""What the streaming driver's engine did between two steps (`DriverStats`), and the `rollout/*` metrics made of it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class DriverStats:
    """What the engine did since the last `take_metrics`."""

    since: float = field(default_factory=time.monotonic)
    busy: float = 0.0  # seconds with at least one request in flight
    completed_groups: int = 0
    generated_tokens: int = 0
    cancelled_groups: int = 0
    discarded_tokens: int = 0  # completed, then not used (admitted ahead for a batch that was already full)
    loads_in_flight: int = 0  # weights versions loaded while requests ran (in-flight weight updates)
    switched_groups: int = 0  # completed groups that a newer version took over inside
    restored_groups: int = 0  # groups a checkpoint kept, finished or continued instead of generated again
    busy_since: float | None = None  # when requests of ours began to run (None: none runs)

    def running(self, any_running: bool) -> None:
        """Whether requests of ours run now: busy time accrues while they do."""
        now = time.monotonic()
        if any_running and self.busy_since is None:
            self.busy_since = now
        elif not any_running and self.busy_since is not None:
            self.busy, self.busy_since = self.busy + now - self.busy_since, None

    def next_period(self) -> DriverStats:
        """This period's figures end now; the next period's start (busy still, if requests run)."""
        now = time.monotonic()
        if self.busy_since is not None:
            self.busy += now - self.busy_since
        return DriverStats(since=now, busy_since=None if self.busy_since is None else now)


def driver_metrics(stats: DriverStats, trainer_wait: float) -> dict[str, float]:
    """The `rollout/*` metrics of one generation batch from the driver's counters."""
    wall = max(time.monotonic() - stats.since, 1e-9)
    return {
        "rollout/engine_busy_fraction": min(stats.busy / wall, 1.0),
        "rollout/trainer_wait_fraction": min(trainer_wait / wall, 1.0),
        "rollout/groups_per_second": stats.completed_groups / wall,
        "rollout/generated_tokens": float(stats.generated_tokens),
        "rollout/cancelled_groups": float(stats.cancelled_groups),
        "rollout/discarded_tokens": float(stats.discarded_tokens),
        "rollout/weight_loads_in_flight": float(stats.loads_in_flight),
        "rollout/groups_switched_in_flight": float(stats.switched_groups),
        "rollout/groups_restored": float(stats.restored_groups),
    }
