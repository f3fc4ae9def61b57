"""A model path under the home folder of a user this machine does not have: a 422 on the field."""

from __future__ import annotations

import yaml

NO_HOME = "~nosuchuser12/m"
YAML = {"content-type": "application/yaml"}


def _field_error(resp, field: str) -> str:
    assert resp.status_code == 422, resp.text[:300]
    messages = [e["msg"] for e in resp.json()["errors"] if e["loc"][-1] == field]
    assert messages, resp.text[:300]
    return messages[0]


def test_model_configs_refuse_an_unknown_users_home(client):
    msg = _field_error(client.post("/api/models", json={"name": "a", "model": NO_HOME}), "model")
    assert "home folder" in msg and "full path" in msg
    assert client.post("/api/models", json={"name": "a", "model": "org/a"}).status_code == 201
    _field_error(client.put("/api/models/a", json={"model": NO_HOME}), "model")
    assert client.get("/api/models/a").json()["model"] == "org/a"


def test_import_names_the_model_that_cannot_be_expanded(client):
    doc = {"format": "vllm-manager", "version": 1, "models": [{"name": "a", "model": NO_HOME}]}
    resp = client.post("/api/import", content=yaml.safe_dump(doc), headers=YAML)
    assert resp.status_code == 422 and resp.json()["field"] == "models[0].model"
    assert "home folder" in resp.json()["detail"]
    assert client.get("/api/models").json() == []


def test_the_planner_refuses_it_on_the_field(client):
    msg = _field_error(client.post("/api/plan", json={"model": NO_HOME}), "model")
    assert "home folder" in msg


def test_lora_adapter_paths_too(client):
    client.post("/api/models", json={"name": "base", "model": "org/base", "enable_lora": True})
    resp = client.post("/api/loras", json={"name": "ad", "path": "~nosuchuser12/ad", "base_config": "base"})
    assert "home folder" in _field_error(resp, "path")


def test_the_forms_show_the_message_by_the_model_field(client):
    resp = client.post("/ui/models/new", data={"name": "a", "model": NO_HOME})
    assert resp.status_code == 200 and "HX-Redirect" not in resp.headers
    assert 'data-field="model">' in resp.text and "home folder" in resp.text
    plan = client.post("/ui/plan", data={"model": NO_HOME, "gpu": "cpu"})
    assert plan.status_code == 200
    assert 'data-field="model">' in plan.text and "home folder" in plan.text
