"""Tokens: once one exists, every change needs it; reads stay open."""

from __future__ import annotations

from fastapi.testclient import TestClient

from manager.app import create_app
from manager.db import make_engine, migrate, session
from manager.services import tokens


def _make_token(settings) -> str:
    settings.ensure_dirs()
    engine = make_engine(settings.db_path)
    migrate(engine)
    with session(engine) as db:
        return tokens.create_token(db)


def test_no_token_configured_means_open(client):
    assert client.post("/api/profiles", json={"name": "p"}).status_code == 201


def test_stored_token_guards_changes(settings):
    token = _make_token(settings)
    with TestClient(create_app(settings)) as c:
        denied = c.post("/api/profiles", json={"name": "p"})
        assert denied.status_code == 401 and "Bearer" in denied.json()["detail"]
        wrong = c.post("/api/profiles", json={"name": "p"}, headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401
        assert c.delete("/api/models/x").status_code == 401
        assert c.get("/api/profiles").status_code == 200  # reads stay open
        ok = c.post("/api/profiles", json={"name": "p"}, headers={"Authorization": f"Bearer {token}"})
        assert ok.status_code == 201


def test_env_token(settings):
    guarded = settings.model_copy(update={"api_token": "s3cret-token"})
    with TestClient(create_app(guarded)) as c:
        assert c.post("/api/profiles", json={"name": "p"}).status_code == 401
        ok = c.post("/api/profiles", json={"name": "p"}, headers={"Authorization": "Bearer s3cret-token"})
        assert ok.status_code == 201


def test_only_the_hash_is_stored(settings):
    token = _make_token(settings)
    raw = b"".join(f.read_bytes() for f in settings.data_dir.glob("manager.db*"))
    assert token.encode() not in raw
