"""`vllm-manager serve --ray-address`: a cluster that does not answer ends the start; without an address
the manager never imports Ray."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

CLI = [sys.executable, "-m", "manager"]


def test_a_ray_address_that_does_not_answer_stops_serve_with_what_to_do(tmp_path):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        closed = sock.getsockname()[1]  # nothing listens once the socket is closed
    done = subprocess.run(
        [*CLI, "serve", "--port", "0", "--data-dir", str(tmp_path), "--ray-address", f"127.0.0.1:{closed}"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "VLLM_MANAGER_API_TOKEN": ""},
    )
    assert done.returncode == 2
    assert f"nothing answers at the Ray address 127.0.0.1:{closed}" in done.stderr
    assert "ray start --head" in done.stderr


def test_a_malformed_ray_address_is_refused_before_anything_starts(tmp_path):
    done = subprocess.run(
        [*CLI, "serve", "--data-dir", str(tmp_path), "--ray-address", "head-without-port"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "VLLM_MANAGER_API_TOKEN": ""},
    )
    assert done.returncode == 2 and "host:port" in done.stderr


def test_without_a_ray_address_the_manager_runs_without_ray(tmp_path):
    script = (
        "import sys\n"
        "from fastapi.testclient import TestClient\n"
        "from manager.app import create_app\n"
        "from manager.settings import Settings\n"
        f"with TestClient(create_app(Settings(data_dir={str(tmp_path)!r}, api_token=None))) as c:\n"
        "    nodes = c.get('/api/nodes').json()\n"
        "    assert len(nodes) == 1 and nodes[0]['here'] and nodes[0]['node_id'] is None, nodes\n"
        "    assert c.get('/nodes').status_code == 200\n"
        "print('ray' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "False"
