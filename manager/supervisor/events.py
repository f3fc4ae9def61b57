"""The event log: every transition and action, stored in SQLite and pushed to live listeners."""

from __future__ import annotations

import asyncio
import logging

from sqlalchemy.engine import Engine
from sqlmodel import col, select

from manager.db import session
from manager.schemas.event import Event

log = logging.getLogger("vllm_manager.events")


class EventLog:
    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._listeners: set[asyncio.Queue[dict]] = set()

    def record(self, kind: str, message: str, worker_id: int | None = None, **data) -> dict:
        event = Event(kind=kind, message=message, worker_id=worker_id, data=data)
        with session(self._engine) as db:
            db.add(event)
            db.commit()
            db.refresh(event)
        public = event.model_dump(mode="json")
        log.info("worker %s: %s: %s", worker_id, kind, message)
        for queue in list(self._listeners):
            if queue.qsize() < 1000:
                queue.put_nowait(public)
        return public

    def recent(self, worker_id: int | None = None, limit: int = 100) -> list[dict]:
        with session(self._engine) as db:
            query = select(Event).order_by(col(Event.id).desc()).limit(limit)
            if worker_id is not None:
                query = query.where(Event.worker_id == worker_id)
            return [e.model_dump(mode="json") for e in db.exec(query)]

    def listen(self) -> asyncio.Queue[dict]:
        queue: asyncio.Queue[dict] = asyncio.Queue()
        self._listeners.add(queue)
        return queue

    def unlisten(self, queue: asyncio.Queue[dict]) -> None:
        self._listeners.discard(queue)
