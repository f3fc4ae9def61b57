"""The data dir: private to the user who runs the manager."""

from __future__ import annotations

import stat
from pathlib import Path

from fastapi.testclient import TestClient

from manager.app import create_app


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _assert_private(data: Path) -> None:
    for folder in (data, data / "logs", data / "run"):
        assert _mode(folder) == 0o700, folder
    files = sorted(data.glob("manager.db*"))
    assert [f.name for f in files] == ["manager.db", "manager.db-shm", "manager.db-wal"]
    for f in files:
        assert _mode(f) == 0o600, f


def test_database_and_folders_are_private(client, settings):
    assert client.post("/api/models", json={"name": "m", "model": "org/m", "env": {"HF_TOKEN": "x"}}).status_code == 201
    _assert_private(settings.data_dir)


def test_an_existing_open_data_dir_is_made_private(settings):
    data = settings.data_dir
    with TestClient(create_app(settings)) as c:
        c.post("/api/models", json={"name": "m", "model": "org/m"})
    for path in (data, data / "logs", data / "run"):
        path.chmod(0o755)
    for path in data.glob("manager.db*"):
        path.chmod(0o644)
    with TestClient(create_app(settings)) as c:
        assert c.get("/api/models/m").status_code == 200
        _assert_private(data)
