"""A model config's max_concurrent through the REST API: kept as given, refused out of range, and read by
the front door's scheduler once changed."""

from __future__ import annotations

MODEL = {"name": "chat", "model": "Qwen/Qwen2.5-0.5B-Instruct", "gpu_ids": [0]}


def test_max_concurrent_is_kept_shown_and_reaches_the_front_door(client):
    door = client.app.state.runtime.front_door
    created = client.post("/api/models", json=MODEL)
    assert created.status_code == 201, created.text
    assert client.get("/api/models/chat").json()["max_concurrent"] is None
    assert door.catalog.max_concurrent("chat") is None  # no limit
    changed = client.put("/api/models/chat", json={**MODEL, "max_concurrent": 4})
    assert changed.status_code == 200, changed.text
    assert client.get("/api/models/chat").json()["max_concurrent"] == 4
    assert door.catalog.max_concurrent("chat") == 4


def test_max_concurrent_out_of_range_is_refused_naming_the_field(client):
    for bad in (0, 4097, "many"):
        refused = client.post("/api/models", json={**MODEL, "max_concurrent": bad})
        assert refused.status_code == 422, bad
        assert "max_concurrent" in {err["loc"][-1] for err in refused.json()["errors"]}
    assert client.get("/api/models/chat").status_code == 404


def test_the_models_schema_describes_max_concurrent(client):
    fields = client.get("/openapi.json").json()["components"]["schemas"]["ModelConfigCreate"]["properties"]
    assert "max_concurrent" in fields and "at once" in fields["max_concurrent"]["description"]
