"""The supervision rules: how often an engine is looked at, when a crash is given up on, how long a
restart waits. ``lifecycle.step`` applies them; the runner waits as ``tick_interval`` says."""

from __future__ import annotations

from dataclasses import dataclass

from manager.supervisor.worker_state import SERVING, Life, State


def backoff_delay(restart_number: int, base_s: float = 10.0, cap_s: float = 300.0) -> float:
    """Delay before the n-th restart in a row: base x 2^(n-1), capped (10, 20, 40, ... 300 s)."""
    n = max(1, restart_number)
    return min(cap_s, base_s * 2 ** (n - 1))


@dataclass(frozen=True)
class Policy:
    """The supervision rules (from the settings)."""

    health_interval_s: float = 5.0
    health_failures_before_crash: int = 3
    healthy_reset_s: float = 600.0
    restart_ceiling: int = 5
    backoff_base_s: float = 10.0
    backoff_cap_s: float = 300.0
    stop_grace_s: float = 20.0


def tick_interval(life: Life, now: float, policy: Policy) -> float | None:
    """How long the runner may wait for a command before it must look at the engine again."""
    if life.state == State.STARTING:
        return 0.5
    if life.state in SERVING:
        return policy.health_interval_s
    if life.state == State.CRASHED and life.next_restart_at is not None:
        return max(0.05, min(1.0, life.next_restart_at - now))
    return None
