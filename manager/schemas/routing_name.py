"""Routing names: every name a /v1 request's "model" may use, each held by one model config or LoRA adapter.

A model config holds its name, its served model name and its aliases; an adapter holds its own name.
The name column is UNIQUE, and the rows are written in the same transaction as the config or adapter
they belong to: two clients that claim one name at the same moment cannot both succeed. Rows go with
their config or adapter (ON DELETE CASCADE).
"""

from __future__ import annotations

from typing import Literal

from sqlalchemy import CheckConstraint
from sqlmodel import Field, SQLModel

NameKind = Literal["name", "served model name", "alias", "adapter"]


class RoutingName(SQLModel, table=True):
    __tablename__ = "routing_name"
    __table_args__ = (
        CheckConstraint("(model_config_id IS NULL) <> (lora_adapter_id IS NULL)", name="ck_routing_name_one_holder"),
    )

    id: int | None = Field(default=None, primary_key=True)
    name: str = Field(index=True, unique=True)
    kind: str  # a NameKind
    model_config_id: int | None = Field(default=None, foreign_key="model_config.id", ondelete="CASCADE", index=True)
    lora_adapter_id: int | None = Field(default=None, foreign_key="lora_adapter.id", ondelete="CASCADE", index=True)
