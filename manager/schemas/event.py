"""Events: every worker state transition and operator action, in order."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import JSON, Column
from sqlmodel import Field, SQLModel

from manager.schemas.common import utcnow


class Event(SQLModel, table=True):
    __tablename__ = "event"
    id: int | None = Field(default=None, primary_key=True)
    ts: datetime = Field(default_factory=utcnow, index=True)
    worker_id: int | None = Field(default=None, index=True)
    kind: str
    message: str = ""
    data: dict = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))
