"""A task on the event loop that does one round of some upkeep every so many seconds until stopped.

A round that raises is logged and the next one runs all the same: one bad round (a locked store, an
engine that did not answer) must not end the upkeep for good.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable


class Periodic:
    def __init__(self, name: str, every_s: float, round_: Callable[[], Awaitable[object]], log: logging.Logger) -> None:
        self.name = name
        self.every_s = every_s
        self._round = round_
        self._log = log
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """The first round after ``every_s``; starting twice starts one task."""
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name=self.name)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.every_s)
            try:
                await self._round()
            except Exception:
                self._log.exception("%s failed; the next round is in %g s", self.name, self.every_s)
