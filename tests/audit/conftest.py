"""A manager whose API token comes from the environment, with no engine to start and no other vLLM
server of this machine to see, and a way to read every row of its audit log."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import cast

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import text

from manager.app import create_app
from manager.db import session
from manager.settings import Settings
from tests.api.test_openapi_contract import TOKEN, _settings

BEARER = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def quiet_machine(tmp_path, monkeypatch) -> None:
    # The vLLM servers other people run on this machine are not this test's to stop or adopt.
    monkeypatch.setattr("manager.host.process.find_engines", lambda exclude: [])
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))


@pytest.fixture
def settings(tmp_path: Path, quiet_machine) -> Settings:
    """As the contract test's: an engine interpreter that does not exist, so a start fails at once."""
    return _settings(tmp_path, TOKEN)


@pytest.fixture
def client(settings) -> Iterator[TestClient]:
    with TestClient(create_app(settings)) as c:
        yield c


def audit_rows(client: TestClient) -> list[dict]:
    """Every row of the audit table, oldest first, as stored."""
    engine = cast(FastAPI, client.app).state.runtime.engine
    with session(engine) as db:
        return [dict(r._mapping) for r in db.execute(text("SELECT * FROM audit_entry ORDER BY id"))]
