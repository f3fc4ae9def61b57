"""The engine's log holds the requests a user sent, not the manager's own probes every few seconds."""

from __future__ import annotations

import time

import httpx
import pytest
from fastapi.testclient import TestClient

from manager.app import create_app
from tests.support.engine import tiny_config, wait_for_state

pytestmark = pytest.mark.engine


def test_the_engine_log_keeps_requests_and_leaves_out_the_managers_probes(engine_settings, tiny_llama):
    with TestClient(create_app(engine_settings)) as c:
        assert c.post("/api/models", json=tiny_config("tiny", tiny_llama)).status_code == 201
        wid = c.post("/api/workers", json={"model": "tiny"}).json()["id"]
        worker = wait_for_state(c, wid, {"ready", "failed"})
        assert worker["state"] == "ready", worker
        time.sleep(3 * engine_settings.health_interval_s)  # a few rounds of /health, /v1/models, /metrics
        answer = httpx.post(
            f"http://127.0.0.1:{worker['port']}/v1/completions",
            json={"model": "tiny", "prompt": "hello", "max_tokens": 2},
            timeout=60,
        )
        assert answer.status_code == 200
        time.sleep(1)
        lines = c.get(f"/api/workers/{wid}/logs?tail=2000").json()["lines"]
        c.post(f"/api/workers/{wid}/stop")
        wait_for_state(c, wid, {"stopped"})
    assert any('"POST /v1/completions HTTP/1.1" 200' in line for line in lines), lines[-20:]
    probes = [
        line for line in lines if any(f'"GET {p} HTTP/1.1"' in line for p in ("/health", "/v1/models", "/metrics"))
    ]
    assert probes == []
