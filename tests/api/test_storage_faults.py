"""Storage faults: a full disk while a config is written, a data dir that cannot be written at start."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import cast

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import event, text
from sqlalchemy.engine import Engine

from manager.app import create_app
from manager.launch.allowed_env import ALLOWED_ENV

KEEP = {"name": "keep", "model": "org/keep", "env": {"HF_HUB_OFFLINE": "1"}, "max_model_len": 4096}
BIG_ENV = {name: "x" * 8000 for name in sorted(ALLOWED_ENV)[:16]}  # needs new database pages


def _cap_database(client: TestClient, extra_pages: int | None) -> None:
    """SQLite's max_page_count: the database cannot grow past its size now (plus extra_pages) and
    answers SQLITE_FULL, "database or disk is full", as it does when the disk is."""
    engine = _engine(client)
    with engine.connect() as conn:
        pages = conn.execute(text("PRAGMA page_count")).scalar_one()
    limit = 2**31 - 2 if extra_pages is None else pages + extra_pages

    def cap(dbapi_conn, _record) -> None:
        dbapi_conn.execute(f"PRAGMA max_page_count = {limit}")

    event.listen(engine, "connect", cap)
    engine.dispose()  # every connection from now on is a new one, capped


def _engine(client: TestClient) -> Engine:
    app = cast(FastAPI, client.app)
    return app.state.runtime.engine


def _integrity(client: TestClient) -> str:
    with _engine(client).connect() as conn:
        return str(conn.execute(text("PRAGMA integrity_check")).scalar_one())


def _assert_full_then_recovers(client: TestClient, make_room) -> None:
    before = client.get("/api/models/keep").json()
    resp = client.post("/api/models", json={"name": "new", "model": "org/new", "env": BIG_ENV})
    assert resp.status_code == 507, resp.text[:300]
    assert "full" in resp.json()["detail"] and "nothing was saved" in resp.json()["detail"]
    put = client.put("/api/models/keep", json={**KEEP, "env": BIG_ENV})
    assert put.status_code == 507
    env_lines = "\n".join(f"{k}={v}" for k, v in BIG_ENV.items())
    form = client.post("/ui/models/new", data={"name": "form", "model": "org/form", "env": env_lines})
    assert form.status_code == 200 and "full" in form.text and "HX-Redirect" not in form.headers

    assert client.get("/api/health").status_code == 200  # still serving
    assert client.get("/api/models/keep").json() == before  # nothing corrupted, nothing half-written
    assert [m["name"] for m in client.get("/api/models").json()] == ["keep"]

    make_room()
    assert client.post("/api/models", json={"name": "new", "model": "org/new", "env": BIG_ENV}).status_code == 201
    assert _integrity(client) == "ok"


def test_a_full_database_is_507_and_nothing_is_lost(client):
    assert client.post("/api/models", json=KEEP).status_code == 201
    _cap_database(client, extra_pages=0)
    _assert_full_then_recovers(client, make_room=lambda: _cap_database(client, extra_pages=None))


@pytest.fixture
def tiny_disk(tmp_path) -> Iterator[Path]:
    """A 2 MiB tmpfs (needs root and a kernel that lets this process mount)."""
    mount = tmp_path / "tiny"
    mount.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_full_disk_is_507_and_nothing_is_lost(tiny_disk, settings):
    filler = tiny_disk / "filler"
    with TestClient(create_app(settings.model_copy(update={"data_dir": tiny_disk / "data"}))) as client:
        assert client.post("/api/models", json=KEEP).status_code == 201
        # Unbuffered: a buffered file would keep the bytes that did not fit, and fail again on close.
        with filler.open("wb", buffering=0) as f:
            try:
                while True:
                    f.write(b"\0" * 65536)
            except OSError:
                pass
        _assert_full_then_recovers(client, make_room=filler.unlink)


@pytest.fixture
def read_only_folder(tmp_path) -> Iterator[Path]:
    """A folder this process cannot write: a read-only tmpfs as root, a 0500 folder otherwise."""
    folder = tmp_path / "read-only"
    folder.mkdir()
    if os.geteuid() != 0:
        folder.chmod(0o500)
        yield folder
        folder.chmod(0o700)
        return
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(folder)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"root here cannot mount a read-only tmpfs: {done.stderr.decode().strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


@pytest.mark.parametrize("inside", [False, True], ids=["the data dir itself", "a folder to create in it"])
def test_serve_exits_with_a_clear_message_when_the_data_dir_cannot_be_written(read_only_folder, inside):
    data_dir = read_only_folder / "data" if inside else read_only_folder
    done = subprocess.run(
        [sys.executable, "-m", "manager", "serve", "--data-dir", str(data_dir), "--port", "1"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    assert f"the data dir {data_dir} cannot be written" in done.stderr
    assert "--data-dir" in done.stderr
    assert "Read-only file system" in done.stderr or "Permission denied" in done.stderr
