"""/api/cache and the Models on disk page through the real app: the list, deleting, and the refusal while
a worker uses the model. The engine interpreter is a script that only sleeps, so a started worker stays
"starting" (active) without an engine."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from manager.app import create_app
from manager.settings import Settings
from tests.support.hub_cache import complete_model, put_revision

PAGE = {"Accept": "text/html"}


@pytest.fixture
def own(tmp_path, monkeypatch) -> Path:
    folder = tmp_path / "hf" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(folder))
    put_revision(folder, "org/a", complete_model())
    put_revision(folder, "org/b", complete_model())
    return folder


@pytest.fixture
def sleepy(settings, tmp_path) -> Settings:
    script = tmp_path / "python"
    script.write_text("#!/bin/sh\nexec sleep 600\n")
    script.chmod(0o755)
    return settings.model_copy(
        update={"engine_python": str(script), "worker_ports": "18330-18349", "stop_grace_s": 2.0}
    )


@pytest.fixture
def client(sleepy, own) -> Iterator[TestClient]:
    with TestClient(create_app(sleepy)) as c:
        assert c.post("/api/models", json={"name": "a", "model": "org/a", "start_timeout_s": 600}).status_code == 201
        yield c
        for w in c.get("/api/workers").json():
            c.post(f"/api/workers/{w['id']}/stop")


def test_the_list_shows_each_model_and_the_configs_using_it(client, own):
    [cache] = client.get("/api/cache").json()
    assert cache["path"] == str(own) and cache["own"] and cache["configs"] == ["a"]
    by_repo = {m["repo"]: m for m in cache["models"]}
    assert by_repo["org/a"]["used_by"] == ["a"] and by_repo["org/b"]["used_by"] == []
    [revision] = by_repo["org/a"]["revisions"]
    assert revision["refs"] == ["main"] and revision["complete"] and revision["files"] == 3


def test_deleting_a_model_no_worker_uses(client, own):
    deleted = client.delete("/api/cache/org/b")
    assert deleted.status_code == 200, deleted.text
    assert deleted.json()["repo"] == "org/b" and deleted.json()["freed_bytes"] > 0
    assert [m["repo"] for m in client.get("/api/cache").json()[0]["models"]] == ["org/a"]
    again = client.delete("/api/cache/org/b")
    assert again.status_code == 404 and "org/b is not in the hub cache" in again.json()["detail"]
    assert client.delete("/api/cache/org/a", params={"revision": "v9"}).status_code == 404
    assert client.delete("/api/cache/org/a", params={"cache": "/etc"}).status_code == 404
    assert client.delete("/api/cache/org/.hidden").status_code == 422


def test_a_model_an_active_worker_uses_is_not_deleted(client, own):
    started = client.post("/api/workers", json={"model": "a", "force": True})
    assert started.status_code in (200, 201), started.text
    assert started.json()["state"] == "starting"
    refused = client.delete("/api/cache/org/a")
    assert refused.status_code == 409
    assert re.match(r"org/a is in use by worker \d+ \(a, starting\): stop the worker", refused.json()["detail"])
    assert (own / "models--org--a").is_dir()

    client.post(f"/api/workers/{started.json()['id']}/stop")
    assert client.delete("/api/cache/org/a").status_code == 200
    assert not (own / "models--org--a").exists()


def test_deleting_needs_the_token_once_one_exists(sleepy, own):
    token = "vmt_cache-test-token-" + "t" * 20
    with TestClient(create_app(sleepy.model_copy(update={"api_token": token, "open_reads": True}))) as c:
        auth = {"Authorization": f"Bearer {token}"}
        c.post(
            "/api/models",
            json={"name": "x", "model": "org/x", "env": {"HF_HUB_CACHE": "/srv/private-hub"}},
            headers=auth,
        )
        assert c.delete("/api/cache/org/b").status_code == 401
        assert [c["path"] for c in c.get("/api/cache").json()] == [str(own), "<hidden>"]
        assert [c["path"] for c in c.get("/api/cache", headers=auth).json()] == [str(own), "/srv/private-hub"]
        assert c.delete("/api/cache/org/b", headers=auth).status_code == 200


def test_the_page_lists_the_models_and_the_configs_using_them(client):
    html = client.get("/disk", headers=PAGE).text
    assert '<a href="/disk" aria-current="page">On disk</a>' in html
    rows = dict(re.findall(r'<tr data-repo="([^"]+)">(.*?)</tr>', html, re.S))
    assert set(rows) == {"org/a", "org/b"}
    assert '<a href="/models/a">a</a>' in rows["org/a"] and "no config" in rows["org/b"]
    assert "complete" in rows["org/a"] and 'hx-confirm="Delete org/a' in rows["org/a"]
    assert "incomplete" not in html


def test_the_page_says_what_an_incomplete_revision_lacks(client, own):
    put_revision(own, "org/b", {"config.json": b"{}"}, commit="e" * 40, refs=())  # what a planner fetched
    html = client.get("/disk", headers=PAGE).text
    row = dict(re.findall(r'<tr data-repo="([^"]+)">(.*?)</tr>', html, re.S))["org/b"]
    assert 'data-testid="incomplete">incomplete, missing *.safetensors<' in row
    assert row.count(">Delete revision</button>") == 2  # each of its two revisions can go alone


def test_the_page_shows_why_a_delete_was_refused_and_what_a_delete_freed(client, own):
    client.post("/api/workers", json={"model": "a", "force": True})
    refused = client.post("/ui/disk/delete", data={"repo": "org/a", "cache": str(own)})
    assert refused.status_code == 200
    assert re.search(r'data-testid="disk-error">org/a is in use by worker \d+ \(a, starting\)', refused.text)
    assert 'data-repo="org/a"' in refused.text

    done = client.post("/ui/disk/delete", data={"repo": "org/b", "cache": str(own)})
    assert re.search(
        rf'data-testid="disk-message">Deleted org/b from {re.escape(str(own))}: [\d.]+ KiB freed', done.text
    )
    assert 'data-repo="org/b"' not in done.text
