"""The front door's count of each model's replicas: requests in flight and served per worker, when
each last answered, and how many requests each ready replica has had in flight lately. The scheduler
owns one; ``replica_choice`` picks a replica from these counts and ``replica_scale`` decides from them.

"Lately" is a moving mean over about ``SMOOTHING_S``: requests that come and go (a client's own
pause between two requests empties a queue for a moment) do not make a queue look gone, and a burst
shorter than that does not make one.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

from manager.frontdoor.replica_choice import choose
from manager.frontdoor.replica_scale import ReplicaState
from manager.supervisor.view import WorkerView
from manager.supervisor.worker_state import State

SMOOTHING_S = 3.0


@dataclass
class _Counts:
    in_flight: dict[int, int] = field(default_factory=dict)
    served: dict[int, int] = field(default_factory=dict)
    last_done: dict[int, float] = field(default_factory=dict)
    ready_seen: dict[int, float] = field(default_factory=dict)
    ready: int = 0  # replicas ready when last seen
    load: int = 0  # requests in flight over all of them
    mean: float = 0.0  # requests in flight per ready replica, over about SMOOTHING_S
    since: float | None = None  # when ``mean`` was last brought up to date
    saturated_since: float | None = None  # ``mean`` above what one engine runs at once since then


class Replicas:
    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._of: dict[str, _Counts] = {}

    def pick(
        self, config: str, ready: Sequence[WorkerView], affinity: str | None = None, avoid: Collection[int] = ()
    ) -> WorkerView:
        """The ready replica a request goes to, counted as in flight there."""
        counts = self._counts(config)
        chosen = choose([v.id for v in ready], counts.in_flight, counts.served, affinity, avoid)
        self._advance(counts, len(ready))
        counts.load += 1
        counts.in_flight[chosen] = counts.in_flight.get(chosen, 0) + 1
        counts.served[chosen] = counts.served.get(chosen, 0) + 1
        return next(v for v in ready if v.id == chosen)

    def released(self, config: str, worker_id: int) -> None:
        counts = self._counts(config)
        self._advance(counts, counts.ready)
        counts.load = max(0, counts.load - 1)
        left = counts.in_flight.get(worker_id, 0) - 1
        if left > 0:
            counts.in_flight[worker_id] = left
        else:
            counts.in_flight.pop(worker_id, None)
        counts.last_done[worker_id] = self._clock()

    def in_flight(self, config: str, worker_id: int) -> int:
        return self._counts(config).in_flight.get(worker_id, 0)

    def saturated_since(self, config: str, at_once: int) -> float | None:
        """Since when the ready replicas have had, on the moving mean, more requests in flight than one
        engine runs at once (``at_once``: its max_num_seqs), so that the rest wait in its queue."""
        counts = self._counts(config)
        self._advance(counts, counts.ready)
        if counts.mean <= at_once:
            counts.saturated_since = None
        elif counts.saturated_since is None:
            counts.saturated_since = self._clock()
        return counts.saturated_since

    def mean_in_flight(self, config: str) -> float:
        counts = self._counts(config)
        self._advance(counts, counts.ready)
        return counts.mean

    def states(self, config: str, views: Sequence[WorkerView]) -> list[ReplicaState]:
        """The replicas among ``views`` (the config's current workers), for ``replica_scale``."""
        counts = self._counts(config)
        now = self._clock()
        out = []
        for view in views:
            ready = view.state == State.READY
            if not ready:
                counts.ready_seen.pop(view.id, None)
            else:
                counts.ready_seen.setdefault(view.id, now)
            busy = counts.in_flight.get(view.id, 0)
            idle_since = None
            if ready and busy == 0:
                idle_since = max(counts.ready_seen[view.id], counts.last_done.get(view.id, 0.0))
            out.append(ReplicaState(view.id, ready, busy, idle_since))
        self._advance(counts, sum(1 for s in out if s.ready))
        return out

    def forget(self, config: str, worker_id: int) -> None:
        """A replica removed: its counts go with it."""
        counts = self._counts(config)
        for table in (counts.in_flight, counts.served, counts.last_done, counts.ready_seen):
            table.pop(worker_id, None)

    def _advance(self, counts: _Counts, ready: int) -> None:
        """Bring the moving mean up to now, then take ``ready`` as the count of ready replicas (the same
        requests spread over more replicas make fewer per replica, at once)."""
        now = self._clock()
        if counts.since is not None and counts.ready:
            weight = 1.0 - math.exp(-max(0.0, now - counts.since) / SMOOTHING_S)
            counts.mean += (counts.load / counts.ready - counts.mean) * weight
        counts.since = now
        if ready != counts.ready:
            counts.mean = counts.mean * counts.ready / ready if ready else 0.0
            counts.ready = ready

    def _counts(self, config: str) -> _Counts:
        counts = self._of.get(config)
        if counts is None:
            counts = self._of[config] = _Counts()
        return counts
