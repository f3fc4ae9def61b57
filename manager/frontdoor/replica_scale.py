"""Whether a model's replicas should grow or shrink now. Pure.

A replica is added when the ready replicas have had more requests in flight each than one engine runs
at once (its max_num_seqs: the rest wait in the engine's queue), on a moving mean of a few seconds,
for ``up_after_s``, while there are fewer than ``max_replicas``. One is removed when a replica above
``min_replicas`` has had no request for ``down_after_s``: the newest idle one. Nothing changes while
a replica is still coming up, nor for a model with no replica running (it was stopped, or unloaded
when idle: a request brings it back).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Scaling:
    least: int  # min_replicas
    most: int  # max_replicas
    up_after_s: float
    down_after_s: float


@dataclass(frozen=True)
class ReplicaState:
    worker_id: int
    ready: bool  # False: still starting, waking or downloading
    in_flight: int
    idle_since: float | None  # since when it has had no request (None: busy, or not ready)


@dataclass(frozen=True)
class Add:
    reason: str


@dataclass(frozen=True)
class Remove:
    worker_id: int
    reason: str


def scale_step(
    replicas: Sequence[ReplicaState], scaling: Scaling, saturated_since: float | None, now: float
) -> Add | Remove | None:
    count = len(replicas)
    if count == 0 or not all(r.ready for r in replicas):
        return None
    if count < scaling.least:
        return Add(f"{count} replica(s) run, fewer than min_replicas {scaling.least}")
    if saturated_since is not None and count < scaling.most:
        queued_s = now - saturated_since
        if queued_s >= scaling.up_after_s:
            return Add(f"requests queued beyond what its engines run at once for {queued_s:.0f} s")
    if count > scaling.least:
        idle_for = [now - r.idle_since for r in replicas if r.in_flight == 0 and r.idle_since is not None]
        if idle_for and max(idle_for) >= scaling.down_after_s:
            # The load leaves a replica idle this long: one goes, the newest idle one (the oldest keep
            # what their prefix caches hold).
            newest = max(r.worker_id for r in replicas if r.in_flight == 0)
            return Remove(newest, f"no request for {max(idle_for):.0f} s")
    return None
