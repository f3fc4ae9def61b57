"""Inference keys and usage through the REST API: shown once, stored hashed, revoked; usage reports."""

from __future__ import annotations

import importlib.util
from datetime import UTC, datetime, timedelta
from pathlib import Path

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.operations import Operations
from sqlalchemy import MetaData, create_engine
from sqlmodel import select

from manager.db import make_engine, migrate, session
from manager.schemas.inference_key import InferenceKey
from manager.schemas.usage import NO_KEY, UsageMinute
from manager.services import usage

MIGRATION = Path(__file__).resolve().parents[2] / "manager/migrations/versions/0005_inference_keys.py"


def test_a_key_is_shown_once_and_never_listed_or_stored(client, settings):
    client.post("/api/models", json={"name": "a", "model": "org/a"})
    made = client.post("/api/keys", json={"name": "app", "models": ["a"]})
    assert made.status_code == 201, made.text
    body = made.json()
    secret = body["key"]
    assert secret.startswith("vmk_") and len(secret) > 40
    assert body["prefix"] == secret[:12] and body["models"] == ["a"] and body["active"] is True
    listed = client.get("/api/keys")
    assert [k["name"] for k in listed.json()] == ["app"]
    assert secret not in listed.text and secret[12:20] not in listed.text
    raw = b"".join(f.read_bytes() for f in settings.data_dir.glob("manager.db*"))
    assert secret.encode() not in raw and secret[12:].encode() not in raw


def test_what_a_key_may_be_is_checked(client):
    client.post("/api/models", json={"name": "a", "model": "org/a"})
    bad = client.post("/api/keys", json={"name": "Not A Slug", "models": ["a", "a"]})
    assert bad.status_code == 422
    fields = {e["loc"][-1]: e["msg"] for e in bad.json()["errors"]}
    assert "slug" in fields["name"] and "models repeat: a" in fields["models"]
    unknown = client.post("/api/keys", json={"name": "app", "models": ["a", "gpt-4"]})
    assert unknown.status_code == 422
    assert (
        "no model config named 'gpt-4'" in unknown.json()["detail"] and "Model configs: a" in unknown.json()["detail"]
    )
    assert client.post("/api/keys", json={"name": "app"}).status_code == 201
    again = client.post("/api/keys", json={"name": "app"})
    assert again.status_code == 409 and "revoke it first" in again.json()["detail"]
    assert client.delete("/api/keys/nobody").status_code == 404
    assert client.delete("/api/keys/app").status_code == 204
    assert client.delete("/api/keys/app").status_code == 404  # revoked already
    assert [k["active"] for k in client.get("/api/keys").json()] == [False]


def test_a_key_takes_limits_checked_and_changed_later(client):
    later = (datetime.now(UTC) + timedelta(days=30)).replace(microsecond=0)
    limits = {
        "rpm": 60,
        "tpm": 100000,
        "max_concurrent": 4,
        "token_budget": 1000000,
        "budget_period": "day",
        "expires_at": later.isoformat(),
        "priority": "batch",
    }
    made = client.post("/api/keys", json={"name": "app", **limits})
    assert made.status_code == 201, made.text
    shown = {k: made.json()[k] for k in limits}
    assert shown == {**limits, "expires_at": later.isoformat().replace("+00:00", "Z")}
    listed = client.get("/api/keys").json()[0]
    assert (listed["rpm"], listed["priority"], listed["expired"]) == (60, "batch", False)

    changed = client.patch("/api/keys/app", json={"rpm": None, "tpm": 5})
    assert changed.status_code == 200, changed.text
    # Only what was sent changes.
    assert (changed.json()["rpm"], changed.json()["tpm"], changed.json()["max_concurrent"]) == (None, 5, 4)
    assert client.patch("/api/keys/nobody", json={"rpm": 1}).status_code == 404


def test_what_limits_a_key_may_have_is_checked(client):
    for bad, field in (
        ({"rpm": 0}, "rpm"),
        ({"tpm": -5}, "tpm"),
        ({"max_concurrent": 10**9}, "max_concurrent"),
        ({"token_budget": True}, "token_budget"),
        ({"rpm": "many"}, "rpm"),
        ({"budget_period": "week"}, "budget_period"),
        ({"priority": "urgent"}, "priority"),
        ({"expires_at": "2020-01-01T00:00:00Z"}, "expires_at"),
        ({"expires_at": "next tuesday"}, "expires_at"),
    ):
        refused = client.post("/api/keys", json={"name": "app", **bad})
        assert refused.status_code == 422, (bad, refused.text)
        assert field in {e["loc"][-1] for e in refused.json()["errors"]}, (bad, refused.text)
    past = client.post("/api/keys", json={"name": "app", "expires_at": "2020-01-01T00:00:00Z"})
    assert "has passed" in past.text
    typo = client.post("/api/keys", json={"name": "app", "rpn": 5})
    assert typo.status_code == 422 and "did you mean rpm?" in typo.text
    client.post("/api/keys", json={"name": "app"})
    assert "did you mean max_concurrent?" in client.patch("/api/keys/app", json={"max_concurent": 2}).text
    assert client.patch("/api/keys/app", json={"rpm": 0}).status_code == 422
    assert client.get("/api/keys").json()[0]["rpm"] is None


def test_usage_reports_are_bounded_and_say_why(client):
    empty = client.get("/api/usage")
    assert empty.status_code == 200
    body = empty.json()
    assert body["per"] == "hour" and body["rows"] == [] and body["total"]["requests"] == 0
    long = client.get("/api/usage", params={"per": "minute", "since": "2026-01-01T00:00:00Z", "until": "2026-01-03"})
    assert long.status_code == 422 and "at most 1 day" in long.json()["detail"] and "per=hour" in long.json()["detail"]
    backwards = client.get("/api/usage", params={"since": "2026-01-02", "until": "2026-01-01"})
    assert backwards.status_code == 422 and "must be before" in backwards.json()["detail"]
    assert client.get("/api/usage", params={"per": "week"}).status_code == 422
    assert client.get("/api/usage", params={"until": "0001-01-01T00:00:00"}).status_code == 422
    nobody = client.get("/api/usage", params={"key": "nobody"})
    assert nobody.status_code == 404 and "'-' for requests without a key" in nobody.json()["detail"]


def test_usage_sums_per_hour_and_day_within_the_range(settings):
    settings.ensure_dirs()
    engine = make_engine(settings.db_path)
    migrate(engine)
    day = datetime(2026, 3, 1, tzinfo=UTC)
    start = int(day.timestamp())

    def counts(requests: int, prompt: int = 0, completion: int = 0) -> usage.Counts:
        return usage.Counts(requests, 0, prompt, completion)

    with session(engine) as db:
        key = InferenceKey(name="app", sha256="0" * 64, prefix="vmk_abcdefgh", models=[])
        db.add(key)
        db.commit()
        assert key.id is not None
        usage.add(
            db,
            [
                usage.Row(start + 60, key.id, "a", counts(1, 10, 5)),
                usage.Row(start + 1800, key.id, "a", counts(2, 20, 10)),
                usage.Row(start + 3600 + 60, key.id, "a", counts(1, 1, 1)),
                usage.Row(start + 120, NO_KEY, "b", counts(4)),
                usage.Row(start - 60, key.id, "a", counts(100)),  # before the range
            ],
        )
        db.commit()
        hourly = usage.report(db, since=day, until=day + timedelta(hours=2), per="hour")
        assert [(r.start, r.key, r.model, r.requests, r.prompt_tokens) for r in hourly.rows] == [
            (day, None, "b", 4, 0),
            (day, "app", "a", 3, 30),
            (day + timedelta(hours=1), "app", "a", 1, 1),
        ]
        assert [(t.key, t.model, t.requests, t.completion_tokens) for t in hourly.totals] == [
            (None, "b", 4, 0),
            ("app", "a", 4, 16),
        ]
        assert hourly.total.requests == 8
        daily = usage.report(db, since=day, until=day + timedelta(days=1), per="day", key="app")
        assert [(r.start, r.requests) for r in daily.rows] == [(day, 4)]
        no_key = usage.report(db, since=day, until=day + timedelta(days=1), per="day", key="-")
        assert [(r.model, r.requests) for r in no_key.rows] == [("b", 4)]


def test_migration_creates_exactly_the_key_and_usage_tables(tmp_path):
    spec = importlib.util.spec_from_file_location("m0005", MIGRATION)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert (module.revision, module.down_revision) == ("0005_inference_keys", "0004_front_door_fields")
    engine = create_engine(f"sqlite:///{tmp_path / 'mig.db'}")
    with engine.begin() as conn:
        with Operations.context(MigrationContext.configure(conn)):
            module.upgrade()
            _limits_migration().upgrade()  # and the keys' limits, later
        model = MetaData()
        InferenceKey.__table__.to_metadata(model)
        UsageMinute.__table__.to_metadata(model)
        assert compare_metadata(MigrationContext.configure(conn), model) == []


def _limits_migration():
    spec = importlib.util.spec_from_file_location("m0012", MIGRATION.with_name("0012_key_limits.py"))
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert (module.revision, module.down_revision) == ("0012_key_limits", "0011_replicas")
    return module


def test_migration_0012_gives_stored_keys_no_limits(tmp_path):
    engine = make_engine(tmp_path / "store.db")
    migrate(engine)
    with session(engine) as db:
        db.add(InferenceKey(name="old", sha256="x" * 64, prefix="vmk_abcdefgh"))
        db.commit()
    with engine.begin() as conn, Operations.context(MigrationContext.configure(conn)):
        _limits_migration().downgrade()
        _limits_migration().upgrade()
    with session(engine) as db:
        key = db.exec(select(InferenceKey)).one()
        assert (key.rpm, key.tpm, key.max_concurrent, key.token_budget, key.expires_at) == (None,) * 5
        assert (key.budget_period, key.priority) == ("month", "interactive")


def test_migration_0009_creates_exactly_the_session_and_v1_access_tables(tmp_path):
    from manager.schemas.browser_session import BrowserSession
    from manager.schemas.inference_key import InferenceAccess

    path = MIGRATION.with_name("0009_browser_sessions.py")
    spec = importlib.util.spec_from_file_location("m0009", path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert (module.revision, module.down_revision) == ("0009_browser_sessions", "0008_routing_names")
    engine = create_engine(f"sqlite:///{tmp_path / 'mig.db'}")
    with engine.begin() as conn:
        with Operations.context(MigrationContext.configure(conn)):
            module.upgrade()
        model = MetaData()
        BrowserSession.__table__.to_metadata(model)
        InferenceAccess.__table__.to_metadata(model)
        assert compare_metadata(MigrationContext.configure(conn), model) == []
        # Ids are never given again: a listed id names one session only.
        assert (
            "AUTOINCREMENT"
            in conn.exec_driver_sql("SELECT sql FROM sqlite_master WHERE name='browser_session'").scalar()
        )
