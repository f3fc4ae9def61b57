"""Every change asked of the manager over HTTP leaves exactly one audit row naming its route, whatever
came of it; reads and inference leave none; logging in and out are recorded with the session they made or ended."""

from __future__ import annotations

import html
import re

from fastapi.routing import APIRoute
from fastapi.testclient import TestClient
from sqlalchemy import text

from manager.app import create_app
from manager.db import session
from manager.deps import SESSION_COOKIE, InferenceRoute
from manager.services import tokens
from tests.api.test_openapi_contract import TOKEN, _settings
from tests.audit.conftest import BEARER, audit_rows

WRITES = ("post", "put", "patch", "delete")


def _filled(path: str, parameters: list[dict]) -> str:
    """The path with each parameter given a value of its type (an id or a name nothing has)."""
    kinds = {p["name"]: p.get("schema", {}).get("type") for p in parameters if p.get("in") == "path"}
    return re.sub(r"\{(\w+)(:\w+)?\}", lambda m: "7" if kinds.get(m.group(1)) == "integer" else "nothing-here", path)


def _one_new_row(client, before: int, method: str, template: str, status: int) -> dict:
    rows = audit_rows(client)[before:]
    assert len(rows) == 1, f"{method} {template} left {len(rows)} audit rows: {rows}"
    row = rows[0]
    assert (row["method"], row["route"], row["status"]) == (method, template, status), row
    return row


def test_every_write_route_of_the_api_leaves_one_row_naming_it(client):
    schema = client.get("/openapi.json", headers=BEARER).json()
    called = 0
    for template, operations in schema["paths"].items():
        if not template.startswith("/api/"):
            continue
        for method, operation in operations.items():
            if method not in WRITES:
                continue
            before = len(audit_rows(client))
            url = _filled(template, operation.get("parameters", []))
            body = {"json": {}} if "requestBody" in operation else {}  # mostly not what the route takes: a 4xx
            answer = client.request(method.upper(), url, headers=BEARER, **body)
            assert answer.status_code < 500, (method, url, answer.text)
            row = _one_new_row(client, before, method.upper(), template, answer.status_code)
            assert row["who"] == "env-token" and row["token"] == "env-token" and row["address"] == "testclient"
            assert row["action"] and "{" not in row["action"]
            if answer.status_code >= 400:
                assert row["message"] == answer.json()["detail"]
            called += 1
    assert called >= 30  # the walk found the API's write routes (32 when this was written)


def test_every_form_post_of_the_dashboard_leaves_one_row_naming_it(client):
    forms = [
        route
        for route in client.app.routes
        if isinstance(route, APIRoute) and not route.include_in_schema and not isinstance(route, InferenceRoute)
        and route.methods & {"POST", "PUT", "PATCH", "DELETE"}
    ]  # fmt: skip
    for route in forms:
        before = len(audit_rows(client))
        url = _filled(route.path, [])
        answer = client.post(url, data={}, headers=BEARER, follow_redirects=False)
        (row,) = audit_rows(client)[before:]
        assert (row["method"], row["route"]) == ("POST", route.path_format), row
        if row["status"] != answer.status_code:  # a refusal shown on the page, which htmx needs answered 200
            assert answer.status_code == 200 and row["status"] >= 400, (route.path, row)
            assert _shown(row["message"], answer.text), (route.path, row["message"])
    assert len(forms) >= 15 and {"/login", "/logout", "/ui/keys"} <= {r.path for r in forms}


def _shown(message: str, page: str) -> bool:
    """The message, or the part after the field it names, is on the page."""
    text = html.unescape(page)
    return message in text or message.split(": ", 1)[-1] in text


def test_a_change_a_page_refuses_is_recorded_as_refused_with_the_reason_it_shows(client):
    """The dashboard's forms answer a refusal 200 with the reason on the page (htmx swaps only those): the
    audit log still says it failed, with the status the API gives the same refusal, and why."""
    made = client.post("/ui/keys", data={"name": "team-a"}, headers=BEARER)
    assert made.status_code == 200 and audit_rows(client)[-1]["status"] == 200
    again = client.post("/ui/keys", data={"name": "team-a"}, headers=BEARER)
    assert again.status_code == 200
    row = audit_rows(client)[-1]
    assert row["status"] == 409 and _shown(row["message"], again.text) and "team-a" in row["message"]
    bad = client.post("/ui/keys", data={"name": "team a!", "rpm": "-3"}, headers=BEARER)
    assert bad.status_code == 200
    row = audit_rows(client)[-1]
    assert row["status"] == 422 and _shown(row["message"], bad.text)
    failed = client.get("/api/audit", params={"outcome": "failed"}, headers=BEARER).json()
    assert [e["status"] for e in failed["entries"]][:2] == [422, 409]


def test_reads_leave_no_row_and_refusals_are_recorded_with_their_outcome(client):
    client.get("/api/models", headers=BEARER)
    client.get("/", headers=BEARER)
    # Inference is not an admin change: /v1 leaves no row, answered or refused.
    client.post("/v1/chat/completions", json={"model": "none", "messages": []}, headers=BEARER)
    client.post("/v1/not-a-path", json={})
    assert audit_rows(client) == []
    refused = client.post("/api/models", json={"name": "a", "model": "org/a"})  # no token
    assert refused.status_code == 401
    (row,) = audit_rows(client)
    assert row["who"] == "unauthenticated" and row["token"] is None and row["status"] == 401
    assert row["action"] == "models.create" and row["target"] == "a" and "Bearer" in row["message"]
    wrong = client.delete("/api/models/a", headers={"Authorization": "Bearer not-the-token-" + "x" * 30})
    assert wrong.status_code == 401 and audit_rows(client)[-1]["message"] == "the bearer token is not valid"


def test_writes_refused_before_routing_are_recorded_with_the_path_asked_for(client):
    """A host name the manager does not answer to (DNS rebinding) and a body over the limit are refused
    before any route runs: the log still has them, as refusals of the path asked for."""
    rebound = client.post("/api/models", json={"name": "a"}, headers={**BEARER, "Host": "attacker.example"})
    assert rebound.status_code == 400
    too_big = client.post(
        "/api/models",
        content=b"{}",
        headers={**BEARER, "Content-Type": "application/json", "Content-Length": str(1 << 40)},
    )
    assert too_big.status_code == 413
    client.get("/api/models", headers={"Host": "attacker.example"})  # a read: no row
    client.post("/v1/completions", json={}, headers={"Host": "attacker.example"})  # inference: no row
    rows = audit_rows(client)
    assert [(r["method"], r["route"], r["action"], r["status"], r["who"]) for r in rows] == [
        ("POST", "/api/models", "request.refused", 400, "unauthenticated"),
        ("POST", "/api/models", "request.refused", 413, "unauthenticated"),
    ]
    assert "attacker.example" in rows[0]["message"] and "larger than" in rows[1]["message"]
    assert rows[0]["fields"] == "[]"  # a refused body is not read


def test_a_stored_token_is_named_by_its_id_and_name(client):
    with session(client.app.state.runtime.engine) as db:
        secret = tokens.create_token(db, "ci")
        stored = tokens.list_tokens(db)[0]
    client.post("/api/models", json={"name": "a", "model": "org/a"}, headers={"Authorization": f"Bearer {secret}"})
    row = audit_rows(client)[-1]
    assert (row["who"], row["token"], row["token_name"], row["status"]) == (
        f"token:{stored.id}",
        f"token:{stored.id}",
        "ci",
        201,
    )
    assert secret not in str(row) and secret[4:12] not in str(row)


def test_logging_in_and_out_are_recorded_with_the_session(client):
    wrong = client.post("/login", data={"token": "vmt_" + "w" * 40}, follow_redirects=False)
    assert wrong.status_code == 401
    row = audit_rows(client)[-1]
    assert (row["route"], row["action"], row["who"], row["status"]) == ("/login", "login", "unauthenticated", 401)
    assert row["message"] == "the token entered is not a valid API token" and row["fields"] == '["token"]'
    made = client.post("/login", data={"token": TOKEN, "next": "/"}, follow_redirects=False)
    assert made.status_code == 303
    session_id = client.cookies[SESSION_COOKIE].split(".")[0]
    row = audit_rows(client)[-1]
    assert (row["action"], row["who"], row["token"], row["status"]) == (
        "login",
        f"session:{session_id}",
        "env-token",
        303,
    )
    # A change made with the session names it too.
    client.delete("/api/models/none", headers={"Origin": "http://testserver"})
    assert audit_rows(client)[-1]["who"] == f"session:{session_id}"
    out = client.post("/logout", follow_redirects=False)
    assert out.status_code == 303
    row = audit_rows(client)[-1]
    assert (row["route"], row["action"], row["who"], row["status"]) == (
        "/logout",
        "logout",
        f"session:{session_id}",
        303,
    )
    assert TOKEN not in str(audit_rows(client))


def test_without_a_token_configured_changes_are_anonymous(tmp_path, quiet_machine):
    with TestClient(create_app(_settings(tmp_path, None))) as open_client:
        open_client.post("/api/models", json={"name": "a", "model": "org/a"})
        (row,) = audit_rows(open_client)
    assert (row["who"], row["status"], row["target"]) == ("anonymous", 201, "a")


def test_a_row_that_cannot_be_written_is_logged_and_the_request_answered(client, caplog):
    with session(client.app.state.runtime.engine) as db:
        db.execute(text("DROP TABLE audit_entry"))
        db.commit()
    made = client.post("/api/models", json={"name": "a", "model": "org/a"}, headers=BEARER)
    assert made.status_code == 201
    assert "the audit row of POST /api/models could not be written" in caplog.text
