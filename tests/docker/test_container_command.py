"""The GPU image's command (ENTRYPOINT + CMD of docker/Dockerfile) run against the real manager,
with the environment docker/compose.yaml gives it, and probed by the image's health check."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.docker.conftest import DOCKER
from tests.docker.test_dockerfiles import instructions

VENV_BIN = Path(sys.executable).parent


def container_command(port: int) -> list[str]:
    steps = dict(instructions(DOCKER / "Dockerfile"))
    argv = json.loads(steps["ENTRYPOINT"]) + json.loads(steps["CMD"])
    argv[argv.index("--port") + 1] = str(port)  # 7999 may be taken on a shared machine
    return [str(VENV_BIN / argv[0]), *argv[1:]]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def container_env(tmp_path) -> dict[str, str]:
    secret = tmp_path / "secrets" / "api_token"
    secret.parent.mkdir()
    secret.write_text("a-token-from-a-docker-secret-of-43-characters\n")
    clean = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_MANAGER_")}
    return {
        **clean,
        "VLLM_MANAGER_DATA_DIR": str(tmp_path / "data"),  # ENV in the image
        "VLLM_MANAGER_API_TOKEN_FILE": str(secret),  # compose.yaml's secret
        "VLLM_MANAGER_WORKER_PORTS": "8100-8199",
    }


def test_with_the_secret_the_manager_serves_on_all_addresses_and_passes_its_health_check(container_env):
    port = free_port()
    manager = subprocess.Popen(
        container_command(port), env=container_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        probe_env = {**container_env, "VLLM_MANAGER_HEALTH_URL": f"http://127.0.0.1:{port}/api/health"}
        deadline = time.monotonic() + 60
        while True:
            assert manager.poll() is None, manager.stdout.read()
            probe = subprocess.run(
                [sys.executable, str(DOCKER / "healthcheck.py")],
                env=probe_env,
                capture_output=True,
                text=True,
                timeout=30,
            )
            if probe.returncode == 0:
                break
            assert time.monotonic() < deadline, f"still unhealthy after 60 s: {probe.stderr}"
            time.sleep(0.5)
        # Bound to every address, as Docker's published port needs. On Linux all of 127/8 is
        # local, but a socket bound to 127.0.0.1 alone does not answer on 127.0.0.2.
        with socket.create_connection(("127.0.0.2", port), timeout=5):
            pass
    finally:
        manager.terminate()
        manager.wait(timeout=30)


def test_without_a_token_the_container_stops_with_a_message_saying_what_to_do(container_env):
    del container_env["VLLM_MANAGER_API_TOKEN_FILE"]
    result = subprocess.run(
        container_command(free_port()), env=container_env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode != 0
    assert "VLLM_MANAGER_API_TOKEN" in result.stderr
