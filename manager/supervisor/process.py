"""Engine processes: start one in its own session, recognise it again later, and end its whole group."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from manager.launch.command import inherited_env
from manager.launch.flags import flag_value
from manager.supervisor.logs import PRIVATE_DIR, open_private

ENGINE_MARKERS = ("vllm.entrypoints.openai.api_server", "vllm.entrypoints.cli.main")


@dataclass(frozen=True)
class Identity:
    """What makes a pid ours: the pid alone can be reused, pid + start time + argv cannot."""

    pid: int
    create_time: float
    cmdline: tuple[str, ...]


def spawn(argv: list[str], env: dict[str, str], log_path: Path, cwd: Path | None = None) -> subprocess.Popen:
    """Start the engine in a new session (its own process group), writing straight to its log file.

    The engine writes to the file, not to a pipe: a pipe to the manager would break (and kill the
    engine with SIGPIPE) when the manager restarts, and engines must outlive the manager.
    """
    log_path.parent.mkdir(parents=True, exist_ok=True, mode=PRIVATE_DIR)
    with open_private(log_path, os.O_WRONLY | os.O_APPEND) as log:
        return subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**inherited_env(), "PYTHONUNBUFFERED": "1", **env},
            cwd=cwd,
            start_new_session=True,
            close_fds=True,
        )


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
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def group_members(pgid: int) -> list[int]:
    members = []
    for proc in psutil.process_iter(["pid", "status"]):
        try:
            if proc.info["status"] != psutil.STATUS_ZOMBIE and os.getpgid(proc.info["pid"]) == pgid:
                members.append(proc.info["pid"])
        except (ProcessLookupError, PermissionError, psutil.Error):
            continue
    return members


def tree(pid: int) -> list[int]:
    try:
        root = psutil.Process(pid)
        return [pid] + [c.pid for c in root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


@dataclass
class StopReport:
    graceful: bool
    killed: list[int]
    leftover: list[int]
    seconds: float


def stop_group(pid: int, grace_s: float, popen: subprocess.Popen | None = None) -> StopReport:
    """SIGTERM to the group, wait up to grace_s, SIGKILL to the group, then check nothing is left.

    Descendants that left the group (a new session) are found through the process tree first, so
    they are ended too.
    """
    started = time.monotonic()
    pgid = pid  # the engine is a session leader: its pgid is its pid
    pids = set(tree(pid)) | set(group_members(pgid))
    _signal_all(pgid, pids, signal.SIGTERM)
    deadline = started + grace_s
    while time.monotonic() < deadline:
        if popen is not None:
            popen.poll()
        if not _any_alive(pids | set(group_members(pgid))):
            return StopReport(True, [], [], time.monotonic() - started)
        time.sleep(0.1)
    remaining = {p for p in pids | set(group_members(pgid)) if alive(p)}
    _signal_all(pgid, remaining, signal.SIGKILL)
    end = time.monotonic() + 10
    while time.monotonic() < end and _any_alive(remaining):
        if popen is not None:
            popen.poll()
        time.sleep(0.05)
    if popen is not None:
        popen.poll()
    leftover = sorted(p for p in remaining | set(group_members(pgid)) if alive(p))
    return StopReport(False, sorted(remaining), leftover, time.monotonic() - started)


def _signal_all(pgid: int, pids: set[int], sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)
    for p in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(p, sig)


def _any_alive(pids: set[int]) -> bool:
    return any(alive(p) for p in pids)


@dataclass(frozen=True)
class Unmanaged:
    pid: int
    cmdline: list[str]
    model: str | None
    port: int | None
    create_time: float


def is_engine_cmdline(cmdline: list[str]) -> bool:
    text = " ".join(cmdline)
    if any(marker in text for marker in ENGINE_MARKERS):
        return True
    # `vllm serve MODEL` through the console script
    return len(cmdline) >= 2 and any(Path(p).name == "vllm" for p in cmdline[:2]) and "serve" in cmdline[1:3]


def find_engines(exclude: set[int]) -> list[Unmanaged]:
    """vLLM API servers on this box that are not in `exclude` (managed pids and their children)."""
    found = []
    for proc in psutil.process_iter(["pid", "cmdline", "create_time", "ppid"]):
        info = proc.info
        cmd = info.get("cmdline") or []
        if info["pid"] in exclude or not cmd or not is_engine_cmdline(cmd):
            continue
        try:
            parent_cmd = psutil.Process(info["ppid"]).cmdline() if info["ppid"] else []
        except psutil.Error:
            parent_cmd = []
        if parent_cmd and is_engine_cmdline(parent_cmd):
            continue  # a child of another engine (its engine core), not a server of its own
        model = flag_value(cmd, "--model")
        if model is None and "serve" in cmd:
            idx = cmd.index("serve")
            model = cmd[idx + 1] if idx + 1 < len(cmd) and not cmd[idx + 1].startswith("-") else None
        port = flag_value(cmd, "--port")
        found.append(
            Unmanaged(info["pid"], cmd, model, int(port) if port and port.isdigit() else 8000, info["create_time"])
        )
    return found


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
