"""docker/compose.yaml as docker-compose resolves it: what `docker compose up` would start.

docker-compose 1.29.2 validates the file against the Compose schema and interpolates every
${VAR} without a Docker engine; the tests read its resolved output.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.docker.conftest import DOCKER, instructions

COMPOSE_FILE = DOCKER / "compose.yaml"
ENV_EXAMPLE = DOCKER / ".env.example"
VARIABLE = re.compile(r"\$\{([A-Z0-9_]+)")


def compose_variables() -> set[str]:
    return set(VARIABLE.findall(COMPOSE_FILE.read_text()))


def run_config(
    docker_compose: Path, tmp_path: Path, env_lines: list[str], compose_file: Path = COMPOSE_FILE
) -> subprocess.CompletedProcess:
    env_file = tmp_path / "env"
    env_file.write_text("\n".join(env_lines) + "\n")
    # The shell environment beats the env file in Compose; keep the developer's out of it.
    env = {k: v for k, v in os.environ.items() if k not in compose_variables() and k != "COMPOSE_PROFILES"}
    return subprocess.run(
        [str(docker_compose), "-f", str(compose_file), "--env-file", str(env_file), "config"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


def resolved(docker_compose: Path, tmp_path: Path, env_lines: list[str] | None = None) -> dict:
    result = run_config(docker_compose, tmp_path, env_lines or [])
    assert result.returncode == 0, result.stderr
    return yaml.safe_load(result.stdout)


def published(service: dict) -> dict[int, tuple[str, int]]:
    """container port -> (host address, host port), from Compose's resolved short syntax."""
    ports = {}
    for entry in service["ports"]:
        address, host_port, container = entry.rsplit("/", 1)[0].split(":")
        ports[int(container)] = (address, int(host_port))
    return ports


def container_argv(service: dict) -> list[str]:
    """What the container runs: Docker puts the command after the entrypoint, and a service that sets
    no entrypoint gets the image's (`vllm-manager serve` in docker/Dockerfile)."""
    steps = dict(instructions(DOCKER / "Dockerfile"))
    entrypoint = service.get("entrypoint", json.loads(steps["ENTRYPOINT"]))
    command = service.get("command", json.loads(steps["CMD"]) if "entrypoint" not in service else [])
    return [*entrypoint, *command]


def test_the_example_env_file_gives_a_valid_configuration(docker_compose, tmp_path):
    config = resolved(docker_compose, tmp_path, ENV_EXAMPLE.read_text().splitlines())
    assert set(config["services"]) == {"manager", "manager-cpu", "ray-head", "ray-worker", "prometheus", "grafana"}


def test_the_ray_profiles_start_the_head_with_the_manager_and_join_workers_to_it(docker_compose, tmp_path):
    env = ["RAY_HEAD_ADDRESS=10.0.0.1:6379", "VLLM_MANAGER_NODE_NAME=box2"]
    services = resolved(docker_compose, tmp_path, env)["services"]
    head, worker = services["ray-head"], services["ray-worker"]
    assert head["profiles"] == ["ray-head"] and worker["profiles"] == ["ray-worker"]
    assert container_argv(head) == ["ray-node.sh", "head"] and container_argv(worker) == ["ray-node.sh", "worker"]
    for box in (head, worker):
        # Ray and the engines on other boxes use many ports: the host's network, not published ports.
        assert box["network_mode"] == "host" and "ports" not in box
        assert box["ipc"] == "host" and box["pid"] == "host"
        [device] = box["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
    assert worker["environment"]["RAY_HEAD_ADDRESS"] == "10.0.0.1:6379"
    assert worker["environment"]["VLLM_MANAGER_NODE_NAME"] == "box2"
    assert "vllm_manager_api_token" in str(head["secrets"])  # the head serves the API on 0.0.0.0


def test_a_worker_box_without_the_head_address_says_what_to_set(tmp_path):
    done = subprocess.run(
        ["bash", str(DOCKER / "ray-node.sh"), "worker"],
        capture_output=True,
        text=True,
        timeout=30,
        env={"PATH": os.environ["PATH"]},
    )
    assert done.returncode != 0 and "set RAY_HEAD_ADDRESS" in done.stderr
    wrong = subprocess.run(["bash", str(DOCKER / "ray-node.sh")], capture_output=True, text=True, timeout=30)
    assert wrong.returncode == 2 and "usage" in wrong.stderr


def test_every_variable_the_compose_file_reads_is_in_the_example_env_file():
    documented = {
        line.split("=", 1)[0].strip()
        for line in ENV_EXAMPLE.read_text().splitlines()
        if "=" in line and not line.lstrip().startswith("#")
    }
    missing = compose_variables() - documented
    assert not missing, f"document these in docker/.env.example: {sorted(missing)}"


def test_gpu_service_gets_every_nvidia_gpu_and_the_host_ipc_and_pid_namespaces(docker_compose, tmp_path):
    manager = resolved(docker_compose, tmp_path)["services"]["manager"]
    assert manager["profiles"] == ["gpu"]
    [device] = manager["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["count"] == "all" and device["capabilities"] == ["gpu"]
    assert manager["ipc"] == "host"  # KV offload files live in /dev/shm
    assert manager["pid"] == "host"  # NVML reports host PIDs
    assert manager["restart"] == "unless-stopped"


def test_gpu_count_can_be_narrowed(docker_compose, tmp_path):
    manager = resolved(docker_compose, tmp_path, ["VLLM_MANAGER_GPU_COUNT=2"])["services"]["manager"]
    assert manager["deploy"]["resources"]["reservations"]["devices"][0]["count"] in (2, "2")


def test_cpu_profile_runs_without_any_gpu(docker_compose, tmp_path):
    cpu = resolved(docker_compose, tmp_path)["services"]["manager-cpu"]
    assert cpu["profiles"] == ["cpu"]
    assert "deploy" not in cpu and "runtime" not in cpu
    assert cpu["build"]["dockerfile"] == "docker/Dockerfile.cpu"
    assert cpu["init"] is True  # the manager is PID 1 there and orphans must be reaped
    assert cpu["restart"] == "unless-stopped"


@pytest.mark.parametrize("service", ["manager", "manager-cpu"])
def test_manager_and_worker_ports_are_published_and_workers_stay_on_loopback(docker_compose, tmp_path, service):
    config = resolved(docker_compose, tmp_path)["services"][service]
    # Published ports arrive on the container's interface, so workers must not listen on its loopback.
    assert config["environment"]["VLLM_MANAGER_WORKER_HOST"] == "0.0.0.0"
    ports = published(config)
    assert ports[7999] == ("0.0.0.0", 7999)
    workers = {port: ports[port] for port in range(8100, 8200)}
    assert all(address == "127.0.0.1" and host == port for port, (address, host) in workers.items())
    assert set(ports) == {7999, *range(8100, 8200)}


def test_the_worker_range_the_manager_uses_is_the_range_that_is_published(docker_compose, tmp_path):
    config = resolved(docker_compose, tmp_path, ["VLLM_MANAGER_WORKER_PORTS=8300-8303", "VLLM_MANAGER_PORT=9000"])
    for name in ("manager", "manager-cpu"):
        service = config["services"][name]
        assert service["environment"]["VLLM_MANAGER_WORKER_PORTS"] == "8300-8303"
        ports = published(service)
        assert ports[7999] == ("0.0.0.0", 9000)
        assert sorted(set(ports) - {7999}) == [8300, 8301, 8302, 8303]


@pytest.mark.parametrize("service", ["manager", "manager-cpu"])
def test_the_api_token_comes_from_a_secret_file(docker_compose, tmp_path, service):
    config = resolved(docker_compose, tmp_path)
    manager = config["services"][service]
    assert manager["environment"]["VLLM_MANAGER_API_TOKEN_FILE"] == "/run/secrets/vllm_manager_api_token"
    assert [s["source"] for s in manager["secrets"]] == ["vllm_manager_api_token"]
    assert config["secrets"]["vllm_manager_api_token"]["file"] == str(DOCKER / "secrets" / "api_token")
    assert "VLLM_MANAGER_API_TOKEN" not in manager["environment"]  # not visible in `docker inspect`


def test_data_and_hugging_face_cache_are_volumes_that_survive_the_container(docker_compose, tmp_path):
    config = resolved(docker_compose, tmp_path)
    mounts = {v.split(":")[1]: v.split(":")[0] for v in config["services"]["manager"]["volumes"]}
    assert mounts["/data"] == "manager-data" and mounts["/hf-cache"] == "hf-cache"
    assert {"manager-data", "hf-cache"} <= set(config["volumes"])
    cpu_mounts = {v.split(":")[1]: v.split(":")[0] for v in config["services"]["manager-cpu"]["volumes"]}
    assert cpu_mounts["/data"] == "manager-cpu-data"  # the demo never touches the GPU setup's store


def test_an_existing_hugging_face_cache_folder_can_be_mounted_instead(docker_compose, tmp_path):
    config = resolved(docker_compose, tmp_path, [f"HF_CACHE={tmp_path}/hf"])
    assert f"{tmp_path}/hf:/hf-cache:rw" in config["services"]["manager"]["volumes"]


def test_the_validator_rejects_a_misspelled_key(docker_compose, tmp_path):
    """Guards the CI step itself: a schema error must fail `config`, not pass silently."""
    broken = tmp_path / "compose.yaml"
    broken.write_text(COMPOSE_FILE.read_text().replace("stop_grace_period: 2m", "stop_grace_periods: 2m"))
    result = run_config(docker_compose, tmp_path, [], compose_file=broken)
    assert result.returncode != 0
    assert "stop_grace_periods" in result.stderr
