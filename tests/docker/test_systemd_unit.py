"""docker/vllm-manager.service, checked by systemd's own parser (systemd-analyze verify)."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from tests.docker.conftest import DOCKER

UNIT = DOCKER / "vllm-manager.service"
EXEC = "/opt/vllm-manager/venv/bin/vllm-manager"


def service_section() -> dict[str, list[str]]:
    # systemd keeps every repeated key (Environment=...), configparser only the last: parse by hand.
    values: dict[str, list[str]] = {}
    section = None
    for line in UNIT.read_text().splitlines():
        line = line.strip()
        if line.startswith("["):
            section = line
        elif section == "[Service]" and "=" in line and not line.startswith("#"):
            key, value = line.split("=", 1)
            values.setdefault(key, []).append(value)
    return values


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_systemd_accepts_every_line_of_the_unit(tmp_path):
    # verify also requires ExecStart's binary to exist; the venv only exists after an install,
    # so that one path points at a real executable here.
    assert EXEC in UNIT.read_text()
    unit = tmp_path / UNIT.name
    unit.write_text(UNIT.read_text().replace(EXEC, shutil.which("true")))
    result = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and not result.stderr.strip(), result.stderr


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_the_verifier_reports_a_bad_line(tmp_path):
    """Guards the check above: a misspelled value must show up on stderr."""
    unit = tmp_path / UNIT.name
    unit.write_text(UNIT.read_text().replace(EXEC, shutil.which("true")).replace("KillMode=mixed", "KillMode=mixd"))
    result = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60)
    assert "mixd" in result.stderr


def test_on_stop_systemd_signals_the_manager_alone_and_waits_for_it_to_stop_its_workers():
    service = service_section()
    assert service["KillMode"] == ["mixed"]  # SIGTERM to the main process; SIGKILL to all only at timeout
    assert int(service["TimeoutStopSec"][0]) >= 60
    assert service["Restart"] == ["on-failure"]
    assert service["ExecStart"][0].startswith(f"{EXEC} serve ")


def test_the_token_reaches_the_manager_as_a_credential_file():
    service = service_section()
    [credential] = service["LoadCredential"]
    name = credential.split(":", 1)[0]
    assert f"VLLM_MANAGER_API_TOKEN_FILE=/run/credentials/%n/{name}" in service["Environment"]
