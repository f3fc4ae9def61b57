"""Inference API keys: who may send requests to /v1, and to which models.

Separate from the admin token: a key reaches /v1 only, never /api. Only a SHA-256 hash of the key
is stored, and its first characters (the prefix) so that a person can tell keys apart; the key
itself is shown once, when it is made. A revoked key stays in the table, so the usage counted
under it keeps its name; its name may be given to a new key.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import ConfigDict, field_validator, model_validator
from sqlalchemy import JSON, Column, Index, text
from sqlmodel import Field, SQLModel

from manager.schemas.common import UNIQUE_ITEMS, Slug, refuse_unknown_fields, utcnow

MAX_KEY_MODELS = 256
PREFIX_CHARS = 12  # "vmk_" and 8 characters of the random part


class InferenceKey(SQLModel, table=True):
    __tablename__ = "inference_key"
    # One active key per name; revoked ones keep theirs.
    __table_args__ = (
        Index("ix_inference_key_active_name", "name", unique=True, sqlite_where=text("revoked_at IS NULL")),
    )

    id: int | None = Field(default=None, primary_key=True)
    name: str
    sha256: str = Field(index=True, unique=True)
    prefix: str
    models: list[str] = Field(default_factory=list, sa_column=Column(JSON, nullable=False))
    created_at: datetime = Field(default_factory=utcnow)
    last_used_at: datetime | None = None
    revoked_at: datetime | None = None


class InferenceAccess(SQLModel, table=True):
    """Whether the admin opened /v1 again after its keys were revoked: one row, made when first needed.

    Once a key has been made, /v1 needs one even after the last is revoked (a revoked key must not find
    /v1 open), until the admin says otherwise; making a key closes it again."""

    __tablename__ = "inference_access"
    id: int | None = Field(default=None, primary_key=True)
    open_without_keys: bool = False
    changed_at: datetime = Field(default_factory=utcnow)


class InferenceAccessPublic(SQLModel):
    needs_key: bool = Field(description="Whether /v1 takes only an inference key (or the admin token)")
    message: str = Field(description="Who may use /v1 now, in words")


class InferenceKeyCreate(SQLModel):
    name: Slug = Field(description="A label for the key: who or what uses it")
    models: list[Slug] = Field(
        default_factory=list,
        max_length=MAX_KEY_MODELS,
        description="Model configs the key may use (with their aliases and LoRA adapters); empty: all",
        schema_extra={"json_schema_extra": UNIQUE_ITEMS},
    )

    # Said in the schema too (additionalProperties: false); the validator below names the closest field.
    model_config = ConfigDict(extra="forbid")  # type: ignore[assignment]

    @model_validator(mode="before")
    @classmethod
    def _known_fields(cls, data: Any) -> Any:
        return refuse_unknown_fields(cls, data)

    @field_validator("models")
    @classmethod
    def _distinct(cls, v: list[str]) -> list[str]:
        repeated = sorted({m for m in v if v.count(m) > 1})
        if repeated:
            raise ValueError(f"models repeat: {', '.join(repeated)}")
        return v


class InferenceKeyPublic(SQLModel):
    name: str
    prefix: str = Field(description="The key's first characters, to recognise it")
    models: list[str] = Field(description="Model configs it may use; empty: all")
    active: bool
    created_at: datetime
    last_used_at: datetime | None
    revoked_at: datetime | None


class InferenceKeyCreated(InferenceKeyPublic):
    key: str = Field(description="The key itself: shown this once, only its hash is stored")
