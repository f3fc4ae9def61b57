"""The audit log's retention: rows older than VLLM_MANAGER_AUDIT_RETENTION_DAYS are deleted when the
manager starts, then once a day."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from datetime import datetime

from sqlalchemy.engine import Engine

from manager.audit import store
from manager.db import session
from manager.periodic import Periodic
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
        self._rounds = Periodic("audit retention", every_s, lambda: asyncio.to_thread(self.prune), log)

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
        self._rounds.start()

    async def stop(self) -> None:
        await self._rounds.stop()
