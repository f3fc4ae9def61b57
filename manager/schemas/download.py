"""Downloads of models from the Hugging Face Hub into the cache the engines read.

A row is kept for every download so that one under way when the manager stops goes on after it
starts again (the files already complete are kept), and so that a failed or cancelled one says why. Bytes done are not stored on every step: they are on disk, and the live figure comes
from the download's own progress.
"""

from __future__ import annotations

import re
from datetime import datetime
from enum import StrEnum

from pydantic import BaseModel, ConfigDict, field_validator
from pydantic import Field as Described
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


REPO_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.-]{0,95}$"
REVISION_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_./-]{0,199}$"


class DownloadRequest(BaseModel):
    """A download to start: a model on the Hugging Face Hub and, if not main, its revision."""

    model_config = ConfigDict(extra="forbid")

    repo: str = Described(pattern=REPO_PATTERN, description="A Hugging Face model id, such as Qwen/Qwen3-0.6B")
    revision: str | None = Described(default=None, pattern=REVISION_PATTERN, description="Branch, tag or commit (main)")

    # The patterns stay in the schema for clients; these say in words what a mismatch got wrong.
    @field_validator("repo", mode="before")
    @classmethod
    def _repo_in_words(cls, value: object) -> object:
        if isinstance(value, str) and not re.fullmatch(REPO_PATTERN, value):
            raise ValueError(
                f"{value[:200]!r} is not a Hugging Face model id: give it as owner/name, such as Qwen/Qwen3-0.6B "
                "(letters, digits, '.', '_' and '-'; each part starts with a letter or digit)"
            )
        return value

    @field_validator("revision", mode="before")
    @classmethod
    def _revision_in_words(cls, value: object) -> object:
        if isinstance(value, str) and not re.fullmatch(REVISION_PATTERN, value):
            raise ValueError(
                f"{value[:200]!r} is not a branch, tag or commit: letters, digits, '.', '_', '/' and '-', starting "
                "with a letter or digit, at most 200 characters"
            )
        return value
