"""API tokens: only a hash is stored; the token itself is shown once."""

from __future__ import annotations

from datetime import datetime

from sqlmodel import Field, SQLModel

from manager.schemas.common import utcnow


class ApiToken(SQLModel, table=True):
    __tablename__ = "api_token"
    id: int | None = Field(default=None, primary_key=True)
    name: str = "default"
    sha256: str = Field(index=True, unique=True)
    created_at: datetime = Field(default_factory=utcnow)
