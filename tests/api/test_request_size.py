"""Request bodies have a size limit: 413 with a JSON reason, nothing stored, the manager serving on."""

from __future__ import annotations

from fastapi.testclient import TestClient

from manager.app import create_app

YAML = {"content-type": "application/yaml"}


def test_a_body_over_the_limit_is_413_by_its_content_length(client):
    resp = client.post("/api/profiles", json={"name": "big", "kv_offload_gib": 1, "description": "d" * 10_000_000})
    assert resp.status_code == 413
    assert "2 MiB" in resp.json()["detail"] and "VLLM_MANAGER_MAX_BODY_BYTES" in resp.json()["detail"]
    assert client.get("/api/profiles").json() == []
    assert client.get("/api/health").status_code == 200


def test_a_body_without_a_length_is_cut_off_as_it_streams(client):
    def chunks():
        yield b'{"name": "big", "model": "org/m", "env": {"A": "'
        for _ in range(40):
            yield b"v" * 65536
        yield b'"}}'

    resp = client.post("/api/models", content=chunks(), headers={"content-type": "application/json"})
    assert resp.status_code == 413 and "MiB" in resp.json()["detail"]
    assert client.get("/api/models").json() == []
    form = client.post(
        "/ui/models/new", content=chunks(), headers={"content-type": "application/x-www-form-urlencoded"}
    )
    assert form.status_code == 413


def test_the_limits_are_settings_and_the_import_has_its_own(settings):
    small = settings.model_copy(update={"max_body_bytes": 4096, "max_import_bytes": 64 * 1024})
    with TestClient(create_app(small)) as c:
        desc = {"name": "p", "kv_offload_gib": 1, "description": "d" * 3000}
        assert c.post("/api/profiles", json={**desc, "description": "d" * 5000}).status_code == 413
        assert c.post("/api/profiles", json=desc).status_code == 201
        text = c.get("/api/export").text
        padded = text + "#" + "x" * 20_000 + "\n"  # over the body limit, under the import limit
        assert c.post("/api/import", content=padded, headers=YAML).status_code == 200
        huge = text + "#" + "x" * 70_000 + "\n"
        resp = c.post("/api/import", content=huge, headers=YAML)
        assert resp.status_code == 413 and "VLLM_MANAGER_MAX_IMPORT_BYTES" in resp.json()["detail"]
