"""Inference keys at /v1, through the whole manager with stand-in engines: who is let in, which
models each key sees, and the usage counted per key and model (tokens from the engine's answers)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import httpx
from fastapi.testclient import TestClient

from manager.app import create_app
from tests.frontdoor.test_v1_routes import ADMIN_TOKEN, CHAT, assert_openai_error, seen, worker_of

ADMIN = {"authorization": f"Bearer {ADMIN_TOKEN}"}


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def make_key(client: TestClient, name: str, models: list[str] | None = None, headers: dict | None = None) -> str:
    made = client.post("/api/keys", json={"name": name, "models": models or []}, headers=headers or {})
    assert made.status_code == 201, made.text
    return made.json()["key"]


def chat(client: TestClient, model: str, key: str | None = None, **extra):
    return client.post(
        "/v1/chat/completions", json={"model": model, **CHAT, **extra}, headers=bearer(key) if key else {}
    )


def listed(client: TestClient, key: str | None = None) -> list[str]:
    resp = client.get("/v1/models", headers=bearer(key) if key else {})
    assert resp.status_code == 200, resp.text
    return [m["id"] for m in resp.json()["data"]]


def totals(client: TestClient, headers: dict | None = None, **params) -> dict[tuple[str | None, str], dict]:
    report = client.get("/api/usage", params={"per": "minute", **params}, headers=headers or {})
    assert report.status_code == 200, report.text
    return {(t["key"], t["model"]): t for t in report.json()["totals"]}


def test_once_a_key_exists_v1_needs_one(door):
    assert chat(door, "a").status_code == 200  # no key yet: open on loopback
    key = make_key(door, "app")
    assert key.startswith("vmk_")
    missing = assert_openai_error(chat(door, "a"), 401, "invalid_api_key")
    assert "inference key" in missing["message"] and "keys create" in missing["message"]
    for wrong in ("vmk_" + "x" * 43, "unused", key[:-1]):
        assert_openai_error(chat(door, "a", wrong), 401, "invalid_api_key")
    assert_openai_error(door.get("/v1/models"), 401, "invalid_api_key")
    answered = chat(door, "a", key)
    assert answered.status_code == 200 and answered.json()["choices"][0]["message"]["content"] == "t0 t1 t2"
    # The key is the manager's business: the engine never sees it.
    assert "authorization" not in json.dumps(seen(door, "a")).lower()


def test_a_key_for_some_models_finds_no_other(door):
    only_a = make_key(door, "only-a", ["a"])
    everything = make_key(door, "all")
    assert listed(door, only_a) == ["a", "alpha", "org/model-a"]
    assert listed(door, everything) == ["a", "alpha", "b", "org/model-a"]
    hidden = chat(door, "b", only_a)
    unknown = chat(door, "nope", only_a)
    assert hidden.status_code == unknown.status_code == 404
    # Word for word the answer for a model that does not exist: b is not even named.
    assert hidden.json() == json.loads(unknown.text.replace("'nope'", "'b'"))
    assert "Models that exist: a, alpha, org/model-a" in hidden.json()["error"]["message"]
    assert [w["model"] for w in door.get("/api/workers").json()] == []  # b was not started for it
    for name in ("a", "alpha", "org/model-a"):
        assert chat(door, name, only_a).status_code == 200


def test_a_revoked_key_is_refused_and_the_others_go_on(door):
    first, second = make_key(door, "first"), make_key(door, "second")
    assert door.delete("/api/keys/first").status_code == 204
    assert_openai_error(chat(door, "a", first), 401, "invalid_api_key")
    assert chat(door, "a", second).status_code == 200
    states = {k["name"]: k["active"] for k in door.get("/api/keys").json()}
    assert states == {"first": False, "second": True}
    # The name is free again: a new key under it is another key.
    renewed = make_key(door, "first")
    assert renewed != first and chat(door, "a", renewed).status_code == 200
    assert_openai_error(chat(door, "a", first), 401, "invalid_api_key")


def test_the_admin_token_works_where_a_key_would(door_settings):
    with TestClient(create_app(door_settings.model_copy(update={"api_token": ADMIN_TOKEN}))) as client:
        client.post("/api/models", json={"name": "a", "model": "org/a"}, headers=ADMIN)
        make_key(client, "app", headers=ADMIN)
        assert client.post("/api/keys", json={"name": "sneaky"}).status_code == 401  # changes need the token
        assert chat(client, "a", ADMIN_TOKEN).status_code == 200
        assert_openai_error(chat(client, "a"), 401, "invalid_api_key")
        assert totals(client, ADMIN, key="-")[(None, "a")]["requests"] == 1


def test_a_public_bind_needs_a_key_or_the_admin_token_or_an_explicit_opening(door_settings):
    public = door_settings.model_copy(update={"host": "0.0.0.0", "api_token": ADMIN_TOKEN})
    with TestClient(create_app(public)) as client:
        client.post("/api/models", json={"name": "a", "model": "org/a"}, headers=ADMIN)
        refused = assert_openai_error(chat(client, "a"), 401, "invalid_api_key")
        assert "keys create" in refused["message"] and "VLLM_MANAGER_OPEN_INFERENCE" in refused["message"]
        key = make_key(client, "app", headers=ADMIN)
        assert chat(client, "a", key).status_code == 200
    # Opening /v1 explicitly does not open it while keys exist: they are the operator's later choice.
    with TestClient(create_app(public.model_copy(update={"open_inference": True}))) as client:
        assert_openai_error(chat(client, "a"), 401, "invalid_api_key")
        assert chat(client, "a", key).status_code == 200
        client.delete("/api/keys/app", headers=ADMIN)
        # Nor once the last key is revoked: the admin opens it again, by name.
        assert_openai_error(chat(client, "a"), 401, "invalid_api_key")
        assert client.post("/api/v1-access/open", headers=ADMIN).json()["needs_key"] is False
        assert chat(client, "a").status_code == 200
        assert_openai_error(chat(client, "a", key), 401, "invalid_api_key")


def test_revoking_the_last_key_leaves_v1_closed_until_the_admin_opens_it(door):
    key = make_key(door, "app")
    assert door.delete("/api/keys/app").status_code == 204
    closed = assert_openai_error(chat(door, "a"), 401, "invalid_api_key")
    assert "revoked" in closed["message"] and "keys open-v1" in closed["message"]
    revoked = assert_openai_error(chat(door, "a", key), 401, "invalid_api_key")
    assert "revoked" in revoked["message"]
    assert_openai_error(door.get("/v1/models"), 401, "invalid_api_key")
    opened = door.post("/api/v1-access/open")
    assert opened.status_code == 200 and opened.json()["needs_key"] is False
    assert "loopback" in opened.json()["message"]
    assert chat(door, "a").status_code == 200
    assert chat(door, "a", "EMPTY").status_code == 200  # what OpenAI clients send when /v1 needs nothing
    # The revoked key stays refused, even on an open /v1: its holder must not think it still counts.
    assert_openai_error(chat(door, "a", key), 401, "invalid_api_key")
    # A new key closes /v1 again, and it cannot be opened while a key is active.
    renewed = make_key(door, "app")
    assert_openai_error(chat(door, "a"), 401, "invalid_api_key")
    refused = door.post("/api/v1-access/open")
    assert refused.status_code == 409 and "app" in refused.json()["detail"]
    assert chat(door, "a", renewed).status_code == 200


def test_usage_counts_requests_and_the_tokens_engines_report(door):
    key = make_key(door, "app")
    assert chat(door, "a", key).status_code == 200  # 2 prompt and 3 completion tokens
    with door.stream(
        "POST",
        "/v1/chat/completions",
        json={"model": "a", **CHAT, "max_tokens": 4, "stream": True},
        headers=bearer(key),
    ) as resp:
        streamed = resp.read().decode()
    # The client did not ask for the usage chunk, so it does not get it; the engine was asked for it.
    events = [line for line in streamed.splitlines() if line.startswith("data: ")]
    assert len(events) == 5 and events[-1] == "data: [DONE]" and '"usage"' not in streamed
    assert seen(door, "a")[-1]["stream_options"] == {"include_usage": True}
    # A client that asks for it gets it as the engine wrote it.
    with door.stream(
        "POST",
        "/v1/completions",
        json={"model": "a", "prompt": "x", "max_tokens": 5, "stream": True, "stream_options": {"include_usage": True}},
        headers=bearer(key),
    ) as resp:
        asked = resp.read().decode()
    assert '"choices":[],"usage":{"prompt_tokens":2,"completion_tokens":5' in asked
    assert chat(door, "b", key).status_code == 200  # swaps a out: b has its own line
    counted = totals(door)
    assert counted[("app", "a")] | {"start": None} == {
        "start": None, "key": "app", "key_prefix": key[:12], "model": "a",
        "requests": 3, "errors": 0, "prompt_tokens": 6, "completion_tokens": 12,
    }  # fmt: skip
    assert counted[("app", "b")]["requests"] == 1 and counted[("app", "b")]["completion_tokens"] == 3
    assert set(counted) == {("app", "a"), ("app", "b")}
    assert totals(door, model="b").keys() == {("app", "b")}
    used = door.get("/api/keys").json()[0]
    assert used["name"] == "app" and used["last_used_at"] is not None


def test_a_stream_reaches_the_client_as_the_engine_writes_it_for_a_client_that_did_not_ask_for_usage(door):
    key = make_key(door, "app")
    for path, body in (
        ("/v1/chat/completions", {"model": "b", **CHAT, "max_tokens": 3, "stream": True}),
        ("/v1/completions", {"model": "b", "prompt": "x", "max_tokens": 2, "stream": True}),
    ):
        with door.stream("POST", path, json=body, headers=bearer(key)) as resp:
            through = resp.read()
        # What the engine writes for the request as the client sent it (no usage asked for).
        direct = httpx.post(f"http://127.0.0.1:{worker_of(door, 'b')['port']}{path}", json=body).content
        assert b'"system_fingerprint":"fp-stand-in"' in direct and b'"usage"' not in direct
        same_second = re.compile(rb'"created":\d+')
        assert same_second.sub(b"", through) == same_second.sub(b"", direct), path
    assert totals(door)[("app", "b")]["completion_tokens"] == 5


def test_guessing_keys_is_slowed_down_like_guessing_the_token(door):
    key = make_key(door, "app")
    for i in range(10):
        assert_openai_error(chat(door, "a", f"vmk_guess{i}"), 401, "invalid_api_key")
    refused = chat(door, "a", key)  # the right key too, until the window has passed
    body = assert_openai_error(refused, 429, "too_many_wrong_keys")
    assert int(refused.headers["retry-after"]) > 0 and "too many wrong inference keys" in body["message"]


def cli(settings, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "manager", *args, "--data-dir", str(settings.data_dir)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_keys_and_tokens_the_cli_makes_or_revokes_count_at_the_next_request(door, door_settings):
    # The front door keeps what it read of the keys until the store changes, in any process.
    assert chat(door, "a").status_code == 200
    made = [re.search(r"vmk_[A-Za-z0-9_-]+", cli(door_settings, "keys", "create", name)) for name in ("one", "two")]
    assert made[0] is not None and made[1] is not None
    one, two = made[0].group(0), made[1].group(0)
    assert_openai_error(chat(door, "a"), 401, "invalid_api_key")
    assert chat(door, "a", one).status_code == 200
    token = re.search(r"vmt_[A-Za-z0-9_-]+", cli(door_settings, "token", "create"))
    assert token is not None and chat(door, "a", token.group(0)).status_code == 200
    cli(door_settings, "keys", "revoke", "one")
    assert_openai_error(chat(door, "a", one), 401, "invalid_api_key")
    assert chat(door, "a", two).status_code == 200


def test_a_method_or_path_v1_does_not_serve_is_said_before_any_credentials(client):
    assert client.post("/api/keys", json={"name": "app"}).status_code == 201  # /v1 now takes keys only
    put = client.put("/v1/chat/completions", json={"model": "m"})
    assert put.status_code == 405 and put.headers["allow"] == "POST"
    assert client.get("/v1/nothing-here").status_code == 404
    assert client.post("/v1/chat/completions", json={"model": "m"}).status_code == 401  # served: needs the key
