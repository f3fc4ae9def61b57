"""Before vLLM creates its KV offload region: headroom check, and a size in blocks made bytes.

- ``SharedOffloadRegion.__init__``: the creator checks /dev/shm and the cgroup's memory first and
  fails with the size asked and the size available (vLLM only logs a low cgroup headroom, then
  the kernel kills the engine when the pages are touched).
- ``CPUOffloadingSpec.__init__``: ``num_cpu_blocks`` in ``kv_connector_extra_config`` (a size in
  blocks, which configs carry but vLLM 0.32 does not know) becomes ``cpu_bytes_to_use`` with the
  real bytes per block.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import os
from collections.abc import Callable
from typing import Any

from engine_patches.kv_offload import check_offload_region, cpu_bytes_for_blocks
from engine_patches.vllm_adapters.patching import wrap

logger = logging.getLogger("engine_patches.offload_region")


def _check_before_create(original: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(original)

    def init_after_headroom_check(self: Any, *args: Any, **kwargs: Any) -> None:
        bound = signature.bind(self, *args, **kwargs)
        engine_id = bound.arguments["engine_id"]
        required = int(bound.arguments["num_chunks"]) * int(bound.arguments["kv_bytes_per_chunk"])
        # Only the worker that will create the file checks; the others join the existing one.
        if not os.path.exists(f"/dev/shm/vllm_offload_{engine_id}.mmap"):
            check_offload_region(required)
        original(self, *args, **kwargs)

    return init_after_headroom_check


def convert_num_cpu_blocks(config: Any) -> Any:
    """The same OffloadingConfig with ``cpu_bytes_to_use`` set from ``num_cpu_blocks``."""
    extra = dict(config.extra_config or {})
    blocks = extra.get("num_cpu_blocks")
    if not blocks or extra.get("cpu_bytes_to_use") or config.worker_kv_bytes_per_block <= 0:
        return config
    copies = 1 if config.replicated_layout else config.parallel.world_size
    extra["cpu_bytes_to_use"] = cpu_bytes_for_blocks(int(blocks), config.worker_kv_bytes_per_block, copies)
    logger.warning(
        "kv_connector_extra_config has num_cpu_blocks=%d, which vLLM 0.32 does not read: using "
        "cpu_bytes_to_use=%d (%d blocks x %d bytes per block per worker x %d). Set "
        "cpu_bytes_to_use or --kv-offloading-size instead.",
        int(blocks),
        extra["cpu_bytes_to_use"],
        int(blocks),
        config.worker_kv_bytes_per_block,
        copies,
    )
    return dataclasses.replace(config, extra_config=extra)


def _convert_config(original: Callable[..., Any]) -> Callable[..., Any]:
    def init_with_converted_config(self: Any, config: Any, *args: Any, **kwargs: Any) -> None:
        original(self, convert_num_cpu_blocks(config), *args, **kwargs)

    return init_with_converted_config


def install_shm_check() -> list[str]:
    from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion

    if wrap(SharedOffloadRegion, "__init__", _check_before_create):
        return ["SharedOffloadRegion.__init__"]
    return []


def install_config_conversion() -> list[str]:
    from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

    if wrap(CPUOffloadingSpec, "__init__", _convert_config):
        return ["CPUOffloadingSpec.__init__"]
    return []
