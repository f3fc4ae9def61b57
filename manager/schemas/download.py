"""Downloads of models from the Hugging Face Hub into the cache the engines read.

A row is kept for every download so that one under way when the manager stops goes on after it
starts again (the files already complete are kept), and so that a failed or cancelled one says why. Bytes done are not stored on every step: they are on disk, and the live figure comes
from the download's own progress.
"""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum

from sqlalchemy import Column
from sqlalchemy.types import JSON
from sqlmodel import Field, SQLModel

from manager.schemas.common import utcnow


class DownloadState(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"


UNFINISHED = frozenset({DownloadState.QUEUED, DownloadState.RUNNING})


class Download(SQLModel, table=True):
    __tablename__ = "download"
    __table_args__ = {"sqlite_autoincrement": True}

    id: int | None = Field(default=None, primary_key=True)
    repo: str = Field(index=True)
    revision: str = "main"
    commit: str | None = None  # the revision resolved by the hub, once known
    cache_dir: str  # the hub cache it downloads into (HF_HUB_CACHE of the engines that read it)
    files: list[str] = Field(default_factory=list, sa_column=Column(JSON, nullable=False))
    total_bytes: int = 0
    done_bytes: int = 0  # as last saved (on a state change): the live figure is the download's progress
    state: DownloadState = DownloadState.QUEUED
    error: str | None = None
    created_at: datetime = Field(default_factory=utcnow)
    updated_at: datetime = Field(default_factory=utcnow)
    finished_at: datetime | None = None
