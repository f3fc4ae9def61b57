"""A model config's replica counts through the REST API: bad counts are refused with a reason, good ones kept."""

from __future__ import annotations

MODEL = {"name": "chat", "model": "Qwen/Qwen2.5-0.5B-Instruct", "gpu_ids": [0]}


def test_replicas_above_max_replicas_is_refused_naming_both(client):
    bad = client.post("/api/models", json={**MODEL, "replicas": 3, "max_replicas": 2})
    assert bad.status_code == 422
    assert "replicas 3" in bad.text and "max_replicas 2" in bad.text
    assert client.get("/api/models/chat").status_code == 404


def test_min_replicas_without_max_replicas_is_refused(client):
    bad = client.post("/api/models", json={**MODEL, "min_replicas": 2})
    assert bad.status_code == 422 and "min_replicas needs max_replicas" in bad.text


def test_min_replicas_above_max_replicas_is_refused(client):
    bad = client.post("/api/models", json={**MODEL, "replicas": 2, "min_replicas": 3, "max_replicas": 2})
    assert bad.status_code == 422 and "min_replicas 3 is more than max_replicas 2" in bad.text


def test_more_than_sixteen_replicas_is_refused(client):
    bad = client.post("/api/models", json={**MODEL, "replicas": 17})
    assert bad.status_code == 422
    assert "replicas" in {err["loc"][-1] for err in bad.json()["errors"]}
    assert client.post("/api/models", json={**MODEL, "replicas": 0}).status_code == 422


def test_replicas_are_kept_as_given(client):
    created = client.post("/api/models", json={**MODEL, "replicas": 2})
    assert created.status_code == 201, created.text
    shown = client.get("/api/models/chat").json()
    assert (shown["replicas"], shown["min_replicas"], shown["max_replicas"]) == (2, None, None)
    scaled = client.put("/api/models/chat", json={**MODEL, "replicas": 2, "min_replicas": 1, "max_replicas": 4})
    assert scaled.status_code == 200, scaled.text
    shown = client.get("/api/models/chat").json()
    assert (shown["replicas"], shown["min_replicas"], shown["max_replicas"]) == (2, 1, 4)
    refused = client.put("/api/models/chat", json={**MODEL, "replicas": 5, "max_replicas": 4})
    assert refused.status_code == 422
    assert client.get("/api/models/chat").json()["replicas"] == 2  # the stored config is unchanged
