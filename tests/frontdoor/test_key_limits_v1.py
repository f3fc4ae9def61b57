"""A key's limits at /v1, through the whole manager with stand-in engines: requests and tokens per
minute, requests in flight, a token budget read from the stored usage, expiry, and priority."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta

import httpx
import pytest
from fastapi.testclient import TestClient
from sqlmodel import select

from manager.app import create_app
from manager.db import make_engine, session
from manager.schemas.inference_key import InferenceKey
from manager.services import usage
from tests.frontdoor.conftest import served, two_models
from tests.frontdoor.test_keys_v1 import bearer, chat
from tests.frontdoor.test_v1_routes import assert_openai_error

RATE_HEADERS = (
    "x-ratelimit-limit-requests",
    "x-ratelimit-remaining-requests",
    "x-ratelimit-reset-requests",
    "x-ratelimit-limit-tokens",
    "x-ratelimit-remaining-tokens",
    "x-ratelimit-reset-tokens",
)


def make_key(client: TestClient | httpx.Client, name: str, **limits) -> str:
    made = client.post("/api/keys", json={"name": name, **limits})
    assert made.status_code == 201, made.text
    return made.json()["key"]


def metric(client: TestClient | httpx.Client, line_start: str) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(line_start):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_key_with_rpm_2_gets_two_answers_then_429_with_openais_headers(door):
    key = make_key(door, "app", rpm=2, tpm=1000)
    first, second = chat(door, "a", key), chat(door, "a", key)
    assert first.status_code == second.status_code == 200
    assert first.headers["x-ratelimit-limit-requests"] == "2"
    assert (first.headers["x-ratelimit-remaining-requests"], second.headers["x-ratelimit-remaining-requests"]) == (
        "1",
        "0",
    )
    assert first.headers["x-ratelimit-limit-tokens"] == "1000"
    refused = chat(door, "a", key)
    error = assert_openai_error(refused, 429, "rate_limit_exceeded")
    assert error["type"] == "rate_limit_error" and "rpm 2" in error["message"]
    assert all(name in refused.headers for name in RATE_HEADERS)
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    assert 1 <= int(refused.headers["retry-after"]) <= 60
    assert refused.headers["x-ratelimit-reset-requests"].endswith("s")
    assert metric(door, 'vllm_manager_proxy_limited_total{key="app",limit="rpm"}') == 1
    # Other keys, and keys without limits, are not counted with it, and get no such headers.
    other = make_key(door, "other")
    plain = chat(door, "a", other)
    assert plain.status_code == 200 and "x-ratelimit-limit-requests" not in plain.headers


def test_tpm_is_charged_with_the_tokens_the_engine_says_it_used(door):
    key = make_key(door, "app", tpm=10)
    first = chat(door, "a", key)  # the stand-in: 2 prompt tokens, max_tokens (3) completion tokens
    assert first.status_code == 200 and first.headers["x-ratelimit-remaining-tokens"] == "10"
    second = chat(door, "a", key)
    assert second.status_code == 200 and second.headers["x-ratelimit-remaining-tokens"] == "5"
    refused = chat(door, "a", key)
    assert "tpm 10" in assert_openai_error(refused, 429, "rate_limit_exceeded")["message"]
    assert refused.headers["x-ratelimit-remaining-tokens"] == "0"
    assert metric(door, 'vllm_manager_proxy_tokens_total{key="app",kind="completion",model="a"}') == 6
    assert metric(door, 'vllm_manager_proxy_tokens_total{key="app",kind="prompt",model="a"}') == 4
    assert metric(door, 'vllm_manager_proxy_limited_total{key="app",limit="tpm"}') == 1


def test_a_budget_counts_what_the_stored_usage_says_the_period_used(door, door_settings):
    app_key = make_key(door, "app", token_budget=20, budget_period="day")
    # What the key used before (before a restart, say) is in the usage table: today's counts, not yesterday's.
    engine = make_engine(door_settings.db_path)
    now = int(time.time()) // 60 * 60
    with session(engine) as db:
        key_id = db.exec(select(InferenceKey.id).where(InferenceKey.name == "app")).one()
        used_today = usage.Counts(requests=1, prompt_tokens=4, completion_tokens=6)
        yesterday = usage.Counts(requests=9, prompt_tokens=900, completion_tokens=900)
        usage.add(db, [usage.Row(now, key_id, "a", used_today), usage.Row(now - 86400, key_id, "a", yesterday)])
        db.commit()
    engine.dispose()

    # 10 of 20 used today: max_tokens 11 cannot fit, 3 can (and uses 2 + 3).
    over = chat(door, "a", app_key, max_tokens=11)
    error = assert_openai_error(over, 429, "insufficient_quota")
    assert "10 tokens left" in error["message"] and "per day" in error["message"]
    assert 1 <= int(over.headers["retry-after"]) <= 86400
    assert chat(door, "a", app_key, max_tokens=3).status_code == 200
    # 15 used: 5 left.
    assert_openai_error(chat(door, "a", app_key, max_tokens=6), 429, "insufficient_quota")
    assert chat(door, "a", app_key, max_tokens=3).status_code == 200
    # 20 used: a request without max_tokens needs one token, and none is left.
    no_max = door.post(
        "/v1/chat/completions", json={"model": "a", "messages": [{"role": "user", "content": "hi"}]},
        headers=bearer(app_key),
    )  # fmt: skip
    assert_openai_error(no_max, 429, "insufficient_quota")
    assert metric(door, 'vllm_manager_proxy_limited_total{key="app",limit="budget"}') == 3


def test_an_expired_key_is_refused_saying_so(door, door_settings):
    key = make_key(door, "app", expires_at=(datetime.now(UTC) + timedelta(days=1)).isoformat())
    assert chat(door, "a", key).status_code == 200
    engine = make_engine(door_settings.db_path)
    with session(engine) as db:
        stored = db.exec(select(InferenceKey).where(InferenceKey.name == "app")).one()
        stored.expires_at = datetime.now(UTC) - timedelta(minutes=1)
        db.add(stored)
        db.commit()
    engine.dispose()
    expired = assert_openai_error(chat(door, "a", key), 401, "invalid_api_key")
    assert "expired at" in expired["message"]
    assert door.get("/api/keys").json()[0]["expired"] is True
    later = (datetime.now(UTC) + timedelta(hours=1)).isoformat()
    assert door.patch("/api/keys/app", json={"expires_at": later}).status_code == 200
    assert chat(door, "a", key).status_code == 200


def test_a_keys_priority_reaches_the_caller_the_scheduler_sees(door):
    batch = make_key(door, "nightly", priority="batch")
    plain = make_key(door, "app")
    runtime = door.app.state.runtime
    callers = {k: runtime.front_door.caller(k, runtime.settings) for k in (batch, plain)}
    assert (callers[batch].priority, callers[plain].priority) == ("batch", "interactive")
    assert callers[batch].limits is None  # no limits: nothing counted for it


@pytest.fixture
def slow_url(door_settings):
    with served(create_app(door_settings)) as url:
        body = {"name": "a", "model": "org/a", "gpu_ids": [0], "env": {"STAND_IN_TOKEN_S": "0.05"}}
        assert httpx.post(f"{url}/api/models", json=body).status_code == 201
        yield url


def test_max_concurrent_refuses_while_its_requests_are_in_flight(slow_url):
    with httpx.Client(base_url=slow_url, timeout=60) as client:
        key = make_key(client, "app", max_concurrent=1)
        body = {"model": "a", "prompt": "hi", "max_tokens": 2000, "stream": True}
        with client.stream("POST", "/v1/completions", json=body, headers=bearer(key)) as held:
            assert held.status_code == 200
            lines = held.iter_lines()  # kept: a generator dropped half-read would close the stream
            assert next(lines).startswith("data: ")
            refused = client.post("/v1/completions", json={**body, "stream": False}, headers=bearer(key))
            error = assert_openai_error(refused, 429, "rate_limit_exceeded")
            assert "max_concurrent 1" in error["message"] and refused.headers["retry-after"] == "1"
        # The client left mid-stream: its request is no longer in flight.
        deadline = time.monotonic() + 10
        while (answer := client.post("/v1/completions", json={**body, "max_tokens": 2, "stream": False},
                                     headers=bearer(key))).status_code == 429:  # fmt: skip
            assert time.monotonic() < deadline, answer.text
            time.sleep(0.1)
        assert answer.status_code == 200
        assert metric(client, 'vllm_manager_proxy_limited_total{key="app",limit="concurrent"}') >= 1


def test_a_full_queue_is_counted_per_key_with_the_limits(door_settings):
    with TestClient(create_app(door_settings.model_copy(update={"proxy_max_queue": 0}))) as client:
        two_models(client)
        key = make_key(client, "app")
        assert_openai_error(chat(client, "a", key), 429, "queue_full")
        assert metric(client, 'vllm_manager_proxy_limited_total{key="app",limit="queue"}') == 1
