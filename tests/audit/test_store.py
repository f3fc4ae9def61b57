"""The audit table: its migration makes the table the code writes; /api/audit filters it; rows past the
retention go when the manager starts and every day after."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from fastapi.testclient import TestClient
from sqlalchemy import MetaData

from manager.app import create_app
from manager.audit.retention import AuditRetention
from manager.db import make_engine, migrate, session
from manager.schemas.audit import AuditEntry
from manager.settings import Settings
from tests.api.test_openapi_contract import TOKEN, _settings
from tests.audit.conftest import BEARER, audit_rows


def _row(
    at: datetime, who: str = "token:1", action: str = "models.create", status: int = 201, token: str | None = None
) -> AuditEntry:
    return AuditEntry(
        at=at, who=who, token=token or who, address="10.0.0.9", method="POST", route="/api/models", action=action,
        target="a", status=status,
    )  # fmt: skip


def test_the_migration_makes_the_table_the_code_writes(tmp_path):
    engine = make_engine(tmp_path / "manager.db")
    migrate(engine)
    wanted = MetaData()
    AuditEntry.__table__.to_metadata(wanted)
    with engine.connect() as conn:
        diffs = [d for d in compare_metadata(MigrationContext.configure(conn), wanted) if "audit_entry" in repr(d)]
    assert diffs == [], diffs
    engine.dispose()


def test_rows_older_than_the_retention_go_at_start_and_every_day(tmp_path):
    now = datetime.now(UTC)
    settings = Settings(data_dir=tmp_path / "data", api_token=None, audit_retention_days=30)
    settings.ensure_dirs()
    engine = make_engine(settings.db_path)
    migrate(engine)
    with session(engine) as db:
        for days in (100, 31, 29, 1):
            db.add(_row(now - timedelta(days=days), who=f"token:{days}"))
        db.commit()
    engine.dispose()
    with TestClient(create_app(settings)) as client:
        assert [r["who"] for r in audit_rows(client)] == ["token:29", "token:1"]
        # A day later (the task's clock), the next pass takes what has aged past 30 days meanwhile.
        retention = AuditRetention(client.app.state.runtime.engine, 30, clock=lambda: now + timedelta(days=1.5))
        assert retention.prune() == 1
        assert [r["who"] for r in audit_rows(client)] == ["token:1"]


def test_the_api_filters_and_bounds_what_it_sends(client):
    now = datetime.now(UTC)
    with session(client.app.state.runtime.engine) as db:
        db.add(_row(now - timedelta(hours=5), who="token:1", action="models.create"))
        # A session made with token:1: asking for the token finds its changes too.
        db.add(_row(now - timedelta(hours=3), who="session:4", action="workers.stop", status=404, token="token:1"))
        db.add(_row(now - timedelta(hours=1), who="cli:root", action="tokens.rotate"))
        db.commit()

    def who(**params) -> list[str]:
        answer = client.get("/api/audit", params=params, headers=BEARER)
        assert answer.status_code == 200, answer.text
        return [e["who"] for e in answer.json()["entries"]]

    assert who() == ["cli:root", "session:4", "token:1"]
    assert who(who="token:1") == ["session:4", "token:1"]
    assert who(who="session") == ["session:4"] and who(who="cli") == ["cli:root"]
    assert who(action="workers") == ["session:4"] and who(action="workers.stop") == ["session:4"]
    assert who(outcome="failed") == ["session:4"] and who(outcome="ok") == ["cli:root", "token:1"]
    assert who(since=(now - timedelta(hours=4)).isoformat(), until=(now - timedelta(hours=2)).isoformat()) == [
        "session:4"
    ]
    limited = client.get("/api/audit", params={"limit": 1}, headers=BEARER).json()
    assert [e["who"] for e in limited["entries"]] == ["cli:root"] and limited["more"] is True
    too_many = client.get("/api/audit", params={"limit": 5000}, headers=BEARER)
    assert too_many.status_code == 422 and "limit" in too_many.json()["detail"]
    backwards = client.get(
        "/api/audit", params={"since": now.isoformat(), "until": "2020-01-01T00:00:00Z"}, headers=BEARER
    )
    assert backwards.status_code == 422 and "since must be before until" in backwards.json()["detail"]
    assert client.get("/api/audit").status_code == 401  # it needs the token


def test_reading_the_log_needs_the_token_even_where_reads_are_open(tmp_path, quiet_machine):
    settings = _settings(tmp_path, TOKEN).model_copy(update={"open_reads": True})
    with TestClient(create_app(settings)) as client:
        assert client.get("/api/models").status_code == 200  # reads are open
        refused = client.get("/api/audit")
        assert refused.status_code == 401 and "Bearer" in refused.json()["detail"]
        page = client.get("/audit", headers={"Accept": "text/html"}, follow_redirects=False)
        assert page.status_code == 303 and page.headers["location"] == "/login?next=/audit"
        assert client.get("/audit", headers=BEARER).status_code == 200
        schema = client.get("/openapi.json").json()["paths"]["/api/audit"]["get"]
        assert schema["security"] == [{"bearer": []}] and {"401", "422"} <= set(schema["responses"])
