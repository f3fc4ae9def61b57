"""Many clients creating the same name at once: one wins (201), every other gets a 409, nothing is lost."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import yaml

CLIENTS = 20
MODEL = {"name": "same", "model": "org/same", "max_model_len": 4096, "env": {"HF_HUB_OFFLINE": "1"}}
PROFILE = {"name": "same", "kv_offload_gib": 8, "description": "shared"}


def _all_at_once(call, n: int = CLIENTS) -> list:
    """Run ``call`` from n threads released together; the app serves them concurrently."""
    start = threading.Barrier(n)

    def one(i: int):
        start.wait()
        return call(i)

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(one, range(n)))


def _one_created_rest_conflict(responses, created: int = 201) -> None:
    codes = sorted(r.status_code for r in responses)
    assert codes == [created] + [409] * (len(responses) - 1), codes
    for r in responses:
        if r.status_code == 409:
            assert "already" in r.json()["detail"]


def test_model_configs_created_at_once(client):
    responses = _all_at_once(lambda i: client.post("/api/models", json={**MODEL, "max_num_seqs": i + 1}))
    _one_created_rest_conflict(responses)
    winner = next(r.json() for r in responses if r.status_code == 201)
    stored = client.get("/api/models/same").json()
    assert stored == winner and stored["env"] == {"HF_HUB_OFFLINE": "1"}
    assert [m["name"] for m in client.get("/api/models").json()] == ["same"]


def test_offload_profiles_created_at_once(client):
    responses = _all_at_once(lambda i: client.post("/api/profiles", json={**PROFILE, "kv_offload_gib": i + 1}))
    _one_created_rest_conflict(responses)
    winner = next(r.json() for r in responses if r.status_code == 201)
    assert client.get("/api/profiles/same").json() == winner


def test_imports_without_overwrite_at_once(client):
    doc = {"format": "vllm-manager", "version": 1, "profiles": [PROFILE], "models": [MODEL]}
    text = yaml.safe_dump(doc)
    headers = {"content-type": "application/yaml"}
    responses = _all_at_once(lambda _i: client.post("/api/import?overwrite=false", content=text, headers=headers))
    _one_created_rest_conflict(responses, created=200)
    assert client.get("/api/models/same").json()["model"] == "org/same"
    assert client.get("/api/profiles/same").json()["description"] == "shared"


def test_imports_with_overwrite_at_once_all_succeed(client):
    doc = {"format": "vllm-manager", "version": 1, "profiles": [PROFILE], "models": [MODEL]}
    headers = {"content-type": "application/yaml"}
    responses = _all_at_once(
        lambda i: client.post(
            "/api/import",
            content=yaml.safe_dump({**doc, "models": [{**MODEL, "max_num_seqs": i + 1}]}),
            headers=headers,
        ),
        n=8,
    )
    assert [r.status_code for r in responses] == [200] * 8, [r.text for r in responses if r.status_code != 200]
    assert client.get("/api/models/same").json()["max_num_seqs"] in range(1, 9)


def test_configs_sharing_an_alias_created_at_once_one_holds_it(client):
    responses = _all_at_once(
        lambda i: client.post("/api/models", json={"name": f"m{i}", "model": "org/m", "aliases": ["shared"]})
    )
    codes = sorted(r.status_code for r in responses)
    assert codes == [201] + [409] * (CLIENTS - 1), codes
    winner = next(r.json()["name"] for r in responses if r.status_code == 201)
    for r in responses:
        if r.status_code == 409:
            body = r.json()
            assert f"'shared' is the alias of model config '{winner}'" in body["detail"], body
            assert (body["name"], body["held_by"]) == ("shared", winner)
    stored = client.get("/api/models").json()
    assert [(m["name"], m["aliases"]) for m in stored] == [(winner, ["shared"])]
    # The store goes on taking configs and imports.
    assert client.post("/api/models", json={"name": "after", "model": "org/m", "aliases": ["other"]}).status_code == 201
    doc = yaml.safe_dump({"format": "vllm-manager", "version": 1, "models": [{"name": "imported", "model": "org/m"}]})
    assert client.post("/api/import", content=doc, headers={"content-type": "application/yaml"}).status_code == 200
    assert client.delete(f"/api/models/{winner}").status_code == 204
    assert client.post("/api/models", json={"name": "next", "model": "org/m", "aliases": ["shared"]}).status_code == 201


def test_configs_renamed_to_one_alias_at_once_one_holds_it(client):
    n = 10
    for i in range(n):
        assert client.post("/api/models", json={"name": f"m{i}", "model": "org/m"}).status_code == 201
    responses = _all_at_once(
        lambda i: client.put(f"/api/models/m{i}", json={"model": "org/m", "aliases": ["shared"]}), n=n
    )
    codes = sorted(r.status_code for r in responses)
    assert codes == [200] + [409] * (n - 1), codes
    holders = [m["name"] for m in client.get("/api/models").json() if m["aliases"] == ["shared"]]
    assert len(holders) == 1
    # Its alias given up, another config may take it.
    assert client.put(f"/api/models/{holders[0]}", json={"model": "org/m"}).status_code == 200
    other = next(f"m{i}" for i in range(n) if f"m{i}" != holders[0])
    assert client.put(f"/api/models/{other}", json={"model": "org/m", "aliases": ["shared"]}).status_code == 200
