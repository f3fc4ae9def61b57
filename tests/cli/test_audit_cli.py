"""`vllm-manager audit`: the audit log from the store, as a table or JSON, with the API's filters."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

from typer.testing import CliRunner

from manager.cli import app
from manager.db import make_engine, migrate, session
from manager.schemas.audit import AuditEntry
from manager.settings import Settings


def _audit(data, *args: str):
    return CliRunner().invoke(app, ["audit", *args, "--data-dir", str(data)])


def _store(data) -> None:
    settings = Settings(data_dir=data, api_token=None)
    settings.ensure_dirs()
    engine = make_engine(settings.db_path)
    migrate(engine)
    now = datetime.now(UTC)
    with session(engine) as db:
        db.add(AuditEntry(
            at=now - timedelta(hours=2), who="token:1", token="token:1", token_name="ci", address="10.0.0.9",
            method="PUT", route="/api/models/{name}", action="models.update", target="qwen", fields=["env"],
            status=200,
        ))  # fmt: skip
        db.add(AuditEntry(
            at=now - timedelta(minutes=5), who="session:3", token="token:1", address="10.0.0.7", method="POST",
            route="/api/workers/{worker_id}/stop", action="workers.stop", target="4", status=404,
            message="no worker with id 4",
        ))  # fmt: skip
        db.commit()
    engine.dispose()


def test_audit_shows_rows_newest_first_and_filters_them(tmp_path):
    data = tmp_path / "data"
    _store(data)
    shown = _audit(data)
    assert shown.exit_code == 0, shown.output
    lines = shown.stdout.splitlines()
    assert "who" in lines[0] and "action" in lines[0]
    assert "session:3 (token:1)" in lines[1] and "workers.stop" in lines[1] and "404" in lines[1]
    assert "no worker with id 4" in lines[1]
    assert "token:1" in lines[2] and "models.update" in lines[2] and "qwen" in lines[2] and "10.0.0.9" in lines[2]
    failed = _audit(data, "--outcome", "failed", "--json")
    assert [e["action"] for e in json.loads(failed.stdout)["entries"]] == ["workers.stop"]
    recent = _audit(data, "--since", "1h", "--json")
    assert [e["who"] for e in json.loads(recent.stdout)["entries"]] == ["session:3"]
    by_action = json.loads(_audit(data, "--action", "models", "--json").stdout)["entries"]
    assert [(e["target"], e["fields"], e["token_name"]) for e in by_action] == [("qwen", ["env"], "ci")]
    assert len(json.loads(_audit(data, "--who", "token:1", "--json").stdout)["entries"]) == 2
    none = _audit(data, "--who", "cli")
    assert none.exit_code == 0 and "No audit rows match." in none.stderr
    more = _audit(data, "--limit", "1")
    assert len(more.stdout.splitlines()) == 2 and "More rows match" in more.stderr


def test_audit_explains_what_it_cannot_read(tmp_path):
    data = tmp_path / "data"
    _store(data)
    garbled = _audit(data, "--since", "yesterday")
    assert garbled.exit_code == 1 and "--since takes 30m, 6h, 7d or an ISO date" in garbled.stderr
    assert "outcome must be ok or failed" in _audit(data, "--outcome", "maybe").stderr
    assert "limit must be between 1 and 1000" in _audit(data, "--limit", "0").stderr
    missing = _audit(tmp_path / "elsewhere")
    assert missing.exit_code == 2 and "no manager data" in missing.stderr


def test_the_clis_changes_to_the_store_leave_audit_rows_done_or_refused(tmp_path):
    data = tmp_path / "data"
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    config = tmp_path / "qwen.json"
    config.write_text(json.dumps({"name": "qwen", "model": str(model)}))

    def cli(*args: str):
        return CliRunner().invoke(app, [*args, "--data-dir", str(data)])

    assert cli("models", "add", str(config)).exit_code == 0
    assert cli("models", "set", "qwen", "max_model_len=4096").exit_code == 0
    assert cli("keys", "create", "team-a").exit_code == 0
    assert cli("keys", "set", "team-a", "--rpm", "60").exit_code == 0
    refused = cli("models", "rm", "nope")
    assert refused.exit_code == 1
    assert cli("models", "rm", "qwen").exit_code == 0
    entries = json.loads(_audit(data, "--json").stdout)["entries"][::-1]
    assert [(e["route"], e["action"], e["target"], e["status"]) for e in entries] == [
        ("vllm-manager models add", "models.create", "qwen", 200),
        ("vllm-manager models set", "models.update", "qwen", 200),
        ("vllm-manager keys create", "keys.create", "team-a", 200),
        ("vllm-manager keys set", "keys.update", "team-a", 200),
        ("vllm-manager models rm", "models.delete", "nope", 404),
        ("vllm-manager models rm", "models.delete", "qwen", 200),
    ]
    assert all(e["who"].startswith("cli:") and e["address"] == "local" for e in entries)
    assert entries[1]["changed"] == ["max_model_len"] and entries[3]["changed"] == ["rpm"]
    assert "nope" in entries[4]["message"]
    created_key = cli("keys", "list")
    assert "vmk_" not in json.dumps(entries) and created_key.exit_code == 0
