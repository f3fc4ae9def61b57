"""Where a worker's engine process runs: the one interface the supervisor's runner carries out its
process effects through (start, recognise, stop, clean up, read its log), and the local host.

The Ray host (``manager.cluster.ray_cluster``) runs the same local code on another node through that
node's agent; nothing above the runner knows which one a worker has.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from manager import processes
from manager.host import gpu_cleanup, process
from manager.metrics.gpu_mask import engine_devices, visible_devices

LOOPBACK = "127.0.0.1"
LOG_CHUNK = 1 << 20  # the most a log read returns at once
KEEP_ENDED = 64  # ended engines whose exit code is kept


@dataclass(frozen=True)
class Spawned:
    """A started engine: pid + start time + argv identify it later (a pid alone is reused)."""

    pid: int
    create_time: float | None
    cmdline: tuple[str, ...]


class ProcessHost(Protocol):
    """One box's engine processes. Every call may block (a process table scan, a call to another
    node): the runner makes them from a thread."""

    node: str | None  # the Ray node's name; None without a cluster
    address: str  # where the manager reaches this box's engines over HTTP

    def spawn(self, argv: list[str], env: dict[str, str], log_path: Path, cwd: Path) -> Spawned: ...

    def alive(self, pid: int, create_time: float | None, cmdline: tuple[str, ...]) -> bool: ...

    def exit_code(self, pid: int) -> int | None: ...

    def stop_group(self, pid: int, grace_s: float) -> process.StopReport: ...

    def end_gpu_orphans(self, gpus: list[int], pids: list[int]) -> list[str]: ...

    def remove_stale_offload_files(self) -> list[str]: ...

    def read_log(self, path: Path, offset: int) -> bytes: ...


class LocalHost:
    """This box: today's ``process`` functions, with the Popen of each engine it started kept for its
    exit code (an adopted engine has none and is recognised by its identity)."""

    def __init__(self, node: str | None = None) -> None:
        self.node = node
        self.address = LOOPBACK
        self._popens: dict[int, subprocess.Popen[bytes]] = {}

    def spawn(self, argv: list[str], env: dict[str, str], log_path: Path, cwd: Path) -> Spawned:
        try:
            env = engine_devices(env, visible_devices())
        except ValueError as exc:
            raise OSError(str(exc)) from None
        popen = process.spawn(argv, env, log_path, cwd)
        # Ended engines are kept for their exit code (a crash report reads it after the group is
        # stopped); only the oldest of many are let go.
        ended = [pid for pid, p in self._popens.items() if p.poll() is not None]
        for pid in ended[: max(0, len(ended) - KEEP_ENDED)]:
            del self._popens[pid]
        self._popens[popen.pid] = popen
        found = processes.identity(popen.pid)
        if found is None:
            return Spawned(popen.pid, None, tuple(argv))
        return Spawned(popen.pid, found.create_time, found.cmdline)

    def alive(self, pid: int, create_time: float | None, cmdline: tuple[str, ...]) -> bool:
        popen = self._popens.get(pid)
        if popen is not None:
            return popen.poll() is None
        return processes.matches(pid, create_time, cmdline)

    def exit_code(self, pid: int) -> int | None:
        popen = self._popens.get(pid)
        return popen.returncode if popen is not None else None

    def stop_group(self, pid: int, grace_s: float) -> process.StopReport:
        return process.stop_group(pid, grace_s, self._popens.get(pid))

    def end_gpu_orphans(self, gpus: list[int], pids: list[int]) -> list[str]:
        return gpu_cleanup.end_gpu_orphans(gpus, pids)

    def remove_stale_offload_files(self) -> list[str]:
        return processes.remove_stale_offload_files()

    def read_log(self, path: Path, offset: int) -> bytes:
        return read_chunk(path, offset)


def read_chunk(path: Path, offset: int) -> bytes:
    """Up to LOG_CHUNK bytes of ``path`` from ``offset``; nothing when it is gone or shorter."""
    try:
        with path.open("rb") as handle:
            handle.seek(offset)
            return handle.read(LOG_CHUNK)
    except OSError:
        return b""
