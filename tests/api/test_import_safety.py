"""Import files a careless user or an attacker may send: refused with a 422 saying why, never a 500,
and parsed off the event loop so the rest of the manager keeps answering meanwhile."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import yaml

from manager.services import transfer

YAML = {"content-type": "application/yaml"}
HEAD = "format: vllm-manager\nversion: 1\n"


def test_yaml_nested_fifty_thousand_deep_is_refused(client):
    for deep in ("[" * 50_000 + "]" * 50_000, "{a: " * 50_000 + "1" + "}" * 50_000):
        resp = client.post("/api/import", content=HEAD + "models: " + deep + "\n", headers=YAML)
        assert resp.status_code == 422 and "nested too deeply" in resp.json()["detail"]
    resp = client.post("/api/import", content="[" * 50_000 + "]" * 50_000, headers={"content-type": "application/json"})
    assert resp.status_code == 422
    assert client.get("/api/health").status_code == 200


def test_alias_bombs_are_refused_quickly(client):
    laughs = ['a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    laughs += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 10)]
    doc = HEAD + "\n".join(laughs) + "\nmodels: [{name: m, model: x, extra_args: *a9, env: {A: *a9}}]\nprofiles: *a9\n"
    started = time.monotonic()
    resp = client.post("/api/import", content=doc, headers=YAML)
    assert resp.status_code == 422
    assert time.monotonic() - started < 10
    assert client.get("/api/models").json() == []


def test_a_file_that_is_not_utf8_is_refused_not_patched(client):
    body = (HEAD + 'models: [{name: m, model: "org/caf\xe9"}]\n').encode("latin-1")
    resp = client.post("/api/import", content=body, headers=YAML)
    assert resp.status_code == 422
    assert "not UTF-8" in resp.json()["detail"] and "0xe9" in resp.json()["detail"]
    assert client.get("/api/models").json() == []
    ok = client.post("/api/import", content=body.decode("latin-1").encode(), headers=YAML)
    assert ok.status_code == 200 and client.get("/api/models/m").json()["model"] == "org/café"


def test_health_answers_while_an_import_is_being_parsed(client, monkeypatch):
    """The parser is held until /api/health has answered (or 10 s pass): on the event loop, the
    health check could not be served until the parser let go."""
    parsing = threading.Event()
    health_answered = threading.Event()
    real_parse = transfer.parse_yaml

    def held_parse(source):
        parsing.set()
        health_answered.wait(timeout=10)
        return real_parse(source)

    monkeypatch.setattr(transfer, "parse_yaml", held_parse)
    text = yaml.safe_dump({"format": "vllm-manager", "version": 1, "models": [{"name": "m", "model": "org/m"}]})
    with ThreadPoolExecutor(1) as pool:
        importing = pool.submit(client.post, "/api/import", content=text, headers=YAML)
        assert parsing.wait(timeout=10)
        health = client.get("/api/health")
        import_still_running = not importing.done()
        health_answered.set()
        assert importing.result().status_code == 200
    assert health.status_code == 200
    assert import_still_running
    assert client.get("/api/models/m").status_code == 200


def test_a_large_import_is_parsed_and_stored(client):
    models = [{"name": f"m{i}", "model": f"org/m{i}", "env": {"HF_TOKEN": "v" * 2000}} for i in range(600)]
    text = yaml.safe_dump({"format": "vllm-manager", "version": 1, "models": models})
    assert len(text) > 1024**2
    resp = client.post("/api/import", content=text, headers=YAML)
    assert resp.status_code == 200 and len(resp.json()["created"]) == 600
