"""docker/compose.yaml's `monitoring` profile: Prometheus and Grafana, and the files they are given.

Read with PyYAML, no Docker engine (and no image: neither prom/prometheus nor grafana/grafana can be
pulled here, so neither has been run by these tests). Where docker-compose is installed
(docker/ci/install-linters.sh), the resolved file is checked too. No promtool is at hand either:
docker/prometheus/prometheus.yml is checked for what the manager and Compose need of it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import yaml
from fastapi.testclient import TestClient

from manager.app import create_app
from manager.settings import Settings
from tests.docker.conftest import DOCKER
from tests.docker.test_compose import published, resolved

COMPOSE = yaml.safe_load((DOCKER / "compose.yaml").read_text())
SERVICES = COMPOSE["services"]
PROMETHEUS_CONFIG = DOCKER / "prometheus" / "prometheus.yml"
GRAFANA_PROVISIONING = DOCKER / "grafana" / "provisioning"
TOKEN = "t" * 40


def bind_mounts(service: str) -> dict[str, str]:
    """container path -> host path (relative to docker/) of a service's folder and file mounts."""
    mounts = {}
    for volume in SERVICES[service]["volumes"]:
        source, target = volume.split(":")[:2]
        if source.startswith("./"):
            mounts[target] = source
    return mounts


def scrape_job(name: str) -> dict:
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    return next(job for job in config["scrape_configs"] if job["job_name"] == name)


def targets(job: dict) -> set[str]:
    return {target for group in job["static_configs"] for target in group["targets"]}


def test_monitoring_profile_runs_prometheus_and_grafana_from_pinned_images():
    monitoring = {name for name, service in SERVICES.items() if "monitoring" in service.get("profiles", [])}
    assert monitoring == {"prometheus", "grafana"}
    assert re.fullmatch(r"prom/prometheus:v\d+\.\d+\.\d+", SERVICES["prometheus"]["image"])
    assert re.fullmatch(r"grafana/grafana:\d+\.\d+\.\d+", SERVICES["grafana"]["image"])


def test_every_file_the_monitoring_services_mount_is_in_the_repository():
    for service in ("prometheus", "grafana"):
        for target, source in bind_mounts(service).items():
            assert (DOCKER / source).exists(), f"{service} mounts {source} at {target}, which does not exist"
    assert bind_mounts("prometheus")["/etc/prometheus/prometheus.yml"] == "./prometheus/prometheus.yml"
    command = SERVICES["prometheus"]["command"]
    assert "--config.file=/etc/prometheus/prometheus.yml" in command


def test_grafana_provisions_the_compose_prometheus_and_the_dashboard_folder():
    mounts = bind_mounts("grafana")
    assert mounts["/etc/grafana/provisioning"] == "./grafana/provisioning"
    [datasource] = yaml.safe_load((GRAFANA_PROVISIONING / "datasources" / "prometheus.yaml").read_text())["datasources"]
    assert datasource["type"] == "prometheus" and datasource["isDefault"] is True
    # The service name on the Compose network, and the port Prometheus listens on inside it.
    assert datasource["url"] == "http://prometheus:9090"
    assert "prometheus" in SERVICES and SERVICES["prometheus"]["ports"][0].endswith(":9090")
    [provider] = yaml.safe_load((GRAFANA_PROVISIONING / "dashboards" / "vllm-manager.yaml").read_text())["providers"]
    folder = provider["options"]["path"]
    assert mounts[folder] == "./grafana/dashboards"
    assert (DOCKER / mounts[folder] / "vllm-manager.json").is_file()


def test_grafana_has_no_anonymous_access_and_its_admin_password_comes_from_the_env_file():
    env = SERVICES["grafana"]["environment"]
    assert env["GF_AUTH_ANONYMOUS_ENABLED"] == "false"
    assert env["GF_USERS_ALLOW_SIGN_UP"] == "false"
    assert env["GF_SECURITY_ADMIN_PASSWORD"] == "${GRAFANA_ADMIN_PASSWORD:-}"


def _grafana_start(tmp_path, password: str) -> subprocess.CompletedProcess:
    """The grafana service's entrypoint as Docker runs it ($$ is Compose's escaped $), with the
    image's /run.sh replaced by a script that says it was started."""
    shell, flag, script, name = SERVICES["grafana"]["entrypoint"]
    run_sh = tmp_path / "run.sh"
    run_sh.write_text('#!/bin/sh\necho "grafana started $*"\n')
    run_sh.chmod(0o755)
    script = script.replace("$$", "$").replace("/run.sh", str(run_sh))
    env = {"PATH": os.environ["PATH"], "GF_SECURITY_ADMIN_PASSWORD": password}
    return subprocess.run([shell, flag, script, name], capture_output=True, text=True, env=env, timeout=30)


def test_grafana_refuses_to_start_with_an_empty_admin_password(tmp_path):
    refused = _grafana_start(tmp_path, "")
    assert refused.returncode == 1 and "set GRAFANA_ADMIN_PASSWORD in docker/.env" in refused.stderr
    assert "started" not in refused.stdout
    started = _grafana_start(tmp_path, "a long admin password")
    assert started.returncode == 0 and started.stdout.strip() == "grafana started"


def test_prometheus_sends_the_token_file_compose_gives_it_to_read_the_managers_metrics():
    job = scrape_job("vllm-manager")
    assert job.get("metrics_path", "/metrics") == "/metrics"
    assert targets(job) == {"manager:7999", "manager-cpu:7999"}  # the gpu and the cpu profile's service
    assert job["authorization"]["type"] == "Bearer"
    [secret] = SERVICES["prometheus"]["secrets"]
    assert job["authorization"]["credentials_file"] == f"/run/secrets/{secret}"
    assert COMPOSE["secrets"][secret]["file"] == "${VLLM_MANAGER_METRICS_TOKEN_FILE_ON_HOST:-./secrets/api_token}"


def test_once_the_manager_has_a_token_its_metrics_need_it(tmp_path):
    """Why the scrape carries a token: without one, Prometheus would read only 401s."""
    settings = Settings(
        data_dir=tmp_path / "data", engine_python=sys.executable, api_token=TOKEN, stop_workers_on_exit=False
    )
    with TestClient(create_app(settings)) as client:
        assert client.get("/metrics").status_code == 401
        answer = client.get("/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
        assert answer.status_code == 200 and "vllm_manager_process_cpu_seconds_total" in answer.text


def test_prometheus_scrapes_every_port_the_manager_may_give_a_worker():
    """The manager does not re-export its engines' vLLM metrics, so each worker port is a target."""
    default = re.search(r"\$\{VLLM_MANAGER_WORKER_PORTS:-(\d+)-(\d+)\}", SERVICES["manager"]["ports"][1])
    assert default is not None
    ports = range(int(default.group(1)), int(default.group(2)) + 1)
    job = scrape_job("vllm-engines")
    assert "authorization" not in job  # vLLM serves /metrics without its --api-key
    assert targets(job) == {f"{host}:{port}" for host in ("manager", "manager-cpu") for port in ports}


def test_prometheus_and_grafana_are_published_on_loopback_unless_told_otherwise(docker_compose, tmp_path):
    services = resolved(docker_compose, tmp_path)["services"]
    assert published(services["prometheus"]) == {9090: ("127.0.0.1", 9090)}
    assert published(services["grafana"]) == {3000: ("127.0.0.1", 3000)}
    moved = resolved(docker_compose, tmp_path, ["GRAFANA_PUBLISH_ADDRESS=0.0.0.0", "GRAFANA_PORT=3300"])
    assert published(moved["services"]["grafana"]) == {3000: ("0.0.0.0", 3300)}


@pytest.mark.parametrize("service", ["prometheus", "grafana"])
def test_the_monitoring_data_lives_in_named_volumes(docker_compose, tmp_path, service):
    config = resolved(docker_compose, tmp_path)
    data = {"prometheus": ("prometheus-data", "/prometheus"), "grafana": ("grafana-data", "/var/lib/grafana")}
    volume, path = data[service]
    assert f"{volume}:{path}:rw" in config["services"][service]["volumes"]
    assert volume in config["volumes"]
