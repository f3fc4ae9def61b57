"""What a browser on another site, or a rebound DNS name, cannot do; what readers without the token see."""

from __future__ import annotations

from fastapi.testclient import TestClient

from manager.app import create_app
from manager.settings import Settings

MODEL = {"name": "m", "model": "/models/m", "env": {"HF_TOKEN": "hf_SECRET"}}


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
