"""Tokens: once one exists, every call needs it (reads too, unless VLLM_MANAGER_OPEN_READS), except
the health probe; wrong tokens are slowed down; tokens from the environment must be long."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from manager.app import create_app
from manager.auth.throttle import WrongTokenThrottle
from manager.db import make_engine, migrate, session
from manager.services import tokens

ENV_TOKEN = "env-token-" + "x" * 30


def _make_token(settings) -> str:
    settings.ensure_dirs()
    engine = make_engine(settings.db_path)
    migrate(engine)
    with session(engine) as db:
        token = tokens.create_token(db)
    engine.dispose()
    return token


def test_no_token_configured_means_open(client):
    assert client.post("/api/profiles", json={"name": "p"}).status_code == 201
    assert client.get("/api/profiles").status_code == 200
    assert client.get("/").status_code == 200


def test_stored_token_guards_changes(settings):
    token = _make_token(settings)
    with TestClient(create_app(settings)) as c:
        denied = c.post("/api/profiles", json={"name": "p"})
        assert denied.status_code == 401 and "Bearer" in denied.json()["detail"]
        wrong = c.post("/api/profiles", json={"name": "p"}, headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401
        assert c.delete("/api/models/x").status_code == 401
        ok = c.post("/api/profiles", json={"name": "p"}, headers={"Authorization": f"Bearer {token}"})
        assert ok.status_code == 201


READS = ["/api/profiles", "/api/models", "/api/workers", "/api/events", "/api/metrics/series", "/metrics",
         "/api/plan/gpus", "/openapi.json", "/docs", "/redoc"]  # fmt: skip


def test_once_a_token_exists_reads_need_it_too(settings):
    token = _make_token(settings)
    with TestClient(create_app(settings)) as c:
        for path in READS:
            denied = c.get(path)
            assert denied.status_code == 401, path
            assert denied.headers["www-authenticate"] == "Bearer"
            assert "/login" in denied.json()["detail"] and "VLLM_MANAGER_OPEN_READS" in denied.json()["detail"]
            assert c.get(path, headers={"Authorization": f"Bearer {token}"}).status_code == 200, path
        assert c.get("/api/events", headers={"Authorization": "Bearer nope"}).status_code == 401
        assert c.head("/api/profiles").status_code == 401


def test_the_health_probe_and_static_files_stay_open(settings):
    _make_token(settings)
    with TestClient(create_app(settings)) as c:
        assert c.get("/api/health").json()["status"] == "ok"
        # The container's probe sends the token when it has one; a wrong one must not fail the probe.
        assert c.get("/api/health", headers={"Authorization": "Bearer nope"}).status_code == 200
        assert c.get("/static/js/dashboard.js").status_code == 200
        assert c.get("/login").status_code == 200


def test_open_reads_keep_reads_open_and_changes_guarded(settings):
    token = _make_token(settings)
    with TestClient(create_app(settings.model_copy(update={"open_reads": True}))) as c:
        for path in READS:
            assert c.get(path).status_code == 200, path
        assert c.get("/").status_code == 200
        assert c.post("/api/profiles", json={"name": "p"}).status_code == 401
        ok = c.post("/api/profiles", json={"name": "p"}, headers={"Authorization": f"Bearer {token}"})
        assert ok.status_code == 201
        # A token that is sent is checked, reads included: a wrong one is never taken for none.
        assert c.get("/api/profiles", headers={"Authorization": "Bearer nope"}).status_code == 401


def test_env_token(settings):
    guarded = settings.model_copy(update={"api_token": ENV_TOKEN})
    with TestClient(create_app(guarded)) as c:
        assert c.post("/api/profiles", json={"name": "p"}).status_code == 401
        ok = c.post("/api/profiles", json={"name": "p"}, headers={"Authorization": f"Bearer {ENV_TOKEN}"})
        assert ok.status_code == 201
        assert c.get("/api/profiles/p", headers={"Authorization": f"Bearer {ENV_TOKEN}"}).status_code == 200


@pytest.mark.parametrize("short", ["x", "s3cret-token", "y" * 31])
def test_a_short_token_from_the_environment_stops_the_start(settings, short):
    with pytest.raises(ValueError, match="too short"):
        create_app(settings.model_copy(update={"api_token": short}))


def test_a_short_token_in_the_token_file_stops_the_start(settings, tmp_path):
    token_file = tmp_path / "api_token"
    token_file.write_text("short\n")
    with pytest.raises(ValueError, match=r"VLLM_MANAGER_API_TOKEN_FILE .*\(5 of at least 32 characters\)"):
        create_app(settings.model_copy(update={"api_token_file": token_file}))
    token_file.write_text("z" * 32 + "\n")
    assert create_app(settings.model_copy(update={"api_token_file": token_file})) is not None


def test_repeated_wrong_tokens_get_429_until_the_window_ends(settings):
    guarded = settings.model_copy(update={"api_token": ENV_TOKEN})
    with TestClient(create_app(guarded)) as c:
        clock = [0.0]
        c.app.state.runtime.wrong_tokens = WrongTokenThrottle(clock=lambda: clock[0])
        for n in range(10):
            wrong = c.get("/api/profiles", headers={"Authorization": f"Bearer guess-{n}"})
            assert wrong.status_code == 401
        limited = c.get("/api/profiles", headers={"Authorization": "Bearer guess-10"})
        assert limited.status_code == 429
        assert int(limited.headers["retry-after"]) == 300
        assert "too many wrong tokens" in limited.json()["detail"]
        # The right token waits too: otherwise a guesser would learn which guess was right.
        right = {"Authorization": f"Bearer {ENV_TOKEN}"}
        assert c.get("/api/profiles", headers=right).status_code == 429
        assert c.post("/api/profiles", json={"name": "p"}, headers=right).status_code == 429
        assert c.post("/login", data={"token": ENV_TOKEN}, follow_redirects=False).status_code == 429
        assert c.get("/api/health").status_code == 200  # probes are not held up
        clock[0] += 299
        assert int(c.get("/api/profiles", headers=right).headers["retry-after"]) == 1
        clock[0] += 1
        assert c.get("/api/profiles", headers=right).status_code == 200


def test_only_the_hash_is_stored(settings):
    token = _make_token(settings)
    raw = b"".join(f.read_bytes() for f in settings.data_dir.glob("manager.db*"))
    assert token.encode() not in raw


def test_a_stale_inference_key_does_not_lock_the_admin_out(settings):
    guarded = settings.model_copy(update={"api_token": ENV_TOKEN})
    right = {"Authorization": f"Bearer {ENV_TOKEN}"}
    with TestClient(create_app(guarded)) as c:
        # A script that kept a revoked key (or points its key at the API) from the admin's own address.
        for n in range(10):
            assert c.get("/api/profiles", headers={"Authorization": f"Bearer vmk_stale-{n}"}).status_code == 401
        stale = c.get("/api/profiles", headers={"Authorization": "Bearer vmk_stale-10"})
        assert stale.status_code == 429 and "too many wrong inference keys" in stale.json()["detail"]
        assert c.get("/api/profiles", headers=right).status_code == 200
        assert c.post("/login", data={"token": ENV_TOKEN}, follow_redirects=False).status_code == 303
        # Guesses at the admin token count together wherever they are sent, /v1 included.
        key = c.post("/api/keys", json={"name": "app"}, headers=right).json()["key"]
        for n in range(5):
            assert c.get("/v1/models", headers={"Authorization": f"Bearer guess-{n}"}).status_code == 401
            assert c.get("/api/profiles", headers={"Authorization": f"Bearer guess-{n}"}).status_code == 401
        assert c.get("/api/profiles", headers=right).status_code == 429
        assert c.get("/v1/models", headers=right).status_code == 429
        assert c.get("/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code == 429  # keys: still waiting
