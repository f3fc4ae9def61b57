"""What the expert cache reports: one small record, published on the plugin's stats channel."""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass

from engine_patches.stats import publish as channel_publish

log = logging.getLogger(__name__)

CHANNEL = "expert_cache"


@dataclass(frozen=True)
class ExpertCacheStats:
    mode: str  # "cached" or "copy_all"
    gpu_cache_bytes: int  # GPU bytes held by cache slots (or copy-all staging buffers)
    host_bytes: int  # expert bytes in host memory
    pinned: bool  # False means every copy runs about 6x slower: fix the host allocation
    hits: int  # needed experts found resident, summed over layers and batches
    misses: int  # experts copied in
    bytes_moved: int  # host-to-GPU bytes
    tokens: int  # tokens that went through the whole MoE stack
    copy_time_s: float  # time the copies ran
    exposed_time_s: float  # part of it the compute stream sat waiting
    timed: bool  # False: copy times were not measured (they cost a few events per layer)
    streamed_layers: int = 0  # layer calls whose experts were read in place from host memory
    streamed_bytes: int = 0  # expert bytes those calls read over the link (not in bytes_moved)

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0

    @property
    def bytes_per_token(self) -> float:
        """Bytes over the link per token: copied into the cache and read in place."""
        return (self.bytes_moved + self.streamed_bytes) / self.tokens if self.tokens else 0.0

    @property
    def hidden_time_s(self) -> float:
        return max(0.0, self.copy_time_s - self.exposed_time_s)

    def as_dict(self) -> dict:
        d = asdict(self)
        d.update(hit_rate=self.hit_rate, bytes_per_token=self.bytes_per_token, hidden_time_s=self.hidden_time_s)
        return d


def publish(stats: ExpertCacheStats) -> bool:
    """Put ``stats`` on the plugin's stats channel (``engine_patches.stats``); False if that failed."""
    try:
        channel_publish(CHANNEL, stats.as_dict())
    except Exception:  # stats must never take the engine down
        log.warning("could not publish expert cache stats", exc_info=True)
        return False
    return True
