"""In-memory time series: one fixed-size ring buffer per series, one point per sample.

Two flat ``array('d')`` per series (16 bytes a point) rather than a deque of tuples (about 100):
an hour of 1 s samples for a hundred series is 6 MB instead of 35. A missing value is stored as
NaN and comes back as None, so a chart shows a gap rather than a false zero.
"""

from __future__ import annotations

import math
import threading
from array import array
from collections.abc import Mapping
from dataclasses import dataclass

ONE_HOUR_AT_1S = 3600
DEFAULT_CAPACITY = 2 * ONE_HOUR_AT_1S  # headroom over the hour the 1 h chart needs

Point = tuple[float, float | None]


class RingBuffer:
    """The newest ``capacity`` (time, value) points, oldest overwritten first; times only grow."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"a ring buffer needs room for at least one point, got capacity={capacity}")
        self.capacity = capacity
        self._t = array("d", bytes(8 * capacity))
        self._v = array("d", bytes(8 * capacity))
        self._next = 0  # slot the next point goes into
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def append(self, t: float, value: float | None) -> None:
        self._t[self._next] = t
        self._v[self._next] = math.nan if value is None else float(value)
        self._next = (self._next + 1) % self.capacity
        self._size = min(self._size + 1, self.capacity)

    def _slot(self, i: int) -> int:
        """Slot of the i-th oldest point."""
        return (self._next - self._size + i) % self.capacity

    def since(self, t0: float) -> list[Point]:
        """Points with time >= t0, oldest first."""
        # Binary search on the logical order: times are increasing.
        lo, hi = 0, self._size
        while lo < hi:
            mid = (lo + hi) // 2
            if self._t[self._slot(mid)] < t0:
                lo = mid + 1
            else:
                hi = mid
        out = []
        for i in range(lo, self._size):
            s = self._slot(i)
            v = self._v[s]
            out.append((self._t[s], None if math.isnan(v) else v))
        return out

    def latest(self) -> Point | None:
        if not self._size:
            return None
        s = self._slot(self._size - 1)
        v = self._v[s]
        return (self._t[s], None if math.isnan(v) else v)

    def oldest_time(self) -> float | None:
        return self._t[self._slot(0)] if self._size else None


@dataclass(frozen=True)
class SeriesWindow:
    name: str
    points: list[Point]


class SeriesStore:
    """Ring buffers by series name ("gpu.0.memory_used_bytes", "worker.w1.generation_tokens_per_s").

    The collector is the only writer; readers (routes, the history writer) may be on other threads.
    """

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self.capacity = capacity
        self._buffers: dict[str, RingBuffer] = {}
        self._lock = threading.Lock()

    def add(self, t: float, values: Mapping[str, float | None]) -> None:
        with self._lock:
            for name, value in values.items():
                buf = self._buffers.get(name)
                if buf is None:
                    buf = self._buffers[name] = RingBuffer(self.capacity)
                buf.append(t, value)

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._buffers)

    def window(self, name: str, seconds: float, now: float) -> SeriesWindow:
        """The last ``seconds`` before ``now``; an unknown series gives no points."""
        with self._lock:
            buf = self._buffers.get(name)
            return SeriesWindow(name, buf.since(now - seconds) if buf else [])

    def oldest_time(self, name: str) -> float | None:
        """Time of the oldest point still held (older ones were overwritten or never taken)."""
        with self._lock:
            buf = self._buffers.get(name)
            return buf.oldest_time() if buf else None

    def latest(self, name: str) -> Point | None:
        with self._lock:
            buf = self._buffers.get(name)
            return buf.latest() if buf else None

    def drop(self, keep: set[str]) -> None:
        """Forget series not in ``keep`` (e.g. of deleted workers) so memory stays bounded."""
        with self._lock:
            for name in list(self._buffers):
                if name not in keep:
                    del self._buffers[name]
