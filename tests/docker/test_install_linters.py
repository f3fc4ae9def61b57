"""docker/ci/install-linters.sh: the test command runs it before every pytest run."""

from __future__ import annotations

import os
import subprocess

from tests.docker.conftest import DOCKER, lint_venv

SCRIPT = DOCKER / "ci" / "install-linters.sh"


def test_a_second_run_reuses_the_complete_venv_without_touching_it(docker_compose, hadolint):
    before = {tool: tool.stat().st_mtime_ns for tool in (docker_compose, hadolint)}
    result = subprocess.run(
        ["bash", str(SCRIPT)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "VLLM_MANAGER_LINT_VENV": str(lint_venv())},
    )
    assert result.returncode == 0, result.stderr
    assert "reusing" in result.stdout
    assert {tool: tool.stat().st_mtime_ns for tool in before} == before
