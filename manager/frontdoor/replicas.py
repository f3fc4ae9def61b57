"""The front door's count of each model's replicas: requests in flight and served per worker, when
each last answered, and since when every ready replica has had a full queue. The scheduler owns one;
``replica_choice`` picks a replica from these counts and ``replica_scale`` decides from them."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

from manager.frontdoor.replica_choice import choose
from manager.frontdoor.replica_scale import ReplicaState
from manager.supervisor.lifecycle import State
from manager.supervisor.view import WorkerView


@dataclass
class _Counts:
    in_flight: dict[int, int] = field(default_factory=dict)
    served: dict[int, int] = field(default_factory=dict)
    last_done: dict[int, float] = field(default_factory=dict)
    ready_seen: dict[int, float] = field(default_factory=dict)
    saturated_since: float | None = None  # every ready replica had max_num_seqs in flight since then


class Replicas:
    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._of: dict[str, _Counts] = {}

    def pick(
        self,
        config: str,
        ready: Sequence[WorkerView],
        at_once: int,
        affinity: str | None = None,
        avoid: Collection[int] = (),
    ) -> WorkerView:
        """The ready replica a request goes to (``at_once``: how many requests one engine runs at once)."""
        counts = self._counts(config)
        chosen = choose([v.id for v in ready], counts.in_flight, counts.served, affinity, avoid)
        counts.in_flight[chosen] = counts.in_flight.get(chosen, 0) + 1
        counts.served[chosen] = counts.served.get(chosen, 0) + 1
        if counts.saturated_since is None and all(counts.in_flight.get(v.id, 0) > at_once for v in ready):
            counts.saturated_since = self._clock()
        return next(v for v in ready if v.id == chosen)

    def released(self, config: str, worker_id: int, at_once: int) -> None:
        counts = self._counts(config)
        left = counts.in_flight.get(worker_id, 0) - 1
        if left > 0:
            counts.in_flight[worker_id] = left
        else:
            counts.in_flight.pop(worker_id, None)
        counts.last_done[worker_id] = self._clock()
        if left <= at_once:
            counts.saturated_since = None

    def in_flight(self, config: str, worker_id: int) -> int:
        return self._counts(config).in_flight.get(worker_id, 0)

    def saturated_since(self, config: str) -> float | None:
        return self._counts(config).saturated_since

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
        return out

    def _counts(self, config: str) -> _Counts:
        counts = self._of.get(config)
        if counts is None:
            counts = self._of[config] = _Counts()
        return counts
