"""Processes on this box as a start's checks read them: which process a pid is (pid + start time + argv,
since a pid alone is reused), whether it still runs, and the KV-offload files in /dev/shm that no live
process holds any more."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import psutil


@dataclass(frozen=True)
class Identity:
    """What makes a pid ours: the pid alone can be reused, pid + start time + argv cannot."""

    pid: int
    create_time: float
    cmdline: tuple[str, ...]


def identity(pid: int) -> Identity | None:
    try:
        proc = psutil.Process(pid)
        cmdline = proc.cmdline()
        # Just after spawn returns, the kernel may not have laid out the new program's arguments yet:
        # its command line reads empty for a moment, and stored so, it would never match again.
        for _ in range(20):
            if cmdline:
                break
            time.sleep(0.01)
            cmdline = proc.cmdline()
        return Identity(pid, proc.create_time(), tuple(cmdline))
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None


def matches(pid: int | None, create_time: float | None, cmdline: list[str] | tuple[str, ...]) -> bool:
    if not pid or create_time is None:
        return False
    found = identity(pid)
    return (
        found is not None
        and abs(found.create_time - create_time) < 0.05
        and list(found.cmdline) == list(cmdline)
        and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    )


def alive(pid: int) -> bool:
    """Whether ``pid`` still runs. A process whose main thread has ended shows as a zombie while its
    other threads go on, and the last of them closes its files: an engine rank killed while it holds
    a GPU is still freeing it then. Only a zombie with no thread left is ended."""
    try:
        if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
            return True
    except psutil.NoSuchProcess:
        return False
    try:
        return any(task != str(pid) for task in os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return False


def stale_offload_files(shm: Path = Path("/dev/shm")) -> list[Path]:
    """vLLM KV-offload regions of ours that no live process maps or holds open (left by a killed engine).

    Only files owned by this user are candidates: another user's region is never touched.
    """
    me = os.getuid()
    candidates = []
    for path in sorted(shm.glob("vllm_offload_*")):
        try:
            if path.stat().st_uid == me:
                candidates.append(path)
        except OSError:
            continue
    if not candidates:
        return []
    names = {str(c) for c in candidates}
    in_use: set[str] = set()
    for proc in psutil.process_iter(["pid"]):
        pid = proc.info["pid"]
        try:
            maps = Path(f"/proc/{pid}/maps").read_text(errors="replace")
        except OSError:
            continue  # gone, or not ours to read (engines run as this user and are readable)
        in_use.update(n for n in names if n in maps)
        for fd in _fds(pid):
            if fd in names:
                in_use.add(fd)
    return [c for c in candidates if str(c) not in in_use]


def remove_stale_offload_files() -> list[str]:
    """Remove the stale KV-offload files (``stale_offload_files``); the paths removed."""
    removed = []
    for path in stale_offload_files():
        try:
            path.unlink(missing_ok=True)
        except OSError:
            continue
        removed.append(str(path))
    return removed


def _fds(pid: int) -> list[str]:
    targets: list[str] = []
    try:
        entries = list(Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return targets
    for fd in entries:
        try:
            targets.append(os.readlink(fd))
        except OSError:
            continue  # closed meanwhile
    return targets
