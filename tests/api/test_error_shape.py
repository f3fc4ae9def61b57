"""Every error of the API has one shape; /v1's have OpenAI's; the schema says which calls need the token."""

from __future__ import annotations

from fastapi.testclient import TestClient

from manager.app import create_app

MODEL = {"name": "m", "model": "/models/m"}


def test_a_request_that_does_not_match_names_each_field_in_one_message(client):
    resp = client.post("/api/models", json={**MODEL, "name": "Not A Slug", "enforce_eager": 0, "max_num_seqs": True})
    body = resp.json()
    assert resp.status_code == 422 and set(body) == {"detail", "errors"}
    assert "name: Value error, must be a slug" in body["detail"]
    assert "enforce_eager: Value error, must be true or false" in body["detail"]
    assert "max_num_seqs: Value error, must be a number, not true or false" in body["detail"]
    assert {tuple(e["loc"]) for e in body["errors"]} == {
        ("body", "name"),
        ("body", "enforce_eager"),
        ("body", "max_num_seqs"),
    }


def test_refusals_before_any_route_have_the_same_shape(client):
    host = client.get("/api/health", headers={"Host": "attacker.example"})
    assert host.status_code == 400 and "VLLM_MANAGER_ALLOWED_HOSTS" in host.json()["detail"]
    unknown = client.get("/api/nothing-here")
    assert unknown.status_code == 404 and "/docs" in unknown.json()["detail"]
    method = client.put("/api/profiles")
    assert method.status_code == 405 and method.headers["allow"] == "GET, HEAD, POST"
    assert method.json() == {"detail": "/api/profiles does not take PUT; it takes GET, HEAD, POST"}


def test_v1_refuses_a_method_in_openais_shape(client):
    resp = client.get("/v1/chat/completions")
    assert resp.status_code == 405 and resp.headers["allow"] == "POST"
    assert resp.json()["error"]["code"] == "method_not_allowed"
    assert client.put("/tokenize").json()["error"]["message"] == "/tokenize does not take PUT; it takes POST"


def test_the_schema_names_the_token_on_the_calls_that_need_it_once_one_exists(settings):
    def secured(client: TestClient) -> set[str]:
        paths = client.get("/openapi.json", headers={"authorization": f"Bearer {token}"}).json()["paths"]
        return {f"{m.upper()} {p}" for p, ops in paths.items() for m, op in ops.items() if "security" in op}

    token = "t" * 40
    with_token = settings.model_copy(update={"api_token": token})
    with TestClient(create_app(settings)) as open_manager:
        assert secured(open_manager) == set()
    with TestClient(create_app(with_token)) as guarded:
        needs = secured(guarded)
        assert {"POST /api/models", "DELETE /api/models/{name}", "GET /api/export"} <= needs
        # Reads need the token too (reads are not open), and /v1 on loopback is open while no key exists.
        assert "GET /api/models" in needs and "GET /api/health" not in needs
        assert "POST /v1/chat/completions" not in needs
