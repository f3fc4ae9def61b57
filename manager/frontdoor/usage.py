"""Usage of /v1, counted as requests end and written to SQLite every few seconds, off the request path.

A request adds to a counter in memory (microseconds); the recorder's own task writes the counters
(per minute, inference key and model config) and the keys' last use, and the last of them when the
manager stops. It runs on the event loop; the writing itself runs in a thread.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from datetime import datetime

from sqlalchemy.engine import Engine

from manager.db import session
from manager.frontdoor.metering import Tokens
from manager.periodic import Periodic
from manager.schemas.common import utcnow
from manager.schemas.usage import NO_KEY
from manager.services import inference_keys, usage

log = logging.getLogger("vllm_manager.frontdoor")

FLUSH_S = 5.0


class UsageRecorder:
    def __init__(self, engine: Engine, flush_s: float = FLUSH_S, clock: Callable[[], float] = time.time) -> None:
        self.engine = engine
        self.flush_s = flush_s
        self._clock = clock
        self._counts: dict[tuple[int, int, str], usage.Counts] = {}  # by (minute, key id, model config)
        self._used: dict[int, datetime] = {}  # each key's last use
        self._writing = asyncio.Lock()
        self._rounds = Periodic("usage recorder", flush_s, self.flush, log)

    def key_used(self, key_id: int) -> None:
        if key_id != NO_KEY:
            self._used[key_id] = utcnow()

    def count(self, key_id: int, model: str, tokens: Tokens | None, error: bool) -> None:
        """One request to ``model`` has ended; ``tokens``: what its answer said it used, if it said."""
        minute = int(self._clock() // 60) * 60
        counts = self._counts.get((minute, key_id, model))
        if counts is None:
            counts = self._counts[(minute, key_id, model)] = usage.Counts()
        counts.requests += 1
        counts.errors += int(error)
        if tokens is not None:
            counts.prompt_tokens += tokens.prompt
            counts.completion_tokens += tokens.completion

    def pending_tokens(self, key_id: int, since: float) -> int:
        """Tokens of the key counted from ``since`` on and not written yet."""
        return sum(
            c.prompt_tokens + c.completion_tokens
            for (minute, key, _), c in self._counts.items()
            if key == key_id and minute >= since
        )

    def tokens_since(self, key_id: int, since: float) -> int:
        """What the key's requests used from ``since`` on: the stored usage and what is still to be written."""
        with session(self.engine) as db:
            stored = usage.tokens_since(db, key_id, int(since))
        return stored + self.pending_tokens(key_id, since)

    async def flush(self) -> None:
        """Write what was counted since the last write; kept for the next one if the store refuses it."""
        async with self._writing:
            counts, used = self._counts, self._used
            if not counts and not used:
                return
            self._counts, self._used = {}, {}
            try:
                await asyncio.to_thread(self._write, counts, used)
            except Exception as exc:
                log.warning("usage could not be written (%s); trying again in %g s", exc, self.flush_s)
                self._merge_back(counts, used)

    def _write(self, counts: dict[tuple[int, int, str], usage.Counts], used: dict[int, datetime]) -> None:
        with session(self.engine) as db:
            usage.add(db, [usage.Row(minute, key_id, model, c) for (minute, key_id, model), c in counts.items()])
            inference_keys.mark_used(db, used)
            db.commit()

    def _merge_back(self, counts: dict[tuple[int, int, str], usage.Counts], used: dict[int, datetime]) -> None:
        for bucket, old in counts.items():
            now = self._counts.get(bucket)
            self._counts[bucket] = old if now is None else old.plus(now)
        for key_id, when in used.items():
            self._used.setdefault(key_id, when)

    def start(self) -> None:
        self._rounds.start()

    async def stop(self) -> None:
        await self._rounds.stop()
        await self.flush()
