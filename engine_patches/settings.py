"""The plugin's settings: one environment variable holding JSON.

The manager builds this from a worker's offload profile (``PatchSettings(...).to_env()``) and
every vLLM process reads it back (``PatchSettings.from_env()``). This module imports neither torch
nor vllm, so the manager can use it without either.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal

from engine_patches.moe.sizing import CACHE_POLICIES, DEFAULT_CACHE_POLICY, CachePolicy

ENV_VAR = "VLLM_MANAGER_PATCHES"
GIB = 1 << 30

logger = logging.getLogger("engine_patches.settings")


class SettingsError(ValueError):
    """The settings JSON is unreadable or a value has the wrong type."""


@dataclass(frozen=True)
class PatchSettings:
    # Where each engine process writes stats-{pid}.json; None publishes nothing.
    run_dir: str | None = None

    # One switch per patch, so a misbehaving patch can be turned off alone.
    pinned: bool = True  # exact-size pinned memory for LoRA and UVA weight offload
    kv_check: bool = True  # two-tier message when the KV memory check fails
    shm_check: bool = True  # /dev/shm and cgroup headroom before the offload region
    offload_config: bool = True  # convert num_cpu_blocks (a size in blocks) to cpu_bytes_to_use
    lora_pool: bool = False  # CPU LoRA pool: adapters in bounded pinned host memory (engine_patches.lora_pool)
    moe_offload: bool = False  # MoE expert offload (engine_patches.moe)
    sleep_pool: bool = False  # sleep level 1 backs weights up into a reusable pinned pool (engine_patches.sleep_pool)
    sleep_pool_prepare: bool = True  # take the pool right after the weights load, not at the first sleep

    # Pinned allocator: None means no budget; above it allocations stay pageable.
    pin_budget_bytes: int | None = None
    # cudaHostRegister is called per chunk of at most this many bytes. One copy must not cross a
    # chunk boundary (CUDA refuses it), so keep it above the largest tensor.
    pin_chunk_bytes: int = 64 * GIB

    # CPU LoRA pool size: a byte budget, or a count of adapters (whichever is set; bytes win).
    lora_pool_bytes: int | None = None
    max_cpu_loras: int | None = None

    # MoE expert offload (read by engine_patches.moe).
    moe_gpu_cache_gib: float | None = None
    moe_mode: Literal["cached", "copy_all"] = "cached"
    # A batch of one layer whose experts do not fit in the cache at once, and of which fewer than
    # this share are resident, is computed from host memory in place (UVA), as vLLM's own expert
    # offload does, instead of in rounds through the cache. 0 turns it off.
    moe_stream_below_hit_rate: float = 0.0
    # Batches of up to this many tokens are planned on the GPU (no host read of the router's choices;
    # up to 16 of them run inside CUDA graphs) even when their experts may not all fit in the cache:
    # those left without a slot are read in place from pinned host memory. 0: only batches whose
    # every expert fits (slots / top_k tokens). None: by the model, 64 or 16
    # (engine_patches.moe.sizing.planned_tokens).
    moe_in_place_tokens: int | None = None
    # While one MoE layer runs, guess the next layer's experts (its router applied to this layer's
    # input) and fetch the missing ones on a side stream. Batches planned on the GPU only.
    moe_fetch_ahead: bool = False
    # Which expert the GPU planner evicts: "frequency" (the least used, counts decaying by 1 % a
    # batch), or "lru" (the least recently used). On the H200 under the routing stand-in, frequency
    # hit 82.5 % against 77.7 % at batch 1 and ran 16 % faster (bench/README.md).
    moe_cache_policy: CachePolicy = DEFAULT_CACHE_POLICY
    # Batches past the cache, planned on the GPU: gather the experts left without a slot into a
    # staging buffer of one layer's experts less the slots (GPU memory on top of the cache) and compute
    # them there, instead of reading them in place. Off: on an H200 it made batch 64 about 4 % faster
    # and batch 32 no faster, for 0.9 GiB at the Qwen3-30B-A3B shape (bench/README.md), and the
    # manager's planner does not count that memory.
    moe_stage_overflow: bool = False

    # Unknown keys seen while parsing; kept so the plugin can report them once.
    unknown_keys: tuple[str, ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        if self.moe_mode not in ("cached", "copy_all"):
            raise SettingsError(f"moe_mode must be 'cached' or 'copy_all', got {self.moe_mode!r}")
        if not 0.0 <= self.moe_stream_below_hit_rate <= 1.0:
            raise SettingsError(
                f"moe_stream_below_hit_rate must be between 0 and 1, got {self.moe_stream_below_hit_rate}"
            )
        if self.pin_chunk_bytes <= 0:
            raise SettingsError(f"pin_chunk_bytes must be positive, got {self.pin_chunk_bytes}")
        if self.moe_cache_policy not in CACHE_POLICIES:
            raise SettingsError(f"moe_cache_policy must be 'lru' or 'frequency', got {self.moe_cache_policy!r}")
        if self.moe_in_place_tokens is not None and not 0 <= self.moe_in_place_tokens <= 64:
            raise SettingsError(f"moe_in_place_tokens must be between 0 and 64, got {self.moe_in_place_tokens}")
        for name in ("pin_budget_bytes", "lora_pool_bytes", "max_cpu_loras"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise SettingsError(f"{name} must be >= 0 or null, got {value}")

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> PatchSettings:
        if not isinstance(raw, dict):
            raise SettingsError(f"{ENV_VAR} must hold a JSON object, got {type(raw).__name__}")
        known = {f.name: f for f in fields(cls) if f.name != "unknown_keys"}
        values: dict[str, Any] = {}
        unknown = []
        for key, value in raw.items():
            if key not in known:
                unknown.append(key)
                continue
            values[key] = _check_type(key, known[key].type, value)
        if unknown:
            logger.warning("%s has keys this plugin does not know, ignored: %s", ENV_VAR, ", ".join(unknown))
        return cls(**values, unknown_keys=tuple(unknown))

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> PatchSettings:
        """Settings from ``VLLM_MANAGER_PATCHES``; defaults when it is unset or empty."""
        text = (os.environ if environ is None else environ).get(ENV_VAR, "").strip()
        if not text:
            return cls()
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise SettingsError(f"{ENV_VAR} is not valid JSON ({exc}): {text[:200]!r}") from exc
        return cls.from_dict(raw)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data.pop("unknown_keys")
        return data

    def to_env(self) -> dict[str, str]:
        """The environment entries a worker needs: ``{"VLLM_MANAGER_PATCHES": json}``."""
        return {ENV_VAR: json.dumps(self.to_dict(), sort_keys=True)}


def _check_type(key: str, annotation: Any, value: Any) -> Any:
    """Reject values of the wrong JSON type with a message naming the key."""
    text = str(annotation)
    if value is None:
        if "None" in text:
            return None
        raise SettingsError(f"{ENV_VAR}: {key} may not be null")
    if text.startswith("bool"):
        if not isinstance(value, bool):
            raise SettingsError(f"{ENV_VAR}: {key} must be true or false, got {value!r}")
    elif text.startswith("int"):
        if isinstance(value, bool) or not isinstance(value, int):
            raise SettingsError(f"{ENV_VAR}: {key} must be an integer, got {value!r}")
    elif text.startswith("float"):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise SettingsError(f"{ENV_VAR}: {key} must be a number, got {value!r}")
    elif text.startswith("str") and not isinstance(value, str):
        raise SettingsError(f"{ENV_VAR}: {key} must be a string, got {value!r}")
    return value
