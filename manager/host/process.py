"""Engine processes: start one in its own session, end its whole group, and find the engines on this box
that the manager did not start (recognising one again is ``manager.processes``)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from manager.host.private_files import PRIVATE_DIR, open_private
from manager.launch.command import inherited_env
from manager.launch.flags import flag_value
from manager.processes import alive

ENGINE_MARKERS = ("vllm.entrypoints.openai.api_server", "vllm.entrypoints.cli.main")


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


def group_members(pgid: int) -> list[int]:
    members = []
    for proc in psutil.process_iter(["pid"]):
        try:
            if os.getpgid(proc.info["pid"]) == pgid and alive(proc.info["pid"]):
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
