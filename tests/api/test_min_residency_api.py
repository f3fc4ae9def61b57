"""A model config's min_residency_s through the REST API: kept as given, refused out of range,
and read by the front door's scheduler once changed."""

from __future__ import annotations

MODEL = {"name": "chat", "model": "Qwen/Qwen2.5-0.5B-Instruct", "gpu_ids": [0]}


def test_min_residency_is_kept_shown_and_reaches_the_front_door(client):
    door = client.app.state.runtime.front_door
    created = client.post("/api/models", json=MODEL)
    assert created.status_code == 201, created.text
    assert client.get("/api/models/chat").json()["min_residency_s"] is None
    assert door.placements()["chat"].min_residency_s is None  # its last swap-in time plus a margin
    for value in (12.5, 0):
        changed = client.put("/api/models/chat", json={**MODEL, "min_residency_s": value})
        assert changed.status_code == 200, changed.text
        assert client.get("/api/models/chat").json()["min_residency_s"] == value
        assert door.placements()["chat"].min_residency_s == value


def test_min_residency_out_of_range_is_refused_naming_the_field(client):
    for bad in (-1, 3601, "long", True):
        refused = client.post("/api/models", json={**MODEL, "min_residency_s": bad})
        assert refused.status_code == 422, bad
        assert "min_residency_s" in {err["loc"][-1] for err in refused.json()["errors"]}
    assert client.get("/api/models/chat").status_code == 404


def test_the_models_schema_describes_min_residency(client):
    fields = client.get("/openapi.json").json()["components"]["schemas"]["ModelConfigCreate"]["properties"]
    assert "min_residency_s" in fields and "evict" in fields["min_residency_s"]["description"]
