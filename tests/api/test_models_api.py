"""Model configs and offload profiles through the REST API, as a user (or a script) would use it."""

from __future__ import annotations

import yaml
from fastapi.testclient import TestClient

from manager.app import create_app

PROFILE = {"name": "kv-8g", "kv_offload_gib": 8, "kv_eviction_policy": "lru"}
MODEL = {
    "name": "llama-8b",
    "model": "meta-llama/Llama-3.1-8B-Instruct",
    "gpu_memory_utilization": 0.85,
    "max_model_len": 32768,
    "max_num_seqs": 16,
    "gpu_ids": [0],
    "env": {"HF_HUB_OFFLINE": "1"},
    "extra_args": ["--enable-chunked-prefill"],
}


def test_create_list_show_edit_delete(client):
    assert client.post("/api/profiles", json=PROFILE).status_code == 201
    created = client.post("/api/models", json={**MODEL, "offload_profile": "kv-8g"})
    assert created.status_code == 201, created.text
    assert created.json()["offload_profile"] == "kv-8g"

    assert [m["name"] for m in client.get("/api/models").json()] == ["llama-8b"]
    shown = client.get("/api/models/llama-8b").json()
    assert shown["max_model_len"] == 32768 and shown["env"] == {"HF_HUB_OFFLINE": "1"}

    edited = client.put("/api/models/llama-8b", json={**MODEL, "max_model_len": 8192})
    assert edited.status_code == 200
    assert client.get("/api/models/llama-8b").json()["max_model_len"] == 8192
    assert client.get("/api/models/llama-8b").json()["offload_profile"] is None

    assert client.delete("/api/models/llama-8b").status_code == 204
    assert client.get("/api/models/llama-8b").status_code == 404


def test_invalid_fields_are_named(client):
    bad = client.post(
        "/api/models",
        json={
            **MODEL,
            "name": "Has Spaces",
            "gpu_memory_utilization": 1.5,
            "max_model_len": 0,
            "tensor_parallel_size": 0,
        },
    )
    assert bad.status_code == 422
    fields = {err["loc"][-1] for err in bad.json()["errors"]}
    assert {"name", "gpu_memory_utilization", "max_model_len", "tensor_parallel_size"} <= fields
    rule = next(e["msg"] for e in bad.json()["errors"] if e["loc"][-1] == "name")
    assert "slug" in rule


def test_tp_needs_enough_gpus(client):
    bad = client.post("/api/models", json={**MODEL, "tensor_parallel_size": 2, "gpu_ids": [0]})
    assert bad.status_code == 422
    assert "tensor_parallel_size 2" in bad.text


def test_duplicate_unknown_and_profile_in_use(client):
    client.post("/api/profiles", json=PROFILE)
    client.post("/api/models", json={**MODEL, "offload_profile": "kv-8g"})
    dup = client.post("/api/models", json=MODEL)
    assert dup.status_code == 409 and "already exists" in dup.json()["detail"]
    assert client.get("/api/profiles/nope").status_code == 404
    missing_profile = client.post("/api/models", json={**MODEL, "name": "other", "offload_profile": "nope"})
    assert missing_profile.status_code == 404 and "nope" in missing_profile.json()["detail"]

    in_use = client.delete("/api/profiles/kv-8g")
    assert in_use.status_code == 409
    assert in_use.json()["users"] == ["llama-8b"]
    assert client.get("/api/profiles/kv-8g").status_code == 200  # nothing lost


def test_profile_rules(client):
    both = client.post("/api/profiles", json={**PROFILE, "kv_offload_num_cpu_blocks": 1000})
    assert both.status_code == 422 and "not both" in both.text
    policy = client.post("/api/profiles", json={**PROFILE, "kv_eviction_policy": "fifo"})
    assert policy.status_code == 422 and "lru, arc" in policy.text
    pool = client.post("/api/profiles", json={"name": "p", "lora_cpu_pooling": True})
    assert pool.status_code == 422 and "lora_pool_gib" in pool.text


def test_code_loading_flags_refused_unless_allowed(client, settings):
    refused = client.post("/api/models", json={**MODEL, "extra_args": ["--trust-remote-code"]})
    assert refused.status_code == 422
    assert "VLLM_MANAGER_ALLOW_CODE_FLAGS" in refused.json()["detail"]
    worker_cls = client.post("/api/models", json={**MODEL, "extra_args": ["--worker-cls=my.mod.Worker"]})
    assert worker_cls.status_code == 422
    managed = client.post("/api/models", json={**MODEL, "extra_args": ["--port", "9000"]})
    assert managed.status_code == 422 and "set by the manager" in managed.json()["detail"]

    allowed = settings.model_copy(update={"allow_code_flags": True})
    with TestClient(create_app(allowed)) as c:
        ok = c.post("/api/models", json={**MODEL, "name": "remote", "extra_args": ["--trust-remote-code"]})
        assert ok.status_code == 201


def test_config_survives_restart_on_same_database(settings):
    with TestClient(create_app(settings)) as c:
        c.post("/api/profiles", json=PROFILE)
        c.post("/api/models", json={**MODEL, "offload_profile": "kv-8g"})
    with TestClient(create_app(settings)) as c:
        again = c.get("/api/models/llama-8b")
        assert again.status_code == 200
        assert again.json()["offload_profile"] == "kv-8g"
        assert again.json()["extra_args"] == ["--enable-chunked-prefill"]


def test_openapi_lists_the_paths(client):
    paths = client.get("/openapi.json").json()["paths"]
    for path in (
        "/api/health",
        "/api/models",
        "/api/models/{name}",
        "/api/models/{name}/command",
        "/api/profiles",
        "/api/profiles/{name}",
        "/api/export",
        "/api/import",
    ):
        assert path in paths
    assert client.get("/docs").status_code == 200
    assert client.get("/api/health").json()["status"] == "ok"


def test_database_is_wal_with_foreign_keys_and_migrated(client, settings):
    from sqlalchemy import text

    from manager.db import make_engine

    engine = make_engine(settings.db_path)
    with engine.connect() as conn:
        assert conn.execute(text("PRAGMA journal_mode")).scalar() == "wal"
        assert conn.execute(text("PRAGMA foreign_keys")).scalar() == 1
        head = conn.execute(text("SELECT version_num FROM alembic_version")).scalar()
    engine.dispose()
    from pathlib import Path

    import manager.db

    newest = sorted(p.stem for p in (Path(manager.db.__file__).parent / "migrations" / "versions").glob("0*.py"))[-1]
    assert head == newest


def test_refused_flags_cannot_be_smuggled_in(client):
    for args in (
        ["--trust-remote"],
        ["--trust_remote_code"],
        ["--worker-cls=x.Y"],
        ["--config", "args.yaml"],
        ["--max-model", "9000"],
        ["--no-enable-lora"],
        ["--tensor_parallel_size", "2"],
    ):
        resp = client.post("/api/models", json={**MODEL, "name": "smuggle", "extra_args": args})
        assert resp.status_code == 422, args
    ok = client.post(
        "/api/models",
        json={**MODEL, "name": "fine", "extra_args": ["--no-trust-remote-code", "--max-num-batched-tokens", "8192"]},
    )
    assert ok.status_code == 201


def test_dotted_json_keys_and_code_loading_env_are_refused(client):
    dotted = ["--kv-transfer-config.kv_connector_module_path", "evil.mod"]
    assert client.post("/api/models", json={**MODEL, "name": "d1", "extra_args": dotted}).status_code == 422
    alias = ["--device-memory-utilization", "0.99"]
    assert client.post("/api/models", json={**MODEL, "name": "d2", "extra_args": alias}).status_code == 422
    for env in ({"LD_PRELOAD": "/tmp/x.so"}, {"PYTHONPATH": "/tmp/evil"}, {"VLLM_PLUGINS": "evil"}):
        resp = client.post("/api/models", json={**MODEL, "name": "e", "env": env})
        assert resp.status_code == 422 and resp.json()["field"] == "env", env


def test_import_refuses_a_name_given_twice(client):
    import yaml

    doc = {
        "format": "vllm-manager",
        "version": 1,
        "profiles": [],
        "models": [{"name": "dup", "model": "a"}, {"name": "dup", "model": "b"}],
    }
    resp = client.post("/api/import", content=yaml.safe_dump(doc), headers={"content-type": "application/yaml"})
    assert resp.status_code == 422 and "dup" in resp.json()["detail"]


def test_numbers_out_of_range_are_422_not_500(client):
    assert client.post("/api/models", json={**MODEL, "name": "huge", "max_model_len": 10**20}).status_code == 422
    resp = client.post(
        "/api/profiles",
        content='{"name": "inf", "kv_offload_gib": Infinity}',
        headers={"content-type": "application/json"},
    )
    assert resp.status_code == 422
    assert client.post("/api/profiles", json={"name": "big", "kv_offload_gib": 1e300}).status_code == 422


def test_a_relative_model_folder_is_stored_as_an_absolute_path(client, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models" / "m").mkdir(parents=True)
    created = client.post("/api/models", json={"name": "rel", "model": "./models/m"}).json()
    assert created["model"] == str(tmp_path / "models" / "m")
    hub = client.post("/api/models", json={"name": "hub", "model": "Qwen/Qwen3-8B"}).json()
    assert hub["model"] == "Qwen/Qwen3-8B"


def test_a_misspelled_field_is_refused_with_the_closest_real_name(client):
    typo = client.post("/api/models", json={"name": "a", "model": "org/x", "max_model_length": 2048})
    assert typo.status_code == 422 and "'max_model_length' (did you mean max_model_len?)" in typo.json()["detail"]
    assert client.get("/api/models/a").status_code == 404  # nothing stored
    unknown = client.post("/api/profiles", json={"name": "p", "colour": "blue"})
    assert unknown.status_code == 422 and "unknown field 'colour'; the fields are:" in unknown.json()["detail"]
    # A config read back and sent whole (name and stamps included) replaces cleanly.
    assert client.post("/api/models", json={"name": "a", "model": "org/x"}).status_code == 201
    shown = client.get("/api/models/a").json()
    assert client.put("/api/models/a", json={**shown, "max_model_len": 4096}).status_code == 200
    assert client.put("/api/models/a", json={**shown, "max_model_lenn": 1}).status_code == 422


def test_a_model_path_that_is_not_there_is_refused_when_written(client, tmp_path):
    missing = tmp_path / "does-not-exist"
    refused = client.post("/api/models", json={"name": "a", "model": str(missing)})
    assert refused.status_code == 422 and refused.json()["field"] == "model"
    assert f"{missing} does not exist on this machine" in refused.json()["detail"]
    assert client.get("/api/models/a").status_code == 404
    doc = {"format": "vllm-manager", "version": 1, "models": [{"name": "a", "model": str(missing)}]}
    imported = client.post("/api/import", content=yaml.safe_dump(doc), headers={"content-type": "application/yaml"})
    assert imported.status_code == 422 and "does not exist on this machine" in imported.json()["detail"]
    # A folder that is there, and a hub id, are taken; a hub id not in the cache is said so in the preview.
    (tmp_path / "m").mkdir()
    assert client.post("/api/models", json={"name": "a", "model": str(tmp_path / "m")}).status_code == 201
    assert client.put("/api/models/a", json={"model": str(missing)}).status_code == 422
    assert client.post("/api/models", json={"name": "hub", "model": "org/not-cached"}).status_code == 201
    notes = client.get("/api/models/hub/command", params={"validate": False}).json()["notes"]
    assert any("org/not-cached is downloaded from the Hugging Face Hub before vLLM starts" in n for n in notes), notes
    assert not any("Hugging Face" in n for n in client.get("/api/models/a/command?validate=false").json()["notes"])


def test_a_misspelled_field_of_a_worker_start_is_refused_not_dropped(client):
    # Dropped silently, "gpu" would start the worker on the config's GPUs instead of the ones asked for.
    typo = client.post("/api/workers", json={"model": "a", "gpu": [1]})
    assert typo.status_code == 422 and "'gpu' (did you mean gpus?)" in typo.json()["detail"]
    assert client.get("/api/workers").json() == []  # nothing started
