"""The memory planner applied to stored configs: refuse a start that cannot fit, and compare after.

Host RAM other workers hold counts against a new start: what their offload profiles claim, and
what a sleeping worker keeps (level 1: its weights, in pinned host memory; level 2: nothing). A start
that would fit once sleeping workers let their RAM go is refused with ``HostRamHeldBySleepers``,
which names them, so the front door can stop some of them and start again.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from manager import processes
from manager.errors import Invalid, ManagerError
from manager.hub import source
from manager.launch.command import (
    adds_enforce_eager,
    eager_by_choice,
    kv_offload_bytes,
    sleep_pool_on,
)
from manager.launch.flags import flag_value
from manager.placement import sleep_level_of
from manager.planner import Comparison, EngineKVReport, Plan, PlanError, PlanRequest, make_plan, model_files
from manager.planner.engine_report import compare, mismatch, parse_engine_kv_report
from manager.planner.gpu_side import weights_on_gpu
from manager.planner.gpus import NoGPU, detect_gpu
from manager.planner.hf_config import text_config
from manager.planner.host import HeldRam, HostMemory, read_host_memory
from manager.planner.scheduling import parse_transfer_config
from manager.planner.weights import estimate_weights
from manager.schemas.model_config import ModelConfig
from manager.schemas.offload_profile import OffloadProfile

GIB = 1 << 30
SHM = Path("/dev/shm")

# vLLM keeps a level-1 sleeper's weights in pinned host memory, which PyTorch's caching host
# allocator rounds up to a power of two: count up to twice the weights (see the vLLM notes).
PINNED_ROUNDING = 2.0


@dataclass(frozen=True)
class Sleeper:
    """A sleeping worker and the host RAM its sleep keeps."""

    worker_id: int
    config: str
    level: int
    host_bytes: int | None  # None: its model's files cannot be read, so not known


@dataclass(frozen=True)
class HostClaims:
    """Host RAM the other workers hold while a start is checked."""

    profile_bytes: int = 0  # what the active workers' offload profiles claim
    sleepers: tuple[Sleeper, ...] = ()
    pool_bytes: int = 0  # sleep pools of awake workers: taken at their first sleep, kept
    # The engine this start replaces (a switch checked while it still runs): (pid, create time, argv).
    # It is stopped before the new one starts, so on vllm-cpu its memory counts as available.
    replaced_engine: tuple[int, float | None, tuple[str, ...]] | None = None

    @property
    def sleeping_bytes(self) -> int:
        return sum(s.host_bytes or 0 for s in self.sleepers)


class HostRamHeldBySleepers(Invalid):
    """The start would fit in host RAM if some sleeping workers were stopped."""

    def __init__(self, message: str, short_bytes: int, sleepers: tuple[Sleeper, ...], node: str | None = None) -> None:
        super().__init__(message, field="model")
        self.short_bytes = short_bytes
        self.sleepers = sleepers
        self.node = node  # where the start was checked, and the sleepers sleep (None: this box)


@dataclass(frozen=True)
class Refused:
    """The pre-start check's refusal on one node, as the node's agent hands it back: its message, and
    when sleeping workers there hold the host RAM the start lacks, how much it lacks and who they are."""

    message: str
    short_bytes: int | None = None
    sleepers: tuple[Sleeper, ...] = ()

    @classmethod
    def of(cls, exc: Invalid) -> Refused:
        if isinstance(exc, HostRamHeldBySleepers):
            return cls(exc.message, exc.short_bytes, exc.sleepers)
        return cls(exc.message)


def sleep_host_bytes(
    config: ModelConfig, level: int | None = None, *, pooled: bool = False, profile: OffloadProfile | None = None
) -> int | None:
    """Host RAM a sleep at ``level`` (the config's own by default) keeps: level 1 the weights, pinned
    (their exact size through the sleep pool, else up to twice); level 2 nothing; None: sleep mode
    off, or the model's files cannot be read."""
    level = config.sleep_level if level is None else level
    if level is None:
        return None
    if level >= 2:
        return 0
    try:
        found = model_files.read_model(config.model)
        weights = estimate_weights(found.config, found.weights, config.dtype)
        request = plan_request(config, profile, "detected")
    except (model_files.ModelNotFound, OSError, ValueError, KeyError):
        return None
    # A sleep backs up what is on the GPU, not what offload keeps in host RAM.
    per_gpu, _ = weights_on_gpu(request, text_config(found.config), weights)
    return int(per_gpu * config.tensor_parallel_size * (1.0 if pooled else PINNED_ROUNDING))


def sleeper_host_bytes(
    config: ModelConfig, profile: OffloadProfile | None, *, pooled: bool, level: int | None = None
) -> int | None:
    """Host RAM a worker of ``config`` holds while asleep at ``level`` (the level it was put to sleep
    with; None: its config's, else 1). Through its sleep pool it is the weights' exact size at level 1,
    which the pool also holds while the worker is awake."""
    level = 1 if pooled else sleep_level_of(level, config.sleep_level)
    return sleep_host_bytes(config, level, pooled=pooled, profile=profile)


def host_now(claims: HostClaims, host: HostMemory | None = None) -> HostMemory:
    """This machine's host memory (or ``host``) less what the other workers hold, one line each."""
    host = host or read_host_memory()
    held = []
    if claims.profile_bytes:
        held.append(
            HeldRam(
                "ram_held_profiles",
                "Claimed by running workers",
                claims.profile_bytes,
                "their offload profiles: CPU KV offload, LoRA pool, pinned budget",
            )
        )
    if claims.pool_bytes:
        held.append(
            HeldRam(
                "ram_held_sleep_pools",
                "Sleep pools of running workers",
                claims.pool_bytes,
                "one pinned copy of the weights on the GPU per running worker with sleep level 1, taken "
                "while it starts and kept",
            )
        )
    if claims.sleepers:
        held.append(
            HeldRam(
                "ram_held_sleeping",
                "Held by sleeping workers",
                claims.sleeping_bytes,
                "level 1 keeps the weights in pinned host RAM, level 2 nothing: " + _sleepers(claims.sleepers),
            )
        )
    return replace(host, held=(*host.held, *held)) if held else host


def plan_request(config: ModelConfig, profile: OffloadProfile | None, gpu: str) -> PlanRequest:
    """A stored config (and its offload profile) in the planner's terms."""
    cpu_kv = config.env.get("VLLM_CPU_KVCACHE_SPACE") or os.environ.get("VLLM_CPU_KVCACHE_SPACE")
    cpu_offload = flag_value(config.extra_args, "--cpu-offload-gb")
    kv_bytes = flag_value(config.extra_args, "--kv-cache-memory-bytes")
    kv_gib = size_bytes(kv_bytes) / GIB if kv_bytes else None
    return PlanRequest(
        **engine_choices(config.extra_args),
        model=config.model,
        dtype=config.dtype,
        quantization=config.quantization,
        tensor_parallel_size=config.tensor_parallel_size,
        max_model_len=config.max_model_len,
        max_num_seqs=config.max_num_seqs,
        kv_cache_dtype=config.kv_cache_dtype,
        gpu_memory_utilization=config.gpu_memory_utilization,
        enforce_eager=eager_by_choice(config) or adds_enforce_eager(config, profile),
        kv_offload_gib=(profile.kv_offload_gib or 0) if profile else 0,
        moe_expert_offload=bool(profile and profile.moe_expert_offload),
        moe_gpu_cache_gib=(profile.moe_gpu_cache_gib or 0) if profile else 0,
        cpu_offload_gb=float(cpu_offload) if cpu_offload else 0,
        lora_pool_bytes=int((profile.lora_pool_gib or 0) * GIB) if profile and profile.lora_cpu_pooling else 0,
        pinned_budget_bytes=int((profile.pinned_budget_gib or 0) * GIB) if profile else 0,
        sleep_pool=sleep_pool_on(config, profile),
        gpu=gpu,
        # vLLM on a GPU takes --kv-cache-memory-bytes as the KV budget; its CPU build takes the variable
        kv_cache_memory_gib=(float(cpu_kv) if cpu_kv else kv_gib) if gpu == "cpu" else kv_gib,
    )


def _arg(argv: list[str], flag: str) -> str | None:
    """A flag's value as vLLM's parser reads it: with dashes or underscores, the last one given."""
    names = (flag, "--" + flag[2:].replace("-", "_"))
    found = None
    for i, part in enumerate(argv):
        name, equals, value = part.partition("=")
        if name in names:
            found = value if equals else argv[i + 1] if i + 1 < len(argv) else None
    return found


def _switch(argv: list[str], flag: str) -> bool | None:
    """A boolean flag's value: True for ``--flag``, False for ``--no-flag``, the last one given; None when absent."""
    names = {flag: True, "--no-" + flag[2:]: False}
    names |= {"--" + k[2:].replace("-", "_"): v for k, v in names.items()}
    value = None
    for part in argv:
        if part in names:
            value = names[part]
    return value


def _int(text: str | None) -> int | None:
    try:
        value = int(text) if text is not None else None
    except ValueError:
        return None  # vLLM's own check of the command refuses it
    return value if value is not None and 0 < value <= 2**31 else None


def engine_choices(extra_args: list[str]) -> dict[str, Any]:
    """The flags in ``extra_args`` that change what vLLM does with the KV budget (scheduling.py), as plan fields."""
    mode = _arg(extra_args, "--performance-mode")
    found: dict[str, Any] = {
        "max_num_batched_tokens": _int(_arg(extra_args, "--max-num-batched-tokens")),
        "block_size": _int(_arg(extra_args, "--block-size")),
        "async_scheduling": _switch(extra_args, "--async-scheduling"),
        "enable_chunked_prefill": _switch(extra_args, "--enable-chunked-prefill"),
        "disable_hybrid_kv_cache_manager": _switch(extra_args, "--disable-hybrid-kv-cache-manager"),
        "kv_transfer_config": parse_transfer_config(_arg(extra_args, "--kv-transfer-config")),
        "performance_mode": mode if mode in ("balanced", "interactivity", "throughput") else None,
    }
    return {k: v for k, v in found.items() if v is not None}


def size_bytes(text: str) -> int:
    """A size as vLLM reads it: 3221225472, 3G (2**30), 3g (10**9), 2.5k; 0 when it is not one."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgGtT]?)", text.strip())
    if not match:
        return 0
    number, suffix = match.groups()
    power = "kmgt".index(suffix.lower()) + 1 if suffix else 0
    return int(float(number) * (1024 if suffix.isupper() else 1000) ** power)


def host_bytes_of(profile: OffloadProfile | None) -> int:
    """Host RAM an offload profile claims: CPU KV offload, the LoRA pool and the pinned budget."""
    if profile is None:
        return 0
    gib = (profile.kv_offload_gib or 0) + (profile.pinned_budget_gib or 0)
    gib += (profile.lora_pool_gib or 0) if profile.lora_cpu_pooling else 0
    return int(gib * GIB)


def plan_now(request: PlanRequest, claims: HostClaims) -> Plan:
    """The plan as a start now would see it: this machine's host RAM less what the workers hold,
    unless the request plans another machine's RAM (``host_ram_gib``)."""
    if request.host_ram_gib:
        return make_plan(request, read_files=source.read_model)
    return make_plan(request, host=host_now(claims), read_files=source.read_model)


def refuse_if_it_cannot_fit(
    config: ModelConfig,
    profile: OffloadProfile | None,
    force: bool,
    claims: HostClaims | None = None,
    hub: bool = False,
) -> None:
    """Before a start: a config that cannot fit is refused with the plan's numbers. Without a GPU the
    engine is vllm-cpu, and what is refused is what vLLM's CPU worker would refuse (cpu_host.py).

    ``claims``: host RAM the other workers hold. When only sleeping workers' RAM is in the way, the
    refusal is a ``HostRamHeldBySleepers`` that names them. /dev/shm is checked even where the planner
    cannot read the model: the CPU KV offload region needs room there all the same.

    ``hub``: the start downloads its model first, so a model not on this machine is planned from the
    hub's config.json and safetensors headers, with the config's token: a model that cannot fit is
    refused before a byte of it is downloaded. A hub that cannot be read (unreachable, gated) refuses
    nothing here: the download says what is wrong.
    """
    if force:
        return
    found = detect_gpu()
    gpu = None if isinstance(found, NoGPU) else found
    claims = claims or HostClaims()
    machine = read_host_memory()
    offload = kv_offload_bytes(config, profile)[0] if profile else None
    room = shm_room() if offload else None
    if room is not None:
        machine = replace(machine, shm_free=room.room)
    if gpu is None and machine.node_available is not None and claims.replaced_engine:
        machine = replace(machine, node_available=machine.node_available + engine_memory(*claims.replaced_engine))
    host = host_now(claims, machine)
    request = plan_request(config, profile, "cpu" if gpu is None else "detected")
    try:
        model = source.read_model(config.model, env=config.env) if hub else model_files.read_model(config.model)
        plan: Plan | None = make_plan(request, gpu=gpu, host=host, files=model)
    except (PlanError, OSError, ValueError, ManagerError):
        plan = None  # the planner cannot read this model; vLLM (or the download) will say what it thinks
    refusal = plan.verdict.refusal(force) if plan else None
    if plan and refusal:
        ways_out = [w.model_dump() for w in plan.verdict.ways_out]
        if claims.sleeping_bytes:
            awake_only = replace(claims, sleepers=())
            without_sleepers = make_plan(request, gpu=gpu, host=host_now(awake_only, machine), files=model)
            if without_sleepers.verdict.fits:
                short = plan.host_ram_needed_bytes - host.usable_ram
                raise HostRamHeldBySleepers(
                    f"{config.name} needs {_gib(plan.host_ram_needed_bytes)} of host RAM and "
                    f"{_gib(host.usable_ram)} is usable: {_gib(short)} short, held by sleeping workers "
                    f"({_sleepers(claims.sleepers)}; {_gib(claims.sleeping_bytes)} in all). Stop one of them "
                    "first (a request through /v1 does so by itself), or start with force if the plan is wrong "
                    "for this machine.",
                    short_bytes=max(1, short),
                    sleepers=claims.sleepers,
                )
        raise Invalid(refusal, field="model", ways_out=ways_out)
    if offload and room and room.room < offload:
        raise Invalid(_short_shm(profile, offload, room), field="offload_profile", shm_free_bytes=room.room)


def engine_memory(pid: int, create_time: float | None, cmdline: tuple[str, ...]) -> int:
    """Memory an engine's process tree gives back when it stops: its own pages (RSS less the shared,
    file-backed ones, which the node counts as available already); 0 when it is not that engine."""
    import psutil

    if not processes.matches(pid, create_time, cmdline):
        return 0
    try:
        root = psutil.Process(pid)
        tree = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0
    total = 0
    for proc in tree:
        try:
            info = proc.memory_info()
        except psutil.Error:
            continue  # a child that exited between listing and reading
        total += max(0, info.rss - getattr(info, "shared", 0))
    return total


def _sleepers(sleepers: tuple[Sleeper, ...]) -> str:
    return ", ".join(
        f"{s.config} (worker {s.worker_id}, level {s.level}, "
        f"{_gib(s.host_bytes) if s.host_bytes is not None else 'size not known'})"
        for s in sleepers
    )


def _gib(n: int) -> str:
    return f"{n / GIB:.1f} GiB"


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
    for path in processes.stale_offload_files(shm):
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


def _against_engine(
    config: ModelConfig, profile: OffloadProfile | None, log_text: str
) -> tuple[EngineKVReport, Comparison | None, str | None]:
    """vLLM's KV report from an engine log, the plan's comparison with it, and why there is none."""
    report = parse_engine_kv_report(log_text)
    if report.kv_cache_tokens is None:
        return report, None, "vLLM has not logged its KV cache size for this start yet"
    gpu = "cpu" if (report.device or "").upper() == "CPU" else "detected"
    try:
        return report, compare(make_plan(plan_request(config, profile, gpu)), report), None
    except (PlanError, model_files.ModelNotFound, OSError, ValueError) as exc:
        return report, None, str(exc)


def prediction_vs_engine(config: ModelConfig, profile: OffloadProfile | None, log_text: str) -> dict | None:
    """vLLM's own KV figures from the engine log beside the plan's prediction, with the error in %."""
    report, comparison, note = _against_engine(config, profile, log_text)
    if report.kv_cache_tokens is None:
        return None
    if comparison is None:
        return {"reported": report.model_dump(), "predicted": None, "note": note}
    return {"reported": report.model_dump(), **comparison.model_dump()}


def plan_mismatch(config: ModelConfig, profile: OffloadProfile | None, log_text: str) -> tuple[str, dict] | None:
    """After a start: the message and data of a ``plan_mismatch`` event when vLLM's KV cache size is more
    than 1 % off the plan's, so a wrong plan is seen; None when it is not (or vLLM has not reported)."""
    _, comparison, _ = _against_engine(config, profile, log_text)
    message = mismatch(comparison) if comparison else None
    if comparison is None or message is None:
        return None
    return f"{config.name}: {message}", {"config": config.name, **comparison.model_dump()}
