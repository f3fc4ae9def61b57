"""The one decision: where a model starts, and what must give way first. Pure.

Each node the need may use is checked on its own (``one_node.on_node``), with only the workers on
that node: GPU 0 of one node is not GPU 0 of another. The first node where the model fits as things
are is taken; else the node where making room frees the fewest bytes (then the fewest workers, then
the snapshot's order); else one whose busy workers must first drain; else it fits nowhere, with each
node's reason.
"""

from __future__ import annotations

from dataclasses import replace

from manager.placement.decisions import CannotFit, Decision, MakeRoom, Place, WaitForDrain
from manager.placement.one_node import Evict, on_node
from manager.placement.snapshot import Need, RunningWorker, Snapshot


def decide(need: Need, snapshot: Snapshot) -> Decision:
    names = need.nodes if need.nodes is not None else tuple(n.name for n in snapshot.nodes)
    if not names:
        return CannotFit(
            f"{need.config} has no node to run on: the node its config names is lost or not in the cluster"
        )
    by_node: dict[str | None, list[RunningWorker]] = {name: [] for name in names}
    for worker in snapshot.workers:
        if worker.node in by_node:
            by_node[worker.node].append(worker)
    best: tuple[tuple[int, int], str | None, Evict] | None = None
    drain: WaitForDrain | None = None
    refused: list[tuple[str | None, CannotFit]] = []
    for name in names:
        outcome = on_node(snapshot.node(name), by_node[name], need, snapshot.now)
        if isinstance(outcome, Evict):
            if not outcome.sleep and not outcome.stop:
                return Place(name, need.gpus)
            if best is None or outcome.freed < best[0]:
                best = (outcome.freed, name, outcome)
        elif isinstance(outcome, WaitForDrain):
            drain = drain or replace(outcome, node=name)
        else:
            refused.append((name, outcome))
    if best is not None:
        _, name, evict = best
        return MakeRoom(
            sleep=tuple(w.id for w in evict.sleep),
            stop=tuple(w.id for w in evict.stop),
            then=Place(name, need.gpus),
        )
    if drain is not None:
        return drain
    if len(refused) == 1:
        name, only = refused[0]
        return CannotFit(only.reason, only.blockers, ((name, only.reason),))
    reason = f"{need.config} fits on no node: " + "; ".join(f"{name}: {r.reason}" for name, r in refused)
    blockers = tuple(b for _, r in refused for b in r.blockers)
    return CannotFit(reason, blockers, tuple((name, r.reason) for name, r in refused))
