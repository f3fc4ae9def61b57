"""What the front door's scheduler knows of one model config: the GPUs and bytes its worker takes,
its nodes, its timeouts, whether and how it sleeps, and how its replicas scale. The front door makes
one from each stored config (``front_door.placement_of``); the scheduler only reads them.
"""

from __future__ import annotations

from dataclasses import dataclass

from manager.frontdoor.replica_scale import Scaling
from manager.placement import Need


@dataclass(frozen=True)
class Placement:
    """What the scheduler needs to know of one model config."""

    config: str
    gpus: tuple[int, ...]  # the GPU ids its worker uses
    gpu_bytes: int | None  # what it takes on each (vLLM's gpu_memory_utilization share); None: unknown
    start_timeout_s: float
    idle_timeout_s: float | None = None
    persistent: bool = False
    sleep_level: int | None = None  # vLLM sleep mode: 1 or 2; None: off
    sleep_host_bytes: int | None = None  # host RAM its sleep keeps (level 1: the weights); None: unknown
    sleep_pooled: bool = False  # level 1 through the sleep pool, whose RAM its start already counted
    wait_for_download: bool = False  # a request waits while its model downloads (else 503 + Retry-After)
    # The nodes its config allows (None: any node, or this box without a cluster).
    nodes: tuple[str | None, ...] | None = None
    # Its gpu_memory_utilization: the bytes it takes on a node's GPUs where gpu_bytes is None (a cluster,
    # whose nodes' GPUs may differ from this box's).
    gpu_share: float | None = None
    gpus_pinned: bool = False  # its config names its GPUs: its replicas use those, not others
    at_once: int = 256  # requests one of its engines runs at once (max_num_seqs); more wait in its queue
    scaling: Scaling | None = None  # its replicas' bounds when they scale with the load; None: they don't
    # How long its worker stays once swapped in for requests, unless idle (0: off); None: its last
    # swap-in time plus a margin (``placement.residency``).
    min_residency_s: float | None = 0.0

    def need(self, waiting: int = 0) -> Need:
        """What ``manager.placement`` is asked to find room for, with ``waiting`` requests waiting for it."""
        return Need(self.config, self.gpus, self.gpu_bytes, self.nodes, self.gpu_share, waiting)
