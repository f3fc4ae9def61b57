"""Servers a benchmark starts as real processes (the manager's ``serve`` above all), and the figures
every load benchmark reports: percentiles and a process's CPU."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(url: str, timeout_s: float, proc: subprocess.Popen | None = None, log: Path | None = None) -> None:
    """Until ``url`` answers 200 (or fail with the end of the process's log)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc is not None and proc.poll() is not None:
            tail = log.read_text()[-3000:] if log and log.exists() else ""
            raise RuntimeError(f"{proc.args!r} exited with {proc.returncode} before {url} answered:\n{tail}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2).status_code == 200:
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} did not answer within {timeout_s:.0f} s")
        time.sleep(0.3)


@dataclass
class Server:
    proc: subprocess.Popen
    port: int
    log: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@contextlib.contextmanager
def started(
    argv: Sequence[str],
    port: int,
    log: Path,
    ready_path: str,
    env: dict[str, str] | None = None,
    timeout_s: float = 120,
) -> Iterator[Server]:
    """A server process (its own session, output to ``log``), ready once ``ready_path`` answers 200;
    stopped with SIGINT (then SIGKILL after 30 s) on the way out."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as out:
        proc = subprocess.Popen(
            list(argv),
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            cwd=ROOT,
            start_new_session=True,
        )
    server = Server(proc, port, log)
    try:
        wait_for(server.url + ready_path, timeout_s, proc, log)
        yield server
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)


@contextlib.contextmanager
def manager(data_dir: Path, port: int, env: dict[str, str] | None = None) -> Iterator[Server]:
    """``python -m manager serve`` of this tree, with its own data dir and port."""
    argv = [sys.executable, "-m", "manager", "serve", "--port", str(port), "--data-dir", str(data_dir)]
    # This tree first, whatever the venv has installed.
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    with started(argv, port, data_dir.parent / "manager.log", "/api/health", {"PYTHONPATH": path, **(env or {})}) as s:
        yield s


def cpu_seconds(pid: int) -> float:
    """User + system CPU of one process (not its children)."""
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def percentile(ordered: Sequence[float], q: float) -> float:
    """The q-quantile (0..1) of sorted values, nearest rank."""
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))]


def ms(seconds: float) -> float:
    return round(1000 * seconds, 3)
