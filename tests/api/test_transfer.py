"""Export everything as one YAML file and import it back without loss."""

from __future__ import annotations

import yaml
from fastapi.testclient import TestClient

from manager.app import create_app

YAML = {"content-type": "application/yaml"}
PROFILES = [
    {
        "name": "kv-blocks",
        "kv_offload_num_cpu_blocks": 50000,
        "kv_eviction_policy": "arc",
        "description": "a size in blocks",
    },
    {
        "name": "moe",
        "moe_expert_offload": True,
        "moe_gpu_cache_gib": 6.5,
        "lora_cpu_pooling": True,
        "lora_pool_gib": 12,
        "pinned_budget_gib": 64,
    },
]
MODELS = [
    {
        "name": "qwen3-30b",
        "model": "Qwen/Qwen3-30B-A3B",
        "offload_profile": "moe",
        "gpu_ids": [0, 1],
        "tensor_parallel_size": 2,
        "env": {"HF_HUB_OFFLINE": "1"},
        "extra_args": ["--max-num-batched-tokens", "4096"],
        "enable_lora": True,
        "max_loras": 2,
        "max_lora_rank": 16,
        "autostart": True,
        "start_timeout_s": 1800,
        "aliases": ["qwen", "qwen-moe"],
        "idle_timeout_s": 600,
        "persistent": True,
        "sleep_level": 1,
    },
    {
        "name": "llama",
        "model": "org/llama",
        "kv_cache_dtype": "fp8",
        "enable_prefix_caching": False,
        "offload_profile": "kv-blocks",
    },
]


def test_round_trip_without_loss(client, settings, tmp_path):
    for p in PROFILES:
        assert client.post("/api/profiles", json=p).status_code == 201
    for m in MODELS:
        assert client.post("/api/models", json=m).status_code == 201
    exported = client.get("/api/export")
    assert exported.status_code == 200
    assert exported.headers["content-type"].startswith("application/yaml")
    text = exported.text

    fresh = settings.model_copy(update={"data_dir": tmp_path / "other"})
    with TestClient(create_app(fresh)) as c2:
        result = c2.post("/api/import", content=text, headers=YAML)
        assert result.status_code == 200, result.text
        assert len(result.json()["created"]) == 4
        assert c2.get("/api/export").text == text
        assert c2.get("/api/models/qwen3-30b").json()["env"] == {"HF_HUB_OFFLINE": "1"}
        assert c2.get("/api/models/qwen3-30b").json()["aliases"] == ["qwen", "qwen-moe"]
        assert "sleep_level: 1" in text and "idle_timeout_s: 600" in text


def test_bad_import_changes_nothing(client):
    client.post("/api/profiles", json=PROFILES[1])
    doc = {
        "format": "vllm-manager",
        "version": 1,
        "profiles": [{"name": "new", "kv_offload_gib": 4}],
        "models": [{"name": "m", "model": "x", "gpu_memory_utilization": 7}],
    }
    resp = client.post("/api/import", content=yaml.safe_dump(doc), headers=YAML)
    assert resp.status_code == 422
    assert "models[0].gpu_memory_utilization" in resp.json()["detail"]
    assert [p["name"] for p in client.get("/api/profiles").json()] == ["moe"]

    assert client.post("/api/import", content="{not: yaml: at all", headers=YAML).status_code == 422
    assert client.post("/api/import", content="just: a mapping", headers=YAML).status_code == 422


def test_import_without_overwrite_reports_clashes(client):
    client.post("/api/profiles", json=PROFILES[1])
    text = client.get("/api/export").text
    resp = client.post("/api/import?overwrite=false", content=text, headers=YAML)
    assert resp.status_code == 409 and "moe" in resp.json()["detail"]
    assert client.post("/api/import", content=text, headers=YAML).json()["replaced"] == ["profile moe"]
