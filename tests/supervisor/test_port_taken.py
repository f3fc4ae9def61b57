"""A worker whose port another program took while it was stopped starts on the next free port of the
range, and says so (a config that pins its port keeps it)."""

from __future__ import annotations

import socket

import httpx
import pytest
from fastapi.testclient import TestClient

from manager.app import create_app
from tests.support.engine import tiny_config, wait_for_state

pytestmark = pytest.mark.engine


def test_a_worker_whose_port_was_taken_starts_on_another_and_answers_there(engine_settings, tiny_llama):
    with TestClient(create_app(engine_settings)) as c:
        assert c.post("/api/models", json=tiny_config("tiny", tiny_llama)).status_code == 201
        wid = c.post("/api/workers", json={"model": "tiny"}).json()["id"]
        first = wait_for_state(c, wid, {"ready", "failed"})
        assert first["state"] == "ready"
        c.post(f"/api/workers/{wid}/stop")
        wait_for_state(c, wid, {"stopped"})
        with socket.socket() as squatter:  # an outside program on the worker's port
            squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # the engine's own may be in TIME_WAIT
            squatter.bind(("127.0.0.1", first["port"]))
            squatter.listen()
            assert c.post(f"/api/workers/{wid}/start").status_code == 200
            again = wait_for_state(c, wid, {"ready", "failed"})
            assert again["state"] == "ready", again
            assert again["port"] != first["port"]
            answer = httpx.post(
                f"http://127.0.0.1:{again['port']}/v1/completions",
                json={"model": "tiny", "prompt": "hello", "max_tokens": 2},
                timeout=60,
            )
            assert answer.status_code == 200
        events = c.get(f"/api/events?worker_id={wid}").json()
        moved = [e for e in events if e["kind"] == "port_moved"]
        assert moved and str(first["port"]) in moved[0]["message"] and str(again["port"]) in moved[0]["message"]
        c.post(f"/api/workers/{wid}/stop")
        wait_for_state(c, wid, {"stopped"})
