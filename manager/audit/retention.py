"""The audit log's retention: rows older than VLLM_MANAGER_AUDIT_RETENTION_DAYS are deleted when the
manager starts, then once a day."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from datetime import datetime

from sqlalchemy.engine import Engine

from manager.audit import store
from manager.db import session
from manager.schemas.common import utcnow

log = logging.getLogger("vllm_manager.audit")

EVERY_S = 86400.0


class AuditRetention:
    def __init__(
        self, engine: Engine, days: float, every_s: float = EVERY_S, clock: Callable[[], datetime] = utcnow
    ) -> None:
        self.engine = engine
        self.days = days
        self.every_s = every_s
        self._clock = clock
        self._task: asyncio.Task[None] | None = None

    def prune(self) -> int:
        """Delete the rows past the retention now; how many went (0, logged, when the store refuses)."""
        try:
            with session(self.engine) as db:
                removed = store.remove_older_than(db, self.days, self._clock())
        except Exception as exc:
            log.warning("old audit rows could not be deleted (%s); trying again in %g s", exc, self.every_s)
            return 0
        if removed:
            log.info("%d audit rows older than %g days deleted", removed, self.days)
        return removed

    def start(self) -> None:
        """Prune now, then every ``every_s`` on the event loop (the deleting in a thread)."""
        self.prune()
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name="audit retention")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.every_s)
            await asyncio.to_thread(self.prune)
