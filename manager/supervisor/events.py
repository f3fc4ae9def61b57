"""The event log: every transition and action, stored in SQLite and pushed to live listeners."""

from __future__ import annotations

import asyncio
import logging

from sqlalchemy.engine import Engine
from sqlmodel import col, select

from manager.db import session
from manager.launch.secrets import Redactor
from manager.schemas.event import Event

log = logging.getLogger("vllm_manager.events")
# Every event is stored and broadcast: whoever records it, a secret flag's value or a URL's user part
# in it is hidden (a worker's own events hide its config's secrets as well, before they get here).
_IN_ANY_EVENT = Redactor()


class EventLog:
    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._listeners: set[asyncio.Queue[dict]] = set()

    def record(self, kind: str, message: str, worker_id: int | None = None, **data) -> dict:
        shown = {key: _IN_ANY_EVENT.value(value) for key, value in data.items()}
        event = Event(kind=kind, message=_IN_ANY_EVENT.text(message), worker_id=worker_id, data=shown)
        with session(self._engine) as db:
            db.add(event)
            db.commit()
            db.refresh(event)
        public = event.model_dump(mode="json")
        log.info("worker %s: %s: %s", worker_id, kind, event.message)
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
