"""A worker whose start failed is still failed, with its reason and its log, after the manager restarts."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from manager.app import create_app
from tests.support.engine import tiny_config, wait_for_state

pytestmark = pytest.mark.engine


def test_a_failed_worker_keeps_its_state_reason_and_log_across_a_manager_restart(engine_settings, tmp_path):
    not_a_model = tmp_path / "empty-folder"  # exists, so the config is taken; vLLM finds no config.json there
    not_a_model.mkdir()
    with TestClient(create_app(engine_settings)) as c:
        assert c.post("/api/models", json=tiny_config("broken", not_a_model)).status_code == 201
        wid = c.post("/api/workers", json={"model": "broken"}).json()["id"]
        failed = wait_for_state(c, wid, {"ready", "failed"})
        assert failed["state"] == "failed" and failed["last_error"]
        before = c.get(f"/api/workers/{wid}/logs").json()
        assert before["file"] and before["lines"]
    with TestClient(create_app(engine_settings)) as c:
        again = c.get(f"/api/workers/{wid}").json()
        assert again["state"] == "failed" and again["last_error"] == failed["last_error"]
        after = c.get(f"/api/workers/{wid}/logs").json()
        assert after["file"] == before["file"]
        assert after["lines"][-5:] == before["lines"][-5:]
