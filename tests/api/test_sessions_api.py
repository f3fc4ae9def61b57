"""Browser sessions through the REST API: the admin sees who is logged in and ends sessions."""

from __future__ import annotations

from fastapi.testclient import TestClient

from manager.app import create_app
from manager.deps import SESSION_COOKIE

TOKEN = "an-admin-token-long-enough-" + "s" * 20
ADMIN = {"Authorization": f"Bearer {TOKEN}"}


def test_the_admin_sees_and_ends_browser_sessions(settings):
    with TestClient(create_app(settings.model_copy(update={"api_token": TOKEN}))) as c:
        cookies = []
        for agent in ("Firefox/140", "Chrome/138"):
            c.cookies.clear()
            c.post("/login", data={"token": TOKEN}, headers={"User-Agent": agent}, follow_redirects=False)
            cookies.append(c.cookies[SESSION_COOKIE])
        c.cookies.clear()
        listed = c.get("/api/sessions", headers=ADMIN)
        assert listed.status_code == 200
        sessions = listed.json()
        assert [s["user_agent"] for s in sessions] == ["Chrome/138", "Firefox/140"]
        assert {s["token"] for s in sessions} == {"VLLM_MANAGER_API_TOKEN"}
        assert all(s["client_address"] == "testclient" for s in sessions)
        assert not any(value.partition(".")[2] in listed.text for value in cookies)
        assert c.get("/api/sessions").status_code == 401  # the admin's alone

        assert c.delete(f"/api/sessions/{sessions[0]['id']}", headers=ADMIN).status_code == 204
        c.cookies.set(SESSION_COOKIE, cookies[1])
        assert c.get("/api/models").status_code == 401
        c.cookies.set(SESSION_COOKIE, cookies[0])
        assert c.get("/api/models").status_code == 200
        gone = c.delete(f"/api/sessions/{sessions[0]['id']}", headers=ADMIN)
        assert gone.status_code == 404 and "no browser session" in gone.json()["detail"]
        assert c.delete("/api/sessions/0", headers=ADMIN).status_code == 422
        assert c.delete("/api/sessions", headers=ADMIN).json() == {"ended": 1}
        assert c.get("/api/models").status_code == 401
