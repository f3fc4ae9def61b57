"""A two-tier message when vLLM's KV memory check fails while CPU KV offload is configured.

The check itself is untouched: the GPU must hold one max-length request, whatever the CPU tier
holds. ``_check_enough_kv_cache_memory`` has no config, so the two entry points that call it
(``get_kv_cache_configs``, also imported by name into ``vllm.v1.engine.core``, and
``check_enough_kv_cache_memory``) leave the config where the check's wrapper can read it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from engine_patches.kv_offload import KVTiers, two_tier_message
from engine_patches.vllm_adapters.patching import wrap

logger = logging.getLogger("engine_patches.kv_check")

OFFLOAD_CONNECTORS = ("OffloadingConnector", "SimpleCPUOffloadConnector")
GIB = 1 << 30

_local = threading.local()


def offload_cpu_bytes(vllm_config: Any, bytes_per_token: float | None = None) -> int | None:
    """The CPU tier's configured size in bytes (all workers), None without KV offload."""
    size_gib = getattr(vllm_config.cache_config, "kv_offloading_size", None)
    ktc = vllm_config.kv_transfer_config
    connector = getattr(ktc, "kv_connector", None) if ktc is not None else None
    if connector not in OFFLOAD_CONNECTORS:
        return int(size_gib * GIB) if size_gib else None
    extra = dict(getattr(ktc, "kv_connector_extra_config", None) or {})
    if extra.get("cpu_bytes_to_use"):
        return int(extra["cpu_bytes_to_use"])
    if size_gib:
        return int(size_gib * GIB)
    blocks = extra.get("num_cpu_blocks")  # a size in blocks; offload_region converts it at offload start
    if blocks and bytes_per_token:
        block_size = vllm_config.cache_config.block_size or 16
        world = vllm_config.parallel_config.world_size
        return int(blocks * block_size * bytes_per_token * world)
    return 0


def _with_config(original: Callable[..., Any]) -> Callable[..., Any]:
    def remember_config(vllm_config: Any, *args: Any, **kwargs: Any) -> Any:
        previous = getattr(_local, "vllm_config", None)
        _local.vllm_config = vllm_config
        try:
            return original(vllm_config, *args, **kwargs)
        finally:
            _local.vllm_config = previous

    return remember_config


def _explain(original: Callable[..., Any]) -> Callable[..., Any]:
    def check_with_both_tiers(
        available_memory: int,
        get_needed_memory: Callable[[], int],
        max_model_len: int,
        estimate_max_model_len: Callable[[int], int],
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        try:
            return original(available_memory, get_needed_memory, max_model_len, estimate_max_model_len, *args, **kwargs)
        except ValueError as exc:
            vllm_config = getattr(_local, "vllm_config", None)
            if vllm_config is None or available_memory <= 0:
                raise
            needed = get_needed_memory()
            per_token = needed / max_model_len if max_model_len else None
            cpu_bytes = offload_cpu_bytes(vllm_config, per_token)
            if cpu_bytes is None:
                raise  # no CPU tier: vLLM's own message says it all
            world = max(vllm_config.parallel_config.world_size, 1)
            tiers = KVTiers(
                max_model_len=max_model_len,
                needed_bytes=needed,
                gpu_available_bytes=available_memory,
                gpu_tokens=estimate_max_model_len(available_memory),
                cpu_bytes=cpu_bytes,
                cpu_tokens=int(cpu_bytes / world / per_token) if per_token else None,
                kv_cache_dtype=str(vllm_config.cache_config.cache_dtype),
            )
            raise ValueError(two_tier_message(tiers)) from exc

    return check_with_both_tiers


def install() -> list[str]:
    import vllm.v1.core.kv_cache_utils as utils
    import vllm.v1.engine.core as core

    done = []
    if wrap(utils, "_check_enough_kv_cache_memory", _explain):
        done.append("kv_cache_utils._check_enough_kv_cache_memory")
    if wrap(utils, "check_enough_kv_cache_memory", _with_config):
        done.append("kv_cache_utils.check_enough_kv_cache_memory")
    if wrap(utils, "get_kv_cache_configs", _with_config):
        done.append("kv_cache_utils.get_kv_cache_configs")
    # core.py did `from kv_cache_utils import get_kv_cache_configs`: that name still points at
    # the original, so it is wrapped there too.
    if wrap(core, "get_kv_cache_configs", _with_config):
        done.append("engine.core.get_kv_cache_configs")
    return done
