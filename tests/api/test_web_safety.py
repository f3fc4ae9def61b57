"""What a browser on another site, or a rebound DNS name, cannot do; what readers without the token see."""

from __future__ import annotations

from fastapi.testclient import TestClient

from manager.app import create_app
from manager.settings import Settings

MODEL = {"name": "m", "model": "org/m", "env": {"HF_TOKEN": "hf_SECRET"}}


def test_a_page_on_another_site_cannot_change_anything(client):
    evil = {"Origin": "https://evil.example"}
    assert client.post("/api/models", json=MODEL, headers=evil).status_code == 403
    assert client.post("/api/models", json=MODEL, headers={"Sec-Fetch-Site": "cross-site"}).status_code == 403
    assert client.post("/api/models", json=MODEL, headers={"Origin": "http://testserver"}).status_code == 201


def test_import_needs_a_yaml_or_json_content_type(client):
    text = client.get("/api/export").text
    resp = client.post("/api/import", content=text, headers={"content-type": "text/plain"})
    assert resp.status_code == 415 and "application/yaml" in resp.json()["detail"]


def test_unknown_host_names_are_refused(client):
    assert client.get("/api/health", headers={"Host": "attacker.example"}).status_code == 400


def test_default_trusted_hosts_follow_the_bind_address():
    assert "127.0.0.1" in Settings(host="127.0.0.1", allowed_hosts=None).trusted_hosts()
    assert "*" not in Settings(host="127.0.0.1", allowed_hosts=None).trusted_hosts()
    assert Settings(host="0.0.0.0", allowed_hosts=None).trusted_hosts() == ["*"]


def test_with_a_token_and_open_reads_secrets_are_hidden_from_readers_without_it(settings):
    token = "t" * 32
    guarded = settings.model_copy(update={"api_token": token, "open_reads": True})
    auth = {"Authorization": f"Bearer {token}"}
    with TestClient(create_app(guarded)) as c:
        assert c.post("/api/models", json=MODEL, headers=auth).status_code == 201
        for path in ("/api/models/m", "/api/models"):
            assert "hf_SECRET" not in c.get(path).text
            assert "hf_SECRET" in c.get(path, headers=auth).text
        assert "hf_SECRET" not in c.get("/api/models/m/command?validate=false").text
        assert c.get("/api/export").status_code == 401
        assert "hf_SECRET" in c.get("/api/export", headers=auth).text


def test_a_logged_in_browser_changes_things_only_from_this_managers_own_origin(settings):
    token = "t" * 32
    with TestClient(create_app(settings.model_copy(update={"api_token": token}))) as c:
        assert c.post("/login", data={"token": token}, follow_redirects=False).status_code == 303
        # The same host and port over another scheme, or another port, is another site's page.
        for other in ("https://testserver", "http://testserver:8080", "http://testserver.evil.example"):
            refused = c.post("/api/profiles", json={"name": "p"}, headers={"Origin": other})
            assert refused.status_code == 403, other
            assert other in refused.json()["detail"] and "http://testserver" in refused.json()["detail"]
        # A form post that says nothing of where it comes from is not taken on the cookie's word.
        silent = c.post("/ui/profiles/new", data={"name": "p"})
        assert silent.status_code == 403 and "Origin" in silent.json()["detail"]
        assert c.get("/api/profiles").json() == []
        own = c.post("/ui/profiles/new", data={"name": "p"}, headers={"Origin": "http://testserver"})
        assert own.status_code == 200 and own.headers["HX-Redirect"] == "/models"
        same = c.post("/api/profiles", json={"name": "q"}, headers={"Sec-Fetch-Site": "same-origin"})
        assert same.status_code == 201
    # Scripts and the CLI send the token and neither header: they are not browsers.
    with TestClient(create_app(settings.model_copy(update={"api_token": token}))) as script:
        made = script.post("/api/profiles", json={"name": "r"}, headers={"Authorization": f"Bearer {token}"})
        assert made.status_code == 201
