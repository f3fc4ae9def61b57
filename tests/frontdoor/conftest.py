"""Front door fixtures: a manager whose engines are stand-ins (fast), and one served on a real port."""

from __future__ import annotations

import fcntl
import socket
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.testclient import TestClient

from manager.app import create_app
from manager.settings import Settings
from tests.conftest import ENGINE_LOCK
from tests.support.downloads import Downloads
from tests.support.engine import stop_leftover_engines

STAND_IN = Path(__file__).with_name("stand_in_engine.py")


@pytest.fixture
def stand_in_python(tmp_path) -> str:
    """An "engine interpreter" that runs the stand-in whatever module it is asked to run."""
    # A Python script rather than a shell one: its command line stays the same from spawn to exit,
    # so the manager recognises the process as its own (a shell exec would change it).
    script = tmp_path / "engine-python"
    script.write_text(
        f"#!{sys.executable}\nimport runpy, sys\nsys.argv[0] = {str(STAND_IN)!r}\n"
        f"runpy.run_path({str(STAND_IN)!r}, run_name='__main__')\n"
    )
    script.chmod(0o755)
    return str(script)


@pytest.fixture(autouse=True)
def models_in_place(hub_models_in_place) -> Downloads:
    """The configs here name hub ids (org/a) that no test downloads: a start finds them in place."""
    return hub_models_in_place


@pytest.fixture
def door_settings(settings, stand_in_python) -> Iterator[Settings]:
    quick = settings.model_copy(
        update={
            "engine_python": stand_in_python,
            "worker_ports": "18400-18499",
            "stop_grace_s": 5.0,
            "health_interval_s": 0.5,
            "idle_check_s": 0.2,
            "proxy_drain_timeout_s": 10.0,
            # Engines outlive a manager by design; these tests stop theirs with it.
            "stop_workers_on_exit": True,
            # The stand-in takes its knobs from STAND_IN_* variables, which only this opt-out lets through.
            "allow_code_flags": True,
        }
    )
    yield quick
    stop_leftover_engines(quick.data_dir)


def two_models(client: TestClient, **extra: dict) -> None:
    """a and b share GPU 0, so only one of them may run at a time."""
    a: dict[str, Any] = {"name": "a", "model": "org/a", "served_model_name": "org/model-a", "aliases": ["alpha"]}
    b: dict[str, Any] = {"name": "b", "model": "org/b"}
    for body in (a, b):
        body.update({"gpu_ids": [0], "start_timeout_s": 60, **extra.get(body["name"], {})})
        created = client.post("/api/models", json=body)
        assert created.status_code == 201, created.text


@pytest.fixture
def door(door_settings) -> Iterator[TestClient]:
    with TestClient(create_app(door_settings)) as client:
        two_models(client)
        yield client


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def served(app: FastAPI) -> Iterator[str]:
    """The app on a real port (uvicorn in a thread): real streaming, real disconnects."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the manager did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(60)


@contextmanager
def manager_with_engines(data_dir: Path, configs: list[dict], **settings: Any) -> Iterator[str]:
    """The manager on a real port with real engines (their ports 18100-18199), these model configs
    stored; it holds this machine's engine lock for as long as it serves, and ends every engine its
    workers started when it stops, a test that failed part-way included."""
    ENGINE_LOCK.touch(exist_ok=True)
    with ENGINE_LOCK.open() as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one test module with engines at a time on this machine
        chosen = Settings(
            **{
                "data_dir": data_dir,
                "engine_python": sys.executable,
                "api_token": None,
                "health_interval_s": 1.0,
                "stop_grace_s": 15.0,
                "worker_ports": "18100-18199",
                "idle_check_s": 0.5,
                **settings,
            }
        )
        try:
            with served(create_app(chosen)) as url:
                for body in configs:
                    answer = httpx.post(f"{url}/api/models", json=body)
                    assert answer.status_code == 201, answer.text
                yield url
        finally:
            stop_leftover_engines(data_dir)
            fcntl.flock(lock, fcntl.LOCK_UN)
