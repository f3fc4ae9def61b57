"""Worker states and the restart backoff rule."""

from __future__ import annotations

from enum import StrEnum


class State(StrEnum):
    STOPPED = "stopped"
    STARTING = "starting"
    READY = "ready"
    STOPPING = "stopping"
    FAILED = "failed"  # did not become ready, or crashed past the restart ceiling
    CRASHED = "crashed"  # died while ready; a restart is scheduled (backing off)


ACTIVE = {State.STARTING, State.READY, State.STOPPING, State.CRASHED}


def backoff_delay(restart_number: int, base_s: float = 10.0, cap_s: float = 300.0) -> float:
    """Delay before the n-th restart in a row: base x 2^(n-1), capped (10, 20, 40, ... 300 s)."""
    n = max(1, restart_number)
    return min(cap_s, base_s * 2 ** (n - 1))
