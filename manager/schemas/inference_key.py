"""Inference API keys: who may send requests to /v1, and to which models.

Separate from the admin token: a key reaches /v1 only, never /api. Only a SHA-256 hash of the key
is stored, and its first characters (the prefix) so that a person can tell keys apart; the key
itself is shown once, when it is made. A revoked key stays in the table, so the usage counted
under it keeps its name; its name may be given to a new key.

A key may carry limits (``KeyLimitFields``): requests and tokens per minute, requests in flight, a
token budget per UTC day or month, and when it expires; None: no limit. Its priority says how the front
door's scheduler ranks its requests against others waiting for the same model.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, Literal

from pydantic import ConfigDict, field_validator, model_validator
from sqlalchemy import JSON, Column, Index, text
from sqlmodel import Field, SQLModel

from manager.schemas.common import UNIQUE_ITEMS, Slug, keep_bools_and_numbers_apart, refuse_unknown_fields, utcnow

MAX_KEY_MODELS = 256
PREFIX_CHARS = 12  # "vmk_" and 8 characters of the random part
# Larger than any one server serves; small enough that a typo (a size in bytes, say) is caught.
MAX_RPM = 1_000_000
MAX_TPM = 1_000_000_000
MAX_CONCURRENT = 100_000
MAX_TOKEN_BUDGET = 10**13
BudgetPeriod = Literal["day", "month"]
Priority = Literal["interactive", "batch"]
LIMIT_FIELDS = ("rpm", "tpm", "max_concurrent", "token_budget", "budget_period", "expires_at", "priority")


class KeyLimitFields(SQLModel):
    rpm: int | None = Field(default=None, ge=1, le=MAX_RPM, description="Requests per minute; null: no limit")
    tpm: int | None = Field(
        default=None,
        ge=1,
        le=MAX_TPM,
        description="Tokens (prompt and completion, as the engine counts them) per minute; null: no limit",
    )
    max_concurrent: int | None = Field(
        default=None, ge=1, le=MAX_CONCURRENT, description="Requests in flight at once; null: no limit"
    )
    token_budget: int | None = Field(
        default=None,
        ge=1,
        le=MAX_TOKEN_BUDGET,
        description="Tokens per budget_period (UTC calendar); a request must fit its max_tokens in what is left",
    )
    budget_period: str = Field(default="month", description="The token budget's period: day or month (UTC)")
    expires_at: datetime | None = Field(default=None, description="From then on the key is refused; null: never")
    priority: str = Field(
        default="interactive",
        description="interactive, or batch: waits behind interactive requests for the same model",
    )


class InferenceKey(KeyLimitFields, table=True):
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


class KeyLimitsIn(KeyLimitFields):
    """The limits as a client sends them: checked, and without fields the key does not have."""

    budget_period: BudgetPeriod = Field(default="month", description="The token budget's period: day or month (UTC)")
    priority: Priority = Field(
        default="interactive",
        description="interactive, or batch: waits behind interactive requests for the same model",
    )

    _json_types = field_validator("*", mode="before")(keep_bools_and_numbers_apart)

    @field_validator("expires_at")
    @classmethod
    def _in_the_future(cls, v: datetime | None) -> datetime | None:
        if v is None:
            return None
        when = v if v.tzinfo else v.replace(tzinfo=UTC)  # a time without a zone is UTC, as stored
        if when <= utcnow():
            raise ValueError(f"{when:%Y-%m-%d %H:%M:%S} UTC has passed; give a time to come, or none")
        return when.astimezone(UTC)


class KeyLimitsUpdate(KeyLimitsIn):
    """New limits for a key (PATCH): the fields sent are changed (null: no limit), the others stay."""

    model_config = ConfigDict(extra="forbid")  # type: ignore[assignment]

    @model_validator(mode="before")
    @classmethod
    def _known_fields(cls, data: Any) -> Any:
        return refuse_unknown_fields(cls, data)


class InferenceKeyCreate(KeyLimitsIn):
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


class InferenceKeyPublic(KeyLimitFields):
    name: str
    prefix: str = Field(description="The key's first characters, to recognise it")
    models: list[str] = Field(description="Model configs it may use; empty: all")
    active: bool
    expired: bool = Field(default=False, description="Whether its expires_at has passed")
    created_at: datetime
    last_used_at: datetime | None
    revoked_at: datetime | None


class InferenceKeyCreated(InferenceKeyPublic):
    key: str = Field(description="The key itself: shown this once, only its hash is stored")
