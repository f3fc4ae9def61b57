"""Fixtures for the deployment files: paths, and the two linters from their own venv.

docker/ci/install-linters.sh puts docker-compose 1.29.2 and hadolint in a venv of their own
(they need PyYAML 5, the test venv has 6). Where that venv is missing, the linter tests skip on a
developer's machine but FAIL in CI (CI=true), so a broken install never passes as green.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCKER = REPO / "docker"


def lint_venv() -> Path:
    override = os.environ.get("VLLM_MANAGER_LINT_VENV")
    if override:
        return Path(override)
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "vllm-manager" / "lint-venv"


def _lint_tool(name: str) -> Path:
    tool = lint_venv() / "bin" / name
    if tool.is_file() and os.access(tool, os.X_OK):
        return tool
    message = f"{tool} is missing: run docker/ci/install-linters.sh first"
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(message)
    pytest.skip(message)


@pytest.fixture(scope="session")
def docker_compose() -> Path:
    return _lint_tool("docker-compose")


@pytest.fixture(scope="session")
def hadolint() -> Path:
    return _lint_tool("hadolint")


def instructions(dockerfile) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    result, pending = [], ""
    for line in dockerfile.read_text().splitlines():
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if stripped.startswith("#"):  # a comment inside a continued instruction
            continue
        pending += " " + stripped.removesuffix("\\")
        if not stripped.endswith("\\"):
            keyword, _, args = pending.strip().partition(" ")
            result.append((keyword.upper(), args.strip()))
            pending = ""
    return result
