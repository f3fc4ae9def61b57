"""What the expert cache reports: one small record, published on the plugin's stats channel."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass

from engine_patches.stats import publish as channel_publish

log = logging.getLogger(__name__)

CHANNEL = "expert_cache"


def link_bytes_per_token(bytes_moved: float, streamed_bytes: float, tokens: float) -> float:
    """Bytes over the link per token: copied into the cache and read in place; 0 with no tokens."""
    return (bytes_moved + streamed_bytes) / tokens if tokens else 0.0


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
    # Fetching ahead on a guess at the next layer's experts (their bytes are in bytes_moved too):
    ahead_experts: int = 0  # experts loaded ahead
    ahead_used: int = 0  # of those, the ones the layer's real batch then used
    ahead_wasted: int = 0  # and the ones it did not use (they stay cached, but cost link time now)
    ahead_bytes: int = 0
    ahead_wasted_bytes: int = 0

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0

    @property
    def ahead_hit_rate(self) -> float:
        """Share of the experts loaded ahead that the real batch used (0 with none judged yet)."""
        judged = self.ahead_used + self.ahead_wasted
        return self.ahead_used / judged if judged else 0.0

    @property
    def bytes_per_token(self) -> float:
        return link_bytes_per_token(self.bytes_moved, self.streamed_bytes, self.tokens)

    @property
    def hidden_time_s(self) -> float:
        return max(0.0, self.copy_time_s - self.exposed_time_s)

    def as_dict(self) -> dict:
        d = asdict(self)
        d.update(
            hit_rate=self.hit_rate,
            ahead_hit_rate=self.ahead_hit_rate,
            bytes_per_token=self.bytes_per_token,
            hidden_time_s=self.hidden_time_s,
        )
        return d


def publish(stats: ExpertCacheStats) -> bool:
    """Put ``stats`` on the plugin's stats channel (``engine_patches.stats``); False if that failed."""
    try:
        channel_publish(CHANNEL, stats.as_dict())
    except Exception:  # stats must never take the engine down
        log.warning("could not publish expert cache stats", exc_info=True)
        return False
    return True


class Publisher:
    """Publishes ``read()`` every ``interval_s`` from a daemon thread, when it changed.

    Decode steps replayed from a CUDA graph run no Python, so nothing on the engine's side could
    publish them; ``read`` must therefore be safe beside the engine (no CUDA call, no wait):
    ``ExpertOffload.stats(sync=False)``."""

    def __init__(self, read: Callable[[], ExpertCacheStats], interval_s: float = 1.0) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.read, self.interval_s = read, interval_s
        self.last: ExpertCacheStats | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="engine-patches-moe-stats", daemon=True)

    def start(self) -> Publisher:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5 * self.interval_s)

    def tick(self) -> bool:
        """Publish once if the counters changed; True if it did."""
        try:
            now = self.read()
        except Exception:  # stats must never take the engine down
            log.warning("could not read expert cache stats", exc_info=True)
            return False
        if now == self.last:
            return False
        self.last = now
        return publish(now)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.tick()
