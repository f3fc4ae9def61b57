"""Model configs: one stored recipe for one vLLM server."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from pydantic import ConfigDict, ValidationInfo, field_validator, model_validator
from sqlalchemy import JSON, Column
from sqlmodel import Field, SQLModel

from manager.schemas.common import (
    ENV_NAME,
    ENV_NAME_RULE,
    ENV_NAMES,
    MAX_ARGS,
    MAX_COMMAND_BYTES,
    MAX_CONCURRENT,
    MAX_ENGINE_GPUS,
    MAX_ENV,
    MAX_GPUS,
    MAX_INT,
    MAX_REPLICAS,
    MAX_RESIDENCY_S,
    READ_ONLY,
    UNIQUE_ITEMS,
    Argument,
    EnvName,
    EnvValue,
    GpuId,
    Name,
    PathText,
    ShortText,
    Slug,
    command_bytes,
    expand_home,
    keep_bools_and_numbers_apart,
    refuse_unknown_fields,
    utcnow,
)
from manager.schemas.engine_values import (
    CHOICES,
    DTYPES,
    KV_CACHE_DTYPES,
    LORA_RANKS,
    QUANTIZATIONS,
    TEXT_FIELDS,
    gpus_problem,
    value_problem,
)


class ModelConfigFields(SQLModel):
    model: PathText = Field(min_length=1, description="Local folder or Hugging Face id")
    served_model_name: ShortText | None = None
    dtype: ShortText = "auto"
    quantization: ShortText | None = None
    tensor_parallel_size: int = Field(default=1, ge=1, le=MAX_INT, description="At most as many as gpu_ids lists")
    gpu_ids: list[GpuId] = Field(
        default_factory=list,
        max_length=MAX_GPUS,
        sa_column=Column(JSON, nullable=False),
        schema_extra={"json_schema_extra": UNIQUE_ITEMS},
    )
    gpu_memory_utilization: float = Field(default=0.9, gt=0, le=1)
    max_model_len: int | None = Field(default=None, gt=0, le=MAX_INT)
    max_num_seqs: int | None = Field(default=None, gt=0, le=MAX_INT)
    kv_cache_dtype: ShortText = "auto"
    enforce_eager: bool = False
    enable_prefix_caching: bool | None = None
    enable_lora: bool = False
    max_loras: int | None = Field(default=None, gt=0, le=MAX_INT)
    max_lora_rank: int | None = Field(default=None, gt=0, le=MAX_INT)
    max_cpu_loras: int | None = Field(default=None, gt=0, le=MAX_INT)
    extra_args: list[Argument] = Field(
        default_factory=list,
        max_length=MAX_ARGS,
        sa_column=Column(JSON, nullable=False),
        description=f"With env, at most {MAX_COMMAND_BYTES} bytes of the engine's command line",
    )
    env: dict[EnvName, EnvValue] = Field(
        default_factory=dict,
        max_length=MAX_ENV,
        sa_column=Column(JSON, nullable=False),
        schema_extra={"json_schema_extra": ENV_NAMES},
    )
    autostart: bool = False
    start_timeout_s: int = Field(
        default=900,
        gt=0,
        le=MAX_INT,
        description="How long vLLM's start may take (a download before it is not counted)",
    )
    download_timeout_s: int | None = Field(
        default=None,
        gt=0,
        le=MAX_INT,
        description="How long downloading the model from the Hugging Face Hub may take before a start; empty: no limit",
    )
    wait_for_download: bool = Field(
        default=False,
        description="A /v1 request for this model while it downloads waits for the download and the start, "
        "instead of a 503 with the progress and Retry-After",
    )
    port: int | None = Field(default=None, ge=1, le=65535)
    # The front door (/v1): other names a request's "model" may use, when to unload an idle worker,
    # which workers are never evicted for another, and whether eviction puts the worker to sleep.
    aliases: list[Slug] = Field(
        default_factory=list,
        sa_column=Column(JSON, nullable=False),
        description="Other names /v1 requests may use for this model (unique across all models, and not its "
        "served_model_name)",
        schema_extra={"json_schema_extra": UNIQUE_ITEMS},
    )
    idle_timeout_s: int | None = Field(
        default=None,
        gt=0,
        le=MAX_INT,
        description="Stop (or put to sleep) the worker after this long without a /v1 request",
    )
    persistent: bool = Field(default=False, description="Never stopped or put to sleep to make room for another")
    # Replicas: several workers of one model, /v1 requests spread over them.
    replicas: int = Field(
        default=1,
        ge=1,
        le=MAX_REPLICAS,
        description="How many workers run this model (each placed where the plan says it fits); /v1 sends a "
        "request to the one with the fewest requests in flight, keeping a conversation on one while it can",
    )
    min_replicas: int | None = Field(
        default=None, ge=1, le=MAX_REPLICAS, description="With max_replicas: the fewest replicas scaling down keeps"
    )
    max_replicas: int | None = Field(
        default=None,
        ge=1,
        le=MAX_REPLICAS,
        description="Add a replica (up to this many) while requests wait in every replica's queue for longer "
        "than scale_up_after_s and a GPU has room by the plan; empty: no scaling",
    )
    scale_up_after_s: int = Field(
        default=10, ge=1, le=3600, description="How long requests must queue at every replica before one is added"
    )
    scale_down_after_s: int = Field(
        default=300,
        ge=1,
        le=MAX_INT,
        description="A replica above min_replicas without a request for this long is stopped",
    )
    max_concurrent: int | None = Field(
        default=None,
        ge=1,
        le=MAX_CONCURRENT,
        description="The most /v1 requests this model answers at once, over all its replicas; more wait in the "
        "front door's queue, interactive keys before batch ones and taking turns between keys. Empty: no limit "
        "(the engines queue them)",
    )
    min_residency_s: float | None = Field(
        default=None,
        ge=0,
        le=MAX_RESIDENCY_S,
        description="Once /v1 swaps this model in (started or woken for requests), it stays at least this many "
        "seconds before another model sharing its GPUs may evict it, unless it goes idle; two busy models on one "
        "GPU then take turns in batches instead of swapping on every request. 0: off. Empty: its last swap-in "
        "time plus 5 seconds",
    )
    loading_progress: bool = Field(
        default=False,
        description="A streamed /v1 request that waits for this model (its start, wake or download) gets SSE "
        "comment lines with the progress (': loading NAME 42 %') until its first chunk, which OpenAI clients "
        "skip and which keep proxies from timing it out. A request may ask for them itself with the header "
        "X-Loading-Progress: 1 or true (0 or false turns them off)",
    )
    sleep_level: int | None = Field(
        default=None,
        ge=1,
        le=2,
        description="vLLM sleep mode: 1 keeps the weights in host RAM, 2 drops them; empty: off",
    )
    node: ShortText | None = Field(
        default=None,
        description="With a Ray cluster: the node to run on (its name, hostname, address, Ray node id, a custom "
        "resource or a label value). Empty: the first node that fits; a worker on a lost node then restarts on "
        "another one",
    )

    _json_types = field_validator("*", mode="before")(keep_bools_and_numbers_apart)

    @field_validator("model")
    @classmethod
    def _local_paths_are_absolute(cls, v: str) -> str:
        # Engines run in their own folder, so a relative path would name something else there (or be
        # taken for a Hugging Face id). Hub ids ("org/name") are left as they are.
        if v.startswith(("~", "./", "../", "/")) or v in (".", ".."):
            return str(expand_home(v).resolve())
        return v

    @field_validator("gpu_ids")
    @classmethod
    def _gpu_ids(cls, v: list[int]) -> list[int]:
        if len(set(v)) != len(v):
            raise ValueError(f"GPU ids repeat: {v}")
        return v

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, str]) -> dict[str, str]:
        for key in v:
            if not ENV_NAME.fullmatch(key):
                raise ValueError(f"environment variable name {key!r} is invalid ({ENV_NAME_RULE})")
        return v

    @field_validator("aliases")
    @classmethod
    def _aliases(cls, v: list[str]) -> list[str]:
        repeated = sorted({a for a in v if v.count(a) > 1})
        if repeated:
            raise ValueError(f"aliases repeat: {', '.join(repeated)}")
        return v

    @model_validator(mode="after")
    def _gpus_match_tp(self):
        size = command_bytes(self.extra_args, self.env)
        if size > MAX_COMMAND_BYTES:
            raise ValueError(
                f"extra_args and env together take {size} bytes of the engine's command line; the limit is "
                f"{MAX_COMMAND_BYTES}: put long values in a file and pass its path"
            )
        if self.gpu_ids and len(self.gpu_ids) < self.tensor_parallel_size:
            raise ValueError(
                f"tensor_parallel_size {self.tensor_parallel_size} needs at least that many GPUs, "
                f"but gpu_ids lists {len(self.gpu_ids)}"
            )
        if self.served_model_name and self.served_model_name in self.aliases:
            raise ValueError(f"alias {self.served_model_name!r} is already the served model name")
        problem = replicas_problem(self.replicas, self.min_replicas, self.max_replicas)
        if problem:
            raise ValueError(problem)
        return self


def replicas_problem(replicas: int, least: int | None, most: int | None) -> str | None:
    """What is wrong with a config's replica counts, if anything."""
    if least is not None and most is None:
        return "min_replicas needs max_replicas (without it the count stays at replicas)"
    if most is not None:
        low = least or 1
        if low > most:
            return f"min_replicas {low} is more than max_replicas {most}"
        if not low <= replicas <= most:
            return f"replicas {replicas} must lie between min_replicas {low} and max_replicas {most}"
    return None


class ModelConfig(ModelConfigFields, table=True):
    __tablename__ = "model_config"
    id: int | None = Field(default=None, primary_key=True)
    name: str = Field(index=True, unique=True)
    offload_profile_id: int | None = Field(default=None, foreign_key="offload_profile.id", ondelete="RESTRICT")
    created_at: datetime = Field(default_factory=utcnow)
    updated_at: datetime = Field(default_factory=utcnow)


class ModelConfigIn(ModelConfigFields):
    offload_profile: Name | None = Field(default=None, description="Name of an offload profile")


def _choices(values: Sequence[str | int], optional: bool = False) -> dict[str, Any]:
    return {"json_schema_extra": {"enum": [*values, None] if optional else list(values)}}


class ModelConfigWrite(ModelConfigIn):
    """A config as written (created, replaced, imported): the values the manager writes into the engine's
    argv are checked as vLLM 0.32 takes them. A stored config is listed as it is; a start or a preview of
    it checks them again."""

    dtype: ShortText = Field(default="auto", schema_extra=_choices(DTYPES))
    quantization: ShortText | None = Field(default=None, schema_extra=_choices(QUANTIZATIONS, optional=True))
    kv_cache_dtype: ShortText = Field(default="auto", schema_extra=_choices(KV_CACHE_DTYPES))
    max_lora_rank: int | None = Field(default=None, schema_extra=_choices(LORA_RANKS, optional=True))
    tensor_parallel_size: int = Field(
        default=1,
        ge=1,
        le=MAX_ENGINE_GPUS,
        description=f"At most as many as gpu_ids lists; times the pipeline and data parallel sizes in extra_args, "
        f"at most {MAX_ENGINE_GPUS}",
    )

    @field_validator(*TEXT_FIELDS, *CHOICES)
    @classmethod
    def _engine_value(cls, v: Any, info: ValidationInfo) -> Any:
        problem = value_problem(str(info.field_name), v)
        if problem:
            raise ValueError(problem)
        return v

    @model_validator(mode="after")
    def _engine_gpus(self):
        problem = gpus_problem(self.tensor_parallel_size, self.extra_args)
        if problem:
            raise ValueError(problem)
        return self


class ModelConfigCreate(ModelConfigWrite):
    name: Slug

    # Said in the schema too (additionalProperties: false); the validator below names the closest field.
    model_config = ConfigDict(extra="forbid")  # type: ignore[assignment]

    @model_validator(mode="before")
    @classmethod
    def _known_fields(cls, data: Any) -> Any:
        return refuse_unknown_fields(cls, data)


class ModelConfigUpdate(ModelConfigWrite):
    """A full replacement of the config's fields (PUT); the name stays."""

    # Said in the schema too (additionalProperties: false); the validator below names the closest field.
    model_config = ConfigDict(extra="forbid")  # type: ignore[assignment]

    @model_validator(mode="before")
    @classmethod
    def _known_fields(cls, data: Any) -> Any:
        return refuse_unknown_fields(cls, data, READ_ONLY)


class ModelConfigPublic(ModelConfigIn):
    name: str
    created_at: datetime
    updated_at: datetime
