"""Offload profiles: how much host memory a worker may use, and for what."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import ConfigDict, field_validator, model_validator
from sqlmodel import Field, SQLModel

from manager.schemas.common import (
    MAX_GIB,
    MAX_INT,
    READ_ONLY,
    Description,
    ShortText,
    Slug,
    keep_bools_and_numbers_apart,
    refuse_unknown_fields,
    utcnow,
)

EVICTION_POLICIES = ("lru", "arc")


def _when_on(switch: str, needs: str) -> dict[str, Any]:
    return {
        "if": {"required": [switch], "properties": {switch: {"const": True}}},
        "then": {"required": [needs], "properties": {needs: {"type": "number"}}},
    }


# The rules between fields that _rules checks, as the schema states them.
RULES: dict[str, Any] = {
    "allOf": [
        {
            "not": {
                "required": ["kv_offload_gib", "kv_offload_num_cpu_blocks"],
                "properties": {"kv_offload_gib": {"type": "number"}, "kv_offload_num_cpu_blocks": {"type": "integer"}},
            }
        },
        _when_on("lora_cpu_pooling", "lora_pool_gib"),
        _when_on("moe_expert_offload", "moe_gpu_cache_gib"),
    ]
}


class OffloadProfileFields(SQLModel):
    model_config = ConfigDict(json_schema_extra=RULES)  # type: ignore[assignment]

    # CPU KV offload: prefix-cache capacity in host RAM. It does not raise max_model_len.
    kv_offload_gib: float | None = Field(default=None, gt=0, le=MAX_GIB)
    # The same as a count of KV blocks; converted to bytes with the model's real page size at launch.
    kv_offload_num_cpu_blocks: int | None = Field(default=None, gt=0, le=MAX_INT)
    # A plain text column; the validator's message lists the choices, the schema states them.
    kv_eviction_policy: ShortText = Field(
        default="lru", schema_extra={"json_schema_extra": {"enum": EVICTION_POLICIES}}
    )
    lora_cpu_pooling: bool = False
    lora_pool_gib: float | None = Field(default=None, gt=0, le=MAX_GIB)
    moe_expert_offload: bool = False
    moe_gpu_cache_gib: float | None = Field(
        default=None,
        ge=0,
        le=MAX_GIB,
        description="GPU memory for the MoE expert cache, per GPU: under tensor parallelism each rank keeps a "
        "cache of this size for its share of every expert",
    )
    pinned_budget_gib: float | None = Field(default=None, gt=0, le=MAX_GIB)
    # Sleep level 1 backs the weights up into one pinned pool kept for the engine's life (about a
    # second per sleep on an H200) instead of vLLM's fresh pinned allocation at every sleep.
    sleep_pool: bool = Field(
        default=True,
        description="sleep level 1 through one pinned copy of the weights, taken at start and kept (on); "
        "off: vLLM's own path, fresh pinned memory at every sleep",
    )
    description: Description = ""

    _json_types = field_validator("*", mode="before")(keep_bools_and_numbers_apart)

    @field_validator("kv_eviction_policy")
    @classmethod
    def _policy(cls, v: str) -> str:
        if v not in EVICTION_POLICIES:
            raise ValueError(f"kv_eviction_policy must be one of {', '.join(EVICTION_POLICIES)}, got {v!r}")
        return v

    @model_validator(mode="after")
    def _rules(self):
        if self.kv_offload_gib is not None and self.kv_offload_num_cpu_blocks is not None:
            raise ValueError(
                "give the KV offload size either as kv_offload_gib or as kv_offload_num_cpu_blocks, not both"
            )
        if self.lora_cpu_pooling and self.lora_pool_gib is None:
            raise ValueError("lora_pool_gib is required when lora_cpu_pooling is on")
        if self.moe_expert_offload and self.moe_gpu_cache_gib is None:
            raise ValueError("moe_gpu_cache_gib is required when moe_expert_offload is on")
        return self


class OffloadProfile(OffloadProfileFields, table=True):
    __tablename__ = "offload_profile"
    id: int | None = Field(default=None, primary_key=True)
    name: str = Field(index=True, unique=True)
    created_at: datetime = Field(default_factory=utcnow)
    updated_at: datetime = Field(default_factory=utcnow)


class OffloadProfileCreate(OffloadProfileFields):
    name: Slug

    # Said in the schema too (additionalProperties: false); the validator below names the closest field.
    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _known_fields(cls, data: Any) -> Any:
        return refuse_unknown_fields(cls, data)


class OffloadProfileUpdate(OffloadProfileFields):
    """A full replacement of the profile's fields (PUT); the name stays."""

    # Said in the schema too (additionalProperties: false); the validator below names the closest field.
    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _known_fields(cls, data: Any) -> Any:
        return refuse_unknown_fields(cls, data, READ_ONLY)


class OffloadProfilePublic(OffloadProfileFields):
    name: str
    created_at: datetime
    updated_at: datetime
