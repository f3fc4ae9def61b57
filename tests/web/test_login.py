"""The login page: a token in, an HttpOnly SameSite=Strict session cookie out; pages without it
send the browser there and back."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from manager.app import create_app
from manager.deps import SESSION_COOKIE

TOKEN = "a-long-enough-admin-token-" + "t" * 20
PAGE = {"Accept": "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8"}  # a browser's
OWN_PAGE = {"Origin": "http://testserver"}  # what a browser sends with a write from this manager's pages


@pytest.fixture
def guarded(settings):
    return settings.model_copy(update={"api_token": TOKEN})


@pytest.fixture
def c(guarded):
    with TestClient(create_app(guarded)) as client:
        yield client


def _log_in(client: TestClient, token: str = TOKEN, next_path: str = "/"):
    return client.post("/login", data={"token": token, "next": next_path}, follow_redirects=False)


def test_a_page_without_a_session_goes_to_the_login_page_and_back(c):
    resp = c.get("/models?x=1", headers=PAGE, follow_redirects=False)
    assert resp.status_code == 303 and resp.headers["location"] == "/login?next=/models%3Fx%3D1"
    form = c.get(resp.headers["location"])
    assert form.status_code == 200 and 'type="password"' in form.text
    assert 'name="next" value="/models?x=1"' in form.text
    back = _log_in(c, next_path="/models?x=1")
    assert back.status_code == 303 and back.headers["location"] == "/models?x=1"
    assert c.get("/models?x=1", headers=PAGE).status_code == 200


def test_fragments_scripts_and_streams_get_401_not_a_redirect(c):
    assert c.get("/ui/events", headers={**PAGE, "HX-Request": "true"}).status_code == 401
    assert c.get("/api/models").status_code == 401
    assert c.head("/api/metrics/stream", headers={"Accept": "text/event-stream"}).status_code == 401


def test_a_wrong_token_shows_the_form_again_with_what_was_wrong(c):
    resp = _log_in(c, token="not-the-token")
    assert resp.status_code == 401 and "not a valid API token" in resp.text
    assert "set-cookie" not in resp.headers
    empty = _log_in(c, token="")
    assert empty.status_code == 401 and "Enter the API token" in empty.text


def test_the_session_cookie_is_httponly_strict_and_not_the_token(c):
    resp = _log_in(c)
    cookie = resp.headers["set-cookie"]
    attributes = {part.strip().split("=")[0].lower(): part.strip() for part in cookie.split(";")[1:]}
    assert "httponly" in attributes and attributes["samesite"].lower() == "samesite=strict"
    assert attributes["path"] == "Path=/" and attributes["max-age"] == f"Max-Age={7 * 86400}"
    assert "secure" not in attributes  # plain http: a Secure cookie would never come back
    assert TOKEN not in cookie


def test_over_https_the_cookie_is_secure(guarded):
    with TestClient(create_app(guarded), base_url="https://testserver") as c:
        assert "Secure" in _log_in(c).headers["set-cookie"]


def test_a_session_opens_pages_reads_streams_and_dashboard_writes(c):
    _log_in(c)
    for path in ("/", "/models", "/plan", "/models/new", "/ui/events"):
        assert c.get(path, headers=PAGE).status_code == 200, path
    assert c.get("/api/models").status_code == 200
    with c.stream("GET", "/api/metrics/stream") as stream:
        assert stream.status_code == 200 and stream.headers["content-type"].startswith("text/event-stream")
    made = c.post("/ui/profiles/new", data={"name": "p", "kv_offload_gib": "8"}, headers=OWN_PAGE)
    assert made.headers["HX-Redirect"] == "/models"
    assert c.post("/api/profiles", json={"name": "q"}, headers=OWN_PAGE).status_code == 201
    # The cookie does not make a write from another site's page acceptable.
    cross = c.post("/api/profiles", json={"name": "r"}, headers={"Origin": "https://attacker.example"})
    assert cross.status_code == 403


def test_the_login_page_says_who_is_logged_in_and_logs_out(c):
    _log_in(c)
    page = c.get("/login")
    assert 'data-testid="signed-in"' in page.text and "UTC" in page.text
    out = c.post("/logout", follow_redirects=False)
    assert out.status_code == 303 and out.headers["location"] == "/login"
    assert "Max-Age=0" in out.headers["set-cookie"] or "expires=" in out.headers["set-cookie"].lower()
    assert c.get("/", headers=PAGE, follow_redirects=False).status_code == 303
    assert c.get("/api/models").status_code == 401


def test_logging_out_ends_the_session_on_the_manager_not_only_in_the_browser(c):
    _log_in(c)
    copied = c.cookies[SESSION_COOKIE]  # as someone who read the cookie off the machine before the logout
    assert c.post("/logout", headers=OWN_PAGE, follow_redirects=False).status_code == 303
    c.cookies.set(SESSION_COOKIE, copied)
    assert c.get("/api/models").status_code == 401
    assert c.post("/api/profiles", json={"name": "p"}, headers=OWN_PAGE).status_code == 401
    with c.stream("GET", "/api/metrics/stream") as stream:
        assert stream.status_code == 401
    assert c.get("/", headers=PAGE, follow_redirects=False).status_code == 303
    assert 'data-testid="signed-in"' not in c.get("/login").text


def test_sessions_survive_a_restart_and_end_when_the_token_changes(settings, guarded):
    with TestClient(create_app(guarded)) as c:
        _log_in(c)
        cookies = dict(c.cookies)
    with TestClient(create_app(guarded), cookies=cookies) as c:
        assert c.get("/api/models").status_code == 200
    rotated = settings.model_copy(update={"api_token": "a-new-token-after-rotation-" + "n" * 20})
    with TestClient(create_app(rotated), cookies=cookies) as c:
        assert c.get("/api/models").status_code == 401


@pytest.mark.parametrize(
    "asked", ["//attacker.example/x", "https://attacker.example/", "/\\attacker.example", "javascript:alert(1)",
              "/login", "/x\r\nSet-Cookie: a=b", "models"],
)  # fmt: skip
def test_after_login_the_browser_only_goes_to_a_page_of_this_manager(c, asked):
    assert 'name="next" value="/"' in c.get("/login", params={"next": asked}).text
    assert _log_in(c, next_path=asked).headers["location"] == "/"


def test_without_a_token_there_is_nothing_to_log_in_to(client):
    assert "no API token" in client.get("/login").text
    resp = client.post("/login", data={"token": "anything", "next": "/models"}, follow_redirects=False)
    assert resp.status_code == 303 and resp.headers["location"] == "/models"
    assert "set-cookie" not in resp.headers


def test_with_open_reads_pages_show_without_login_and_changes_still_need_it(guarded):
    with TestClient(create_app(guarded.model_copy(update={"open_reads": True}))) as c:
        assert c.get("/", headers=PAGE, follow_redirects=False).status_code == 200
        assert c.post("/ui/profiles/new", data={"name": "p"}, headers=OWN_PAGE).status_code == 401
        _log_in(c)
        assert c.post("/ui/profiles/new", data={"name": "p"}, headers=OWN_PAGE).headers["HX-Redirect"] == "/models"


@pytest.mark.browser
def test_in_the_browser_login_opens_the_live_overview_and_logout_closes_it(live_manager, page, shot):
    from manager.db import make_engine, session
    from manager.services import tokens

    engine = make_engine(live_manager.data_dir / "manager.db")
    with session(engine) as db:
        token = tokens.create_token(db)
    engine.dispose()
    page.goto(live_manager.url + "/")
    page.wait_for_url("**/login?next=/")
    page.fill("#token", "not-the-token")
    page.click("form.login-form button[type=submit]")
    assert "not a valid API token" in page.inner_text("[data-testid=login-error]")
    shot(page, "wrong-token")
    page.fill("#token", token)
    page.click("form.login-form button[type=submit]")
    page.wait_for_url(live_manager.url + "/")
    # The live stream is a GET behind the token too: the browser's EventSource brings the cookie.
    page.wait_for_function("document.body.dataset.live === 'fresh'", timeout=10_000)
    assert page.evaluate("document.cookie") == ""  # HttpOnly: no script sees the session
    shot(page, "live-after-login")
    page.click("a.account")
    page.click("[data-testid=log-out]")
    page.wait_for_url("**/login")
    page.goto(live_manager.url + "/models")
    page.wait_for_url("**/login?next=/models")
    assert page.js_errors == []
