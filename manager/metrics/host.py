"""Host readings through psutil: CPU, RAM, swap, /dev/shm, disks, and each worker's process tree."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import psutil

# KV offload buffers live here as mmap files; a full /dev/shm is a failed engine start.
SHM_PATH = Path("/dev/shm")


@dataclass(frozen=True)
class DiskUsage:
    """Usage of the filesystem holding ``path``; ``error`` says why it could not be read."""

    label: str
    path: str
    total_bytes: int | None = None
    used_bytes: int | None = None
    free_bytes: int | None = None
    error: str | None = None

    @property
    def used_pct(self) -> float | None:
        if not self.total_bytes or self.used_bytes is None:
            return None
        return 100.0 * self.used_bytes / self.total_bytes


@dataclass(frozen=True)
class HostSample:
    cpu_pct: float
    cpu_count: int
    ram_total_bytes: int
    ram_used_bytes: int
    ram_available_bytes: int
    swap_total_bytes: int
    swap_used_bytes: int
    shm: DiskUsage | None
    disks: tuple[DiskUsage, ...]


@dataclass(frozen=True)
class ProcessTreeSample:
    """One worker's process and all its descendants (API server, engine core, workers).

    ``rss_bytes`` sums each process's resident set, so pages shared between them (torch libraries,
    a shared KV mmap) count once per process: an upper bound, which is what decides an OOM kill.
    ``cpu_pct`` is 100 per fully busy core; None on the first reading of a tree (no interval yet).
    """

    root_pid: int
    alive: bool
    pids: tuple[int, ...] = ()
    rss_bytes: int | None = None
    cpu_pct: float | None = None


def disk_usage(label: str, path: Path | str) -> DiskUsage:
    try:
        du = psutil.disk_usage(str(path))
    except OSError as exc:
        return DiskUsage(label, str(path), error=f"cannot read disk usage of {path}: {exc.strerror or exc}")
    return DiskUsage(label, str(path), du.total, du.used, du.free)


class HostCollector:
    """Samples the host. Keeps the previous CPU times of each process to turn them into a CPU %."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        # (pid, create_time) -> (user+system seconds, when read); create_time guards pid reuse
        self._cpu_seen: dict[tuple[int, float], tuple[float, float]] = {}
        psutil.cpu_percent(interval=None)  # the first call only starts the interval

    def sample(self, disks: Iterable[tuple[str, Path | str]] = ()) -> HostSample:
        """Host totals; ``disks`` are (label, path) pairs such as ("data", data_dir)."""
        vm = psutil.virtual_memory()
        sw = psutil.swap_memory()
        return HostSample(
            cpu_pct=psutil.cpu_percent(interval=None),
            cpu_count=psutil.cpu_count() or 1,
            ram_total_bytes=vm.total,
            # total - available: what a new process cannot have (psutil's `used` omits some caches).
            ram_used_bytes=vm.total - vm.available,
            ram_available_bytes=vm.available,
            swap_total_bytes=sw.total,
            swap_used_bytes=sw.used,
            shm=disk_usage("/dev/shm", SHM_PATH) if SHM_PATH.is_dir() else None,
            disks=tuple(disk_usage(label, path) for label, path in disks),
        )

    def process_trees(self, root_pids: Iterable[int]) -> dict[int, ProcessTreeSample]:
        """RSS and CPU of each root pid's tree. Call once per tick with every root, so that the
        CPU-time memory of processes that went away is dropped."""
        with self._lock:
            seen_now: dict[tuple[int, float], tuple[float, float]] = {}
            out = {pid: self._tree(pid, seen_now) for pid in root_pids}
            self._cpu_seen = seen_now
            return out

    def _tree(self, root_pid: int, seen_now: dict) -> ProcessTreeSample:
        try:
            root = psutil.Process(root_pid)
            procs = [root, *root.children(recursive=True)]
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            return ProcessTreeSample(root_pid, alive=False)
        except psutil.AccessDenied:
            return ProcessTreeSample(root_pid, alive=True)
        rss = 0
        cpu_pct = 0.0
        measured = False
        pids = []
        for proc in procs:
            try:
                with proc.oneshot():
                    key = (proc.pid, proc.create_time())
                    times = proc.cpu_times()
                    rss += proc.memory_info().rss
            except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
                continue  # a child that exited between listing and reading
            pids.append(proc.pid)
            now = self._clock()
            used = times.user + times.system
            seen_now[key] = (used, now)
            before = self._cpu_seen.get(key)
            if before is not None and now > before[1]:
                cpu_pct += 100.0 * (used - before[0]) / (now - before[1])
                measured = True
        return ProcessTreeSample(
            root_pid,
            alive=True,
            pids=tuple(pids),
            rss_bytes=rss,
            cpu_pct=cpu_pct if measured else None,
        )
