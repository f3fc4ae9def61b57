"""What `vllm-manager serve` does with its workers when it stops, and a second serve on a taken port."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from manager import processes
from tests.cli.test_cli import _serve as serve_cli
from tests.support.engine import free_port, stop_leftover_engines, tiny_config, wait_for_state

CLI = [sys.executable, "-m", "manager"]


def _serve(data_dir: Path, port: int, *extra: str) -> subprocess.Popen[str]:
    return serve_cli(data_dir, port, *extra, env={"VLLM_MANAGER_WORKER_PORTS": "18300-18349"})


def _stop(proc: subprocess.Popen[str]) -> str:
    proc.send_signal(signal.SIGTERM)
    return proc.communicate(timeout=120)[0]


def _ready_worker(port: int, model_dir: Path) -> dict:
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30)
    assert client.post("/api/models", json=tiny_config("tiny", model_dir)).status_code == 201
    started = client.post("/api/workers", json={"model": "tiny"})
    assert started.status_code == 201, started.text
    worker = wait_for_state(client, started.json()["id"], {"ready", "failed"})
    assert worker["state"] == "ready", worker
    return worker


@pytest.mark.engine
def test_a_clean_stop_stops_the_workers_and_keep_workers_leaves_them_for_the_next_manager(
    tmp_path, tiny_llama, engine_slot
):
    data = tmp_path / "data"
    try:
        port = free_port()
        manager = _serve(data, port)
        pid = _ready_worker(port, tiny_llama)["pid"]
        _stop(manager)  # as Ctrl-C or `systemctl stop` would
        assert not processes.alive(pid), "the engine outlived a clean stop of its manager"

        manager = _serve(data, port, "--keep-workers")
        client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30)
        wid = client.post("/api/workers", json={"model": "tiny"}).json()["id"]
        pid = wait_for_state(client, wid, {"ready", "failed"})["pid"]
        _stop(manager)
        assert processes.alive(pid), "--keep-workers stopped the engine"

        manager = _serve(data, port)
        client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30)
        adopted = wait_for_state(client, wid, {"ready", "failed", "stopped"}, timeout=60)
        assert adopted["state"] == "ready" and adopted["pid"] == pid
        _stop(manager)
        assert not processes.alive(pid)
    finally:
        stop_leftover_engines(data)


def test_a_second_manager_on_a_taken_port_ends_before_touching_anything(tmp_path):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        done = subprocess.run(
            [*CLI, "serve", "--port", str(port), "--data-dir", str(tmp_path / "data")],
            capture_output=True, text=True, timeout=60, env={**os.environ, "VLLM_MANAGER_API_TOKEN": ""},
        )  # fmt: skip
    assert done.returncode == 3
    assert f"cannot listen on 127.0.0.1:{port}" in done.stderr and "another --port" in done.stderr
    # The app never started: no worker was adopted, no start-up ran.
    assert "startup" not in (done.stdout + done.stderr).lower()
