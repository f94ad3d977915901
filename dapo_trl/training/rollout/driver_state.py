"""The streaming driver's engine lifecycle as a state machine: its states and the moves between them
(`RolloutDriver._enter` is the one place that makes them)."""

from __future__ import annotations

from enum import Enum


class EngineState(Enum):
    """What the driver's engine is doing. `RolloutDriver._enter` is the one place that changes it, along `MOVES`."""

    READY = "ready"  # admitting requests under the loaded version (or about to load one)
    LOADING = "loading"  # the driver's thread loads a version; a sync from outside waits (`loaded_externally`)
    RECOVERING = "recovering"  # the engine went away: admission waits until it answers again
    RESTORING = "restoring"  # it answers again; the weights a sync from outside had set are loaded again
    FAILED = "failed"  # an error every caller raises (`_error`)
    CLOSED = "closed"


MOVES = {
    EngineState.READY: {EngineState.LOADING, EngineState.RECOVERING},
    EngineState.LOADING: {EngineState.READY, EngineState.RECOVERING},
    EngineState.RECOVERING: {EngineState.RESTORING, EngineState.READY},
    EngineState.RESTORING: {EngineState.READY},
    EngineState.FAILED: set(),
    EngineState.CLOSED: set(),
}  # and from every state but CLOSED to FAILED or CLOSED
