"""The Keys and Usage pages through the real app: a key shown once, revoked; usage in tables."""

from __future__ import annotations

import re

from manager.db import session
from manager.frontdoor.metering import Tokens
from manager.services import usage


def test_the_nav_links_both_pages(client):
    page = client.get("/keys")
    assert page.status_code == 200
    assert '<a href="/keys" aria-current="page">Keys</a>' in page.text and 'href="/usage"' in page.text


def test_a_key_made_on_the_page_is_shown_once_then_only_its_start(client):
    client.post("/api/models", json={"name": "a", "model": "org/a"})
    client.post("/api/models", json={"name": "b", "model": "org/b"})
    form = client.get("/ui/keys/form")
    assert 'value="a"' in form.text and 'value="b"' in form.text
    made = client.post("/ui/keys", data={"name": "app", "models": ["a"]})
    assert made.headers["cache-control"] == "no-store" and made.headers["hx-trigger"] == "keys-changed"
    secret = re.search(r'data-testid="new-key-secret">(vmk_[^<]+)<', made.text)
    assert secret and "for a." in made.text
    listing = client.get("/ui/keys/list").text
    assert "app" in listing and secret.group(1)[:12] in listing and secret.group(1) not in listing
    assert secret.group(1) not in client.get("/ui/keys/form").text
    revoked = client.post("/ui/keys/app/revoke")
    assert "Revoked app" in revoked.text and "revoked 20" in revoked.text
    assert "no active inference key named &#39;app&#39;" in client.post("/ui/keys/app/revoke").text


def test_the_form_shows_what_was_wrong_next_to_the_field(client):
    bad = client.post("/ui/keys", data={"name": "Bad Name"})
    assert re.search(r'data-field="name">[^<]*slug', bad.text) and "new-key-secret" not in bad.text
    unknown = client.post("/ui/keys", data={"name": "app", "models": ["ghost"]})
    assert re.search(r"data-field=\"models\">no model config named &#39;ghost&#39;", unknown.text)


def test_a_key_made_on_the_page_takes_limits_and_the_list_shows_them(client):
    made = client.post(
        "/ui/keys",
        data={"name": "app", "rpm": "60", "tpm": "", "token_budget": "5000", "budget_period": "day",
              "expires_at": "2099-01-01T12:00", "priority": "batch"},
    )  # fmt: skip
    assert "new-key-secret" in made.text, made.text
    limits = client.get("/ui/keys/list").text.split('data-testid="key-limits">')[1].split("</td>")[0]
    assert " ".join(limits.split()) == (
        "60 requests/min, 5000 tokens/day, expires 2099-01-01 12:00 UTC, batch"
    )  # fmt: skip
    stored = client.get("/api/keys").json()[0]
    assert (stored["rpm"], stored["tpm"], stored["expires_at"]) == (60, None, "2099-01-01T12:00:00Z")
    bad = client.post("/ui/keys", data={"name": "other", "rpm": "0", "expires_at": "2001-01-01T00:00"})
    assert re.search(r'data-field="rpm">[^<]*greater than or equal to 1', bad.text)
    assert re.search(r'data-field="expires_at">[^<]*has passed', bad.text)


def test_the_usage_page_shows_totals_and_rows(client):
    empty = client.get("/usage")
    assert empty.status_code == 200 and "No requests through /v1 in this range" in empty.text
    runtime = client.app.state.runtime
    runtime.usage.count(0, "a", Tokens(11, 22), error=False)
    runtime.usage.count(0, "a", None, error=True)
    page = client.get("/usage", params={"range": "1h", "per": "minute"})
    totals = page.text.split('data-testid="usage-totals"')[1].split("</tbody>")[0]
    cells = re.findall(r"<td[^>]*>([^<]*)</td>", totals)
    assert cells == ["(no key)", "a", "2", "1", "11", "22"]  # key, model, requests, errors, prompt, completion
    assert 'data-testid="usage-rows"' in page.text
    with session(runtime.engine) as db:
        assert usage.report(db, per="minute").total.requests == 2  # the page wrote them first
    refused = client.get("/usage", params={"range": "30d", "per": "minute"})
    assert "at most 1 day" in refused.text


def test_after_the_last_key_is_revoked_the_page_says_v1_is_closed_and_can_open_it(client):
    assert "needs no inference key" in client.get("/ui/keys/list").text
    assert "Open /v1 without a key" not in client.get("/ui/keys/list").text
    client.post("/ui/keys", data={"name": "app"})
    listed = client.get("/ui/keys/list").text
    assert "needs one of the active inference keys" in listed and "Open /v1 without a key" not in listed
    revoked = client.post("/ui/keys/app/revoke").text
    assert "every key was revoked" in revoked and "Open /v1 without a key" in revoked
    assert client.post("/v1/chat/completions", json={"model": "m", "messages": []}).status_code == 401
    opened = client.post("/ui/keys/open-v1").text
    assert "open without a key again" in opened and "needs no inference key" in opened
    assert client.get("/api/v1-access").json()["needs_key"] is False
