"""Usage of /v1: requests and tokens per minute, per inference key and model config."""

from __future__ import annotations

from typing import ClassVar

from sqlalchemy import Index, Table, UniqueConstraint
from sqlmodel import Field, SQLModel

NO_KEY = 0  # requests without an inference key: the admin token, or /v1 open on loopback or by choice


class UsageMinute(SQLModel, table=True):
    """The table of revision 0005_inference_keys; keep both in step."""

    __tablename__ = "usage_minute"
    __table__: ClassVar[Table]  # set by SQLModel's metaclass, which does not declare it for type checkers
    __table_args__ = (
        UniqueConstraint("minute", "key_id", "model", name="uq_usage_minute_minute_key_model"),
        Index("ix_usage_minute_minute", "minute"),
    )

    id: int | None = Field(default=None, primary_key=True)
    minute: int  # unix time (s) of the minute's start, UTC
    key_id: int = NO_KEY  # the inference key's id; 0: no key
    model: str  # the model config the requests reached
    requests: int = 0
    errors: int = 0  # requests answered with a status of 400 or more
    prompt_tokens: int = 0
    completion_tokens: int = 0
