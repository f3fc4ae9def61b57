"""Host RAM: the sleepers to stop so that a start on a node gets the RAM it lacks, and what a
worker's sleep keeps there. Pure.

Sleeping workers hold no GPU memory, but a level-1 sleeper keeps its weights in its node's host RAM.
Only the sleepers on the node of the start count (stopping one elsewhere frees nothing there), and
only those known to hold RAM (a level-2 sleeper, or one whose size is not known, frees nothing the
start was refused for). Persistent ones never go; the least recently used go first, and only as many
as it takes.
"""

from __future__ import annotations

from collections.abc import Sequence

from manager.placement.decisions import CannotFit, FreeHostRam
from manager.placement.one_node import gib, lru_time
from manager.placement.snapshot import SleepingWorker


def free_host_ram(
    sleeping: Sequence[SleepingWorker], short_bytes: int, config: str, node: str | None = None
) -> FreeHostRam | CannotFit:
    """The sleepers on ``node`` to stop so that ``config``'s start there gets ``short_bytes`` more."""
    here = [w for w in sleeping if w.node == node]
    candidates = sorted(
        (w for w in here if w.config != config and not w.persistent and w.host_bytes),
        key=lambda w: (lru_time(w.last_request_at), w.id),
    )
    chosen: list[SleepingWorker] = []
    left = short_bytes
    for worker in candidates:
        if left <= 0:
            break
        chosen.append(worker)
        left -= worker.host_bytes or 0
    if left > 0:
        held = [w for w in here if w.persistent and w.host_bytes]
        names = ", ".join(f"{w.config} (worker {w.id}, {gib(w.host_bytes or 0)})" for w in held)
        blame = f"; the rest is held by {names}, persistent (never stopped)" if held else ""
        where = f" on node {node}" if node is not None else ""
        return CannotFit(
            f"{config} needs {gib(short_bytes)} more host RAM{where}: stopping every sleeping model frees only "
            f"{gib(short_bytes - left)}{blame}",
            tuple(w.id for w in held),
        )
    # An earlier pick may have become unnecessary once a bigger one was taken: keep the recent ones.
    for worker in reversed(list(chosen)):
        if left + (worker.host_bytes or 0) <= 0:
            chosen.remove(worker)
            left += worker.host_bytes or 0
    return FreeHostRam(tuple(w.id for w in chosen), node)


def sleep_level_of(current: int | None, configured: int | None) -> int:
    """The level a sleeping worker sleeps at: the one it was put to sleep with, else its config's, else 1
    (vLLM's default)."""
    return current or configured or 1
