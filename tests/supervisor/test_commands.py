"""Commands on workers that must answer, and conflicts that must be refused.

The engine interpreter here is a script that only sleeps, so its workers stay "starting": this tests the
manager's bookkeeping, not vLLM (the real-engine tests do that).
"""

from __future__ import annotations

import asyncio

import httpx
import pytest
from fastapi.testclient import TestClient

from manager.app import create_app


@pytest.fixture
def sleepy(settings, tmp_path, hub_models_in_place):
    script = tmp_path / "python"
    script.write_text("#!/bin/sh\nexec sleep 600\n")
    script.chmod(0o755)
    app = create_app(
        settings.model_copy(update={"engine_python": str(script), "worker_ports": "18300-18320", "stop_grace_s": 2.0})
    )
    with TestClient(app) as c:
        for name in ("a", "b"):
            c.post("/api/models", json={"name": name, "model": f"org/{name}", "start_timeout_s": 600})
        yield app, c
        for w in c.get("/api/workers").json():
            c.post(f"/api/workers/{w['id']}/stop")


def test_deleting_twice_at_once_answers_both(sleepy):
    app, c = sleepy
    wid = c.post("/api/workers", json={"model": "a"}).json()["id"]

    async def two_deletes():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver", timeout=30) as ac:
            return await asyncio.gather(*(ac.delete(f"/api/workers/{wid}") for _ in range(2)))

    codes = sorted(r.status_code for r in c.portal.call(two_deletes))
    assert codes == [204, 404]
    assert c.get(f"/api/workers/{wid}").status_code == 404


def test_switch_to_a_config_running_elsewhere_is_refused(sleepy):
    _, c = sleepy
    c.post("/api/workers", json={"model": "a"})
    b = c.post("/api/workers", json={"model": "b"}).json()["id"]
    refused = c.post(f"/api/workers/{b}/switch", json={"model": "a"})
    assert refused.status_code == 409 and "already runs in worker" in refused.json()["detail"]
    assert c.get(f"/api/workers/{b}").json()["model"] == "b"


def test_a_running_config_cannot_be_deleted(sleepy):
    _, c = sleepy
    wid = c.post("/api/workers", json={"model": "a"}).json()["id"]
    refused = c.delete("/api/models/a")
    assert refused.status_code == 409 and refused.json()["workers"] == [wid]
    c.post(f"/api/workers/{wid}/stop")
    assert c.delete("/api/models/a").status_code == 204


def test_a_missing_engine_interpreter_is_a_clear_422(settings, hub_models_in_place):
    broken = settings.model_copy(update={"engine_python": "/nonexistent/python", "worker_ports": "18330-18340"})
    with TestClient(create_app(broken)) as c:
        c.post("/api/models", json={"name": "a", "model": "org/a"})
        resp = c.post("/api/workers", json={"model": "a"})
        assert resp.status_code == 422
        assert "/nonexistent/python" in resp.json()["detail"] and "VLLM_MANAGER_ENGINE_PYTHON" in resp.json()["detail"]
        assert c.get("/api/workers").json() == []


def test_starting_a_config_again_starts_its_stopped_worker_instead_of_a_new_one(sleepy):
    _, c = sleepy
    first = c.post("/api/workers", json={"model": "a"}).json()["id"]
    assert c.post(f"/api/workers/{first}/stop").json()["state"] == "stopped"
    again = c.post("/api/workers", json={"model": "a"})
    assert again.status_code == 200 and again.json()["id"] == first and again.json()["state"] == "starting"
    assert [w["id"] for w in c.get("/api/workers").json()] == [first]  # no dead card beside it
    c.post(f"/api/workers/{first}/stop")
    elsewhere = c.post("/api/workers", json={"model": "a", "port": 18319})  # asked for a port: a new worker
    assert elsewhere.status_code == 201 and elsewhere.json()["id"] != first


def test_a_model_folder_removed_after_the_config_was_written_is_refused_at_start(sleepy, tmp_path):
    _, c = sleepy
    folder = tmp_path / "gone"
    folder.mkdir()
    assert c.post("/api/models", json={"name": "gone", "model": str(folder)}).status_code == 201
    folder.rmdir()
    refused = c.post("/api/workers", json={"model": "gone"})
    assert refused.status_code == 422 and f"{folder} does not exist on this machine" in refused.json()["detail"]
    assert c.get("/api/workers").json() == [] or all(w["model"] != "gone" for w in c.get("/api/workers").json())


def test_a_hub_id_outside_the_cache_is_refused_when_the_engine_may_not_download(sleepy):
    _, c = sleepy
    c.post("/api/models", json={"name": "offline", "model": "org/offline", "env": {"HF_HUB_OFFLINE": "1"}})
    refused = c.post("/api/workers", json={"model": "offline"})
    assert refused.status_code == 422 and "HF_HUB_OFFLINE is set" in refused.json()["detail"]
    # A hub model found in the cache starts as it is (its download, when it is not, is test_download_phase's).
    started = c.post("/api/workers", json={"model": "a"})
    assert started.status_code == 201 and started.json()["state"] == "starting", started.text
