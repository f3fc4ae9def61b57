"""A model config's loading_progress through the REST API and the CLI: off unless set, kept as given,
described in the OpenAPI document, and read by the front door once changed."""

from __future__ import annotations

import json

from tests.cli.test_cli import _run

MODEL = {"name": "chat", "model": "Qwen/Qwen2.5-0.5B-Instruct", "gpu_ids": [0]}


def test_loading_progress_is_off_unless_set_and_reaches_the_front_door(client):
    door = client.app.state.runtime.front_door
    assert client.post("/api/models", json=MODEL).status_code == 201
    assert client.get("/api/models/chat").json()["loading_progress"] is False
    assert door.catalog.loading_progress("chat") is False
    changed = client.put("/api/models/chat", json={**MODEL, "loading_progress": True})
    assert changed.status_code == 200, changed.text
    assert client.get("/api/models/chat").json()["loading_progress"] is True
    assert door.catalog.loading_progress("chat") is True
    refused = client.put("/api/models/chat", json={**MODEL, "loading_progress": "sometimes"})
    assert refused.status_code == 422 and "loading_progress" in refused.text


def test_the_models_schema_describes_loading_progress(client):
    fields = client.get("/openapi.json").json()["components"]["schemas"]["ModelConfigCreate"]["properties"]
    assert "X-Loading-Progress" in fields["loading_progress"]["description"]


def test_models_set_turns_loading_progress_on(tmp_path):
    data = tmp_path / "data"
    file = tmp_path / "a.json"
    file.write_text(json.dumps({"name": "a", "model": "org/a"}))
    assert _run(["models", "add", str(file)], data).returncode == 0
    done = _run(["models", "set", "a", "loading_progress=true"], data)
    assert done.returncode == 0, done.stderr
    assert json.loads(_run(["models", "show", "a"], data).stdout)["loading_progress"] is True


def test_the_config_form_has_a_loading_progress_checkbox_that_is_stored(client):
    page = client.get("/models/new").text
    assert 'name="loading_progress"' in page and "proxies do not time them out" in page
    form = {"name": "chat", "model": "org/chat", "loading_progress": "on"}
    assert client.post("/ui/models/new", data=form).headers["HX-Redirect"] == "/models/chat"
    assert client.get("/api/models/chat").json()["loading_progress"] is True
