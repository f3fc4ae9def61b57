"""Offload profiles: how much host memory a worker may use, and for what."""

from __future__ import annotations

from datetime import datetime

from pydantic import field_validator, model_validator
from sqlmodel import Field, SQLModel

from manager.schemas.common import (
    Description,
    Name,
    ShortText,
    check_numbers,
    check_slug,
    refuse_bools_as_numbers,
    utcnow,
)

EVICTION_POLICIES = ("lru", "arc")


class OffloadProfileFields(SQLModel):
    # CPU KV offload: prefix-cache capacity in host RAM. It does not raise max_model_len.
    kv_offload_gib: float | None = Field(default=None, gt=0)
    # The same as a count of KV blocks; converted to bytes with the model's real page size at launch.
    kv_offload_num_cpu_blocks: int | None = Field(default=None, gt=0)
    kv_eviction_policy: ShortText = "lru"
    lora_cpu_pooling: bool = False
    lora_pool_gib: float | None = Field(default=None, gt=0)
    moe_expert_offload: bool = False
    moe_gpu_cache_gib: float | None = Field(default=None, ge=0)
    pinned_budget_gib: float | None = Field(default=None, gt=0)
    description: Description = ""

    _numbers_are_not_bools = field_validator("*", mode="before")(refuse_bools_as_numbers)

    @field_validator("kv_eviction_policy")
    @classmethod
    def _policy(cls, v: str) -> str:
        if v not in EVICTION_POLICIES:
            raise ValueError(f"kv_eviction_policy must be one of {', '.join(EVICTION_POLICIES)}, got {v!r}")
        return v

    @model_validator(mode="after")
    def _one_kv_size(self):
        check_numbers(self)
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
    name: Name

    @field_validator("name")
    @classmethod
    def _slug(cls, v: str) -> str:
        return check_slug(v)


class OffloadProfileUpdate(OffloadProfileFields):
    """A full replacement of the profile's fields (PUT); the name stays."""


class OffloadProfilePublic(OffloadProfileFields):
    name: str
    created_at: datetime
    updated_at: datetime
