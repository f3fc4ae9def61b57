"""One value, many waiters: how every SSE client gets the same snapshot without sampling again.

The collector publishes once a second; each subscriber awaits the next publication. A slow
subscriber skips to the newest value instead of queueing old ones, so a stalled browser tab costs
no memory and never delays the others. All calls must come from the event loop's thread.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Generic, TypeVar

T = TypeVar("T")


class Broadcast(Generic[T]):
    def __init__(self) -> None:
        self._value: T | None = None
        self._seq = 0
        self._changed = asyncio.Event()
        self._closed = False
        self.subscribers = 0  # live subscribe() iterators, for the dashboard and the bench

    @property
    def seq(self) -> int:
        """How many values were published so far; 0 means none yet."""
        return self._seq

    @property
    def latest(self) -> T | None:
        return self._value

    @property
    def closed(self) -> bool:
        return self._closed

    def publish(self, value: T) -> None:
        if self._closed:
            raise RuntimeError("publish() after close(): the collector was stopped")
        self._value = value
        self._seq += 1
        self._wake()

    def close(self) -> None:
        """Ends every subscription (at shutdown), so SSE responses finish instead of hanging."""
        self._closed = True
        self._wake()

    def _wake(self) -> None:
        # A fresh Event per publication: waiters hold the old one, which is set exactly once.
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def next_after(self, seq: int, timeout: float | None = None) -> tuple[int, T] | None:
        """The first value published after ``seq``, with its number; None if closed or timed out."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while self._seq <= seq and not self._closed:
            changed = self._changed
            remaining = None if deadline is None else deadline - loop.time()
            if remaining is not None and remaining <= 0:
                return None
            try:
                await asyncio.wait_for(changed.wait(), remaining)
            except TimeoutError:
                return None
        if self._closed:
            return None
        return self._seq, self._value  # type: ignore[return-value]

    async def subscribe(self, *, include_latest: bool = True) -> AsyncIterator[T]:
        """Yields the latest value at once (if any and ``include_latest``), then each newer one."""
        seq = self._seq - 1 if include_latest and self._seq else self._seq
        self.subscribers += 1
        try:
            while (item := await self.next_after(seq)) is not None:
                seq, value = item
                yield value
        finally:
            self.subscribers -= 1
