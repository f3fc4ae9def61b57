"""Shared fixtures: a fresh manager per test, one pair of tiny local models per run."""

from __future__ import annotations

import fcntl
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from manager.app import create_app
from manager.settings import Settings
from tests.support.hub_server import TestHub
from tests.support.tiny_hub_model import make_tiny_hub_repo
from tests.support.tiny_model import make_tiny_llama, make_tiny_qwen3_moe

ENGINE_LOCK = Path("/tmp/vllm-engine.lock")
# FastAPI's TestClient calls itself "testserver"; the DNS-rebinding guard must let that name through.
os.environ.setdefault("VLLM_MANAGER_ALLOWED_HOSTS", '["localhost", "127.0.0.1", "::1", "testserver"]')
# No test reaches the real Hugging Face Hub: its address is a closed port unless a test starts its own hub.
os.environ["HF_ENDPOINT"] = "http://127.0.0.1:9"


def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> None:
    """A failure is printed as it happens, not only in the summary at the end: a run cut short (a crash,
    a time limit) still says which test failed and why."""
    if call.excinfo is None or call.excinfo.errisinstance(pytest.skip.Exception):
        return
    reporter = item.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None:
        return
    text = str(item.repr_failure(call.excinfo)).splitlines()
    reporter.write_line(f"\n--- {item.nodeid} failed ({call.when}):")
    for line in text[-60:]:
        reporter.write_line(line)
    reporter.write_line("---")


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama")


@pytest.fixture(scope="session")
def tiny_llama_b(tmp_path_factory) -> Path:
    """A second, different tiny model, for switching."""
    return make_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama-3l", layers=3)


@pytest.fixture(scope="session")
def tiny_moe(tmp_path_factory) -> Path:
    return make_tiny_qwen3_moe(tmp_path_factory.mktemp("models") / "tiny-qwen3-moe")


@pytest.fixture(scope="session")
def tiny_hub_repo(tmp_path_factory) -> Path:
    """The files of a tiny sharded Llama repo (tests/support/tiny_hub_model.py), for ``add_repo_from_folder``."""
    return make_tiny_hub_repo(tmp_path_factory.mktemp("hub-repos") / "tiny-llama")


@pytest.fixture
def hub_models_in_place(monkeypatch):
    """Configs that name hub ids (org/a) no test downloads: a start through the app finds them in place."""
    from tests.support.downloads import Downloads, use_downloads

    return use_downloads(monkeypatch, Downloads(missing=False))


@pytest.fixture
def test_hub(tmp_path, monkeypatch) -> Iterator[TestHub]:
    """A Hugging Face Hub on loopback (tests/support/hub_server.py), closed after the test.

    huggingface_hub is kept off the user's own state meanwhile: no token from the environment or the
    token file (anonymous means anonymous), no offline mode, and its default cache in tmp_path."""
    from huggingface_hub import constants

    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "hf-token"))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    with TestHub() as hub:
        yield hub


@pytest.fixture
def settings(tmp_path) -> Settings:
    # Tests that restart a manager look at what it re-adopts; the default, stopping the workers on a clean
    # exit, has tests of its own (tests/cli/test_serve_exit.py).
    return Settings(
        data_dir=tmp_path / "data", engine_python=sys.executable, api_token=None, stop_workers_on_exit=False
    )


@pytest.fixture
def client(settings) -> Iterator[TestClient]:
    with TestClient(create_app(settings)) as c:
        yield c


@pytest.fixture
def engine_slot() -> Iterator[None]:
    """One real engine at a time on this machine (2 cores): hold the lock while one runs."""
    ENGINE_LOCK.touch(exist_ok=True)
    with ENGINE_LOCK.open() as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


@pytest.fixture
def engine_settings(tmp_path, engine_slot) -> Iterator[Settings]:
    """Settings for tests that run real engines: quick health checks and backoff; workers cleaned up."""
    from tests.support.engine import stop_leftover_engines

    settings = Settings(
        data_dir=tmp_path / "data",
        engine_python=sys.executable,
        api_token=None,
        health_interval_s=1.0,
        backoff_base_s=1.0,
        stop_grace_s=15.0,
        stop_workers_on_exit=False,  # as in `settings` above
        worker_ports="18100-18199",
    )
    yield settings
    stop_leftover_engines(settings.data_dir)
