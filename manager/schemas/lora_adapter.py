"""The stored LoRA adapter and the records the API reads and writes."""

from __future__ import annotations

from datetime import datetime

from pydantic import field_validator
from sqlmodel import Field, SQLModel

from manager.schemas.common import Name, PathText, Slug, expand_home, keep_bools_and_numbers_apart, utcnow


class LoraAdapterFields(SQLModel):
    path: PathText = Field(min_length=1, description="Folder with adapter_config.json and the weights")
    base_config: Name = Field(min_length=1, description="Name of the model config it was trained for")

    @field_validator("path")
    @classmethod
    def _home_exists(cls, v: str) -> str:
        expand_home(v)
        return v


class LoraAdapter(LoraAdapterFields, table=True):
    __tablename__ = "lora_adapter"
    id: int | None = Field(default=None, primary_key=True)
    name: str = Field(index=True, unique=True)
    rank: int
    pinned: bool = False  # keep it loaded: re-loaded whenever a worker of its config is ready
    last_load_s: float | None = None  # seconds the last load into a worker took
    last_loaded_at: datetime | None = None
    created_at: datetime = Field(default_factory=utcnow)


class LoraAdapterCreate(LoraAdapterFields):
    name: Slug = Field(description="The name requests use as their model (vLLM's lora_name)")
    pinned: bool = False

    _json_types = field_validator("*", mode="before")(keep_bools_and_numbers_apart)


class LoraAdapterPublic(LoraAdapterFields):
    name: str
    rank: int
    pinned: bool
    last_load_s: float | None
    last_loaded_at: datetime | None
    created_at: datetime
