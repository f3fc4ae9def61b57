"""The front door's model config fields through the REST API: names that route, idle, persistence, sleep."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.operations import Operations
from sqlalchemy import MetaData, create_engine, inspect, text

from manager.schemas.model_config import ModelConfig
from manager.schemas.offload_profile import OffloadProfile
from manager.services.routing_names import name_clash
from tests.lora.peft_adapters import make_llama_adapter

VERSIONS = Path(__file__).resolve().parents[2] / "manager/migrations/versions"


def _model(name: str, **extra) -> dict:
    return {"name": name, "model": f"org/{name}", **extra}


def test_the_new_fields_are_stored_and_shown(client):
    created = client.post(
        "/api/models",
        json=_model("qwen", aliases=["qwen-small", "q"], idle_timeout_s=600, persistent=True, sleep_level=1),
    )
    assert created.status_code == 201, created.text
    shown = client.get("/api/models/qwen").json()
    assert shown["aliases"] == ["qwen-small", "q"]
    assert shown["idle_timeout_s"] == 600 and shown["persistent"] is True and shown["sleep_level"] == 1
    plain = client.post("/api/models", json=_model("plain")).json()
    assert plain["aliases"] == [] and plain["idle_timeout_s"] is None
    assert plain["persistent"] is False and plain["sleep_level"] is None


def test_field_rules_are_named(client):
    bad = client.post("/api/models", json=_model("x", aliases=["Not A Slug"], idle_timeout_s=0, sleep_level=3)).json()[
        "errors"
    ]
    fields = {err["loc"][1]: err["msg"] for err in bad}
    assert set(fields) == {"aliases", "idle_timeout_s", "sleep_level"}
    assert "slug" in fields["aliases"]
    repeated = client.post("/api/models", json=_model("x", aliases=["a", "a"]))
    assert repeated.status_code == 422 and "aliases repeat: a" in repeated.text
    own = client.post("/api/models", json=_model("x", served_model_name="xs", aliases=["xs"]))
    assert own.status_code == 422 and "already the served model name" in own.text


def test_a_name_that_already_routes_elsewhere_is_a_409(client):
    assert (
        client.post("/api/models", json=_model("llama", served_model_name="meta-llama", aliases=["l"])).status_code
        == 201
    )
    for clashing in (
        _model("other", aliases=["llama"]),  # another config's name
        _model("other", aliases=["meta-llama"]),  # its served name
        _model("other", aliases=["l"]),  # its alias
        _model("other", served_model_name="l"),  # a served name equal to an alias
        _model("l"),  # a config named like another's alias
        _model("other", aliases=["other"]),  # its own name again
    ):
        refused = client.post("/api/models", json=clashing)
        assert refused.status_code == 409, clashing
        assert "must each lead to one model" in refused.json()["detail"]
    assert [m["name"] for m in client.get("/api/models").json()] == ["llama"]
    # Replacing a config may keep its own names.
    kept = client.put("/api/models/llama", json={"model": "org/llama", "served_model_name": "meta-llama",
                                                 "aliases": ["l", "l2"]})  # fmt: skip
    assert kept.status_code == 200, kept.text
    client.post("/api/models", json=_model("qwen"))
    taken = client.put("/api/models/qwen", json={"model": "org/qwen", "aliases": ["l2"]})
    assert taken.status_code == 409 and "alias of model config 'llama'" in taken.json()["detail"]


def test_name_clash_says_who_holds_the_name():
    assert name_clash([("a", None, ["x"]), ("b", "b", ["y"])]) is None
    clash = name_clash([("a", None, ["x"]), ("b", "x", [])])
    assert (
        clash is not None
        and "'x' is both the alias of model config 'a' and the served model name of model config 'b'" in clash
    )


def test_an_import_that_would_make_two_models_answer_one_name_changes_nothing(client):
    client.post("/api/models", json=_model("llama", aliases=["fast"]))
    doc = "format: vllm-manager\nversion: 1\nmodels:\n- name: qwen\n  model: org/qwen\n  aliases: [fast]\n"
    refused = client.post("/api/import", content=doc, headers={"content-type": "application/yaml"})
    assert refused.status_code == 409 and "'fast'" in refused.json()["detail"]
    assert [m["name"] for m in client.get("/api/models").json()] == ["llama"]
    # Replacing llama in the same file frees the alias.
    both = doc + "- name: llama\n  model: org/llama\n"
    assert client.post("/api/import", content=both, headers={"content-type": "application/yaml"}).status_code == 200
    assert client.get("/api/models/qwen").json()["aliases"] == ["fast"]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, VERSIONS / f"{name}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_migration_adds_the_fields_to_stored_configs(tmp_path):
    engine = create_engine(f"sqlite:///{tmp_path / 'mig.db'}")
    first, fourth = _load("0001_initial"), _load("0004_front_door_fields")
    assert (fourth.revision, fourth.down_revision) == ("0004_front_door_fields", "0003_lora_adapters")
    with engine.begin() as conn:
        with Operations.context(MigrationContext.configure(conn)):
            first.upgrade()
        conn.execute(
            text(
                "INSERT INTO model_config (name, model, dtype, tensor_parallel_size, gpu_ids, gpu_memory_utilization,"
                " kv_cache_dtype, enforce_eager, enable_lora, extra_args, env, autostart, start_timeout_s,"
                " created_at, updated_at) VALUES ('old', '/m', 'auto', 1, '[]', 0.9, 'auto', 0, 0, '[]', '{}', 0,"
                " 900, '2026-01-01', '2026-01-01')"
            )
        )
        with Operations.context(MigrationContext.configure(conn)):
            fourth.upgrade()
            _load("0007_nodes").upgrade()  # the config's Ray node, later
            _load("0010_downloads").upgrade()  # and its download fields
            _load("0011_replicas").upgrade()  # and its replicas
            _load("0014_max_concurrent").upgrade()  # and its limit on requests at once
            _load("0015_min_residency").upgrade()  # and how long a swap keeps it in
            _load("0016_loading_progress").upgrade()  # and its loading progress for streams
        row = conn.execute(
            text(
                "SELECT aliases, idle_timeout_s, persistent, sleep_level, node, download_timeout_s, wait_for_download, "
                "replicas, min_replicas, max_replicas, scale_up_after_s, scale_down_after_s, max_concurrent, "
                "min_residency_s, loading_progress FROM model_config"
            )
        ).one()
        assert tuple(row) == ("[]", None, 0, None, None, None, 0, 1, None, None, 10, 300, None, None, 0)
        columns = {c["name"] for c in inspect(conn).get_columns("model_config")}
        assert {"aliases", "idle_timeout_s", "persistent", "sleep_level"} <= columns
        # The table now matches the schema the code uses (other tables come from other revisions).
        wanted = MetaData()
        OffloadProfile.__table__.to_metadata(wanted)
        ModelConfig.__table__.to_metadata(wanted)
        diffs = [d for d in compare_metadata(MigrationContext.configure(conn), wanted) if "model_config" in repr(d)]
        assert diffs == [], diffs


def test_a_lora_adapter_cannot_take_a_name_a_model_answers_to(client, tmp_path):
    client.post("/api/models", json=_model("llama", aliases=["chat"]))
    client.post("/api/models", json=_model("qwen"))
    refused = client.post("/api/loras", json={"name": "chat", "path": str(tmp_path), "base_config": "qwen"})
    assert refused.status_code == 409
    assert "'chat' is the alias of model config 'llama'" in refused.json()["detail"]


def test_a_model_config_cannot_take_a_lora_adapters_name_until_it_is_removed(client, tiny_llama, tmp_path):
    tiny = {"name": "tiny", "model": str(tiny_llama), "enable_lora": True, "max_lora_rank": 16}
    assert client.post("/api/models", json=tiny).status_code == 201
    folder = make_llama_adapter(tmp_path / "sql", tiny_llama, rank=8)
    assert (
        client.post("/api/loras", json={"name": "sql", "path": str(folder), "base_config": "tiny"}).status_code == 201
    )
    refused = client.post("/api/models", json=_model("other", aliases=["sql"]))
    assert refused.status_code == 409
    assert refused.json()["detail"].startswith("'sql' is a LoRA adapter of model config 'tiny'")
    assert (refused.json()["name"], refused.json()["held_by"]) == ("sql", "sql")
    doc = "format: vllm-manager\nversion: 1\nmodels:\n- name: sql\n  model: org/sql\n"
    imported = client.post("/api/import", content=doc, headers={"content-type": "application/yaml"})
    assert imported.status_code == 409 and "'sql' is a LoRA adapter" in imported.json()["detail"]
    assert client.delete("/api/loras/sql").status_code == 204
    assert client.post("/api/models", json=_model("other", aliases=["sql"])).status_code == 201
