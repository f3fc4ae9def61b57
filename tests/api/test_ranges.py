"""Integers in paths and query strings: out of range is a 422 naming the parameter, never a 500."""

from __future__ import annotations

import pytest

TOO_BIG = str(2**63)  # one past SQLite's largest INTEGER
HUGE = "99999999999999999999"

GETS = [
    f"/api/events?worker_id={HUGE}",
    f"/api/events?worker_id={TOO_BIG}",
    "/api/events?worker_id=0",
    "/api/events?limit=0",
    "/api/events?limit=1001",
    f"/api/events?limit={HUGE}",
    f"/api/workers/{HUGE}",
    "/api/workers/0",
    f"/api/workers/{TOO_BIG}/logs",
    "/api/workers/1/logs?tail=-1",
    f"/api/workers/1/logs?tail={HUGE}",
    f"/api/workers/1/logs/stream?tail={HUGE}",
    f"/api/workers/{HUGE}/kv-check",
    f"/api/workers/{HUGE}/loras",
    f"/ui/events?worker={HUGE}",
    "/ui/events?limit=0",
    f"/ui/events?limit={HUGE}",
    f"/workers/{HUGE}",
    f"/ui/workers/{HUGE}/kv-check",
    f"/ui/workers/{HUGE}/loras",
    f"/ui/workers/{HUGE}/loras/live",
    f"/ui/workers/{HUGE}/loras/load-form",
]
POSTS = [
    f"/api/workers/{HUGE}/start",
    f"/api/workers/{HUGE}/stop",
    f"/api/workers/{HUGE}/restart",
    f"/api/workers/{HUGE}/loras/a/load",
    f"/api/workers/{HUGE}/loras/a/unload",
    f"/api/workers/unmanaged/{HUGE}/stop",
    "/api/workers/unmanaged/0/stop",
    f"/api/workers/unmanaged/{2**22 + 1}/stop",
    f"/ui/workers/{HUGE}/loras/load",
    f"/ui/workers/{HUGE}/loras/a/unload",
]


@pytest.mark.parametrize("path", GETS)
def test_reads_refuse_integers_out_of_range(client, path):
    resp = client.get(path)
    assert resp.status_code == 422, (path, resp.status_code, resp.text[:200])
    assert "detail" in resp.json()


@pytest.mark.parametrize("path", POSTS)
def test_changes_refuse_integers_out_of_range(client, path):
    resp = client.post(path, json={"model": "m"})
    assert resp.status_code == 422, (path, resp.status_code, resp.text[:200])


def test_worker_ids_in_range_that_do_not_exist_are_404(client):
    assert client.get(f"/api/workers/{2**63 - 1}").status_code == 404
    assert client.get(f"/api/events?worker_id={2**63 - 1}").json() == []
    assert client.delete(f"/api/workers/{HUGE}").status_code == 422


def test_a_worker_path_takes_only_digits_for_the_id(client):
    for path in ("/api/workers/-1", "/api/workers/abc", "/api/workers/1.5/logs"):
        resp = client.get(path)
        assert resp.status_code == 404 and "not a path of this manager" in resp.json()["detail"], path
    # /api/workers/unmanaged is a path of its own, not worker "unmanaged": it takes GET only.
    refused = client.delete("/api/workers/unmanaged")
    assert refused.status_code == 405 and refused.headers["allow"] == "GET, HEAD"


def test_the_ranges_are_in_the_openapi_schema(client):
    paths = client.get("/openapi.json").json()["paths"]
    worker_id = next(p for p in paths["/api/workers/{worker_id}"]["get"]["parameters"] if p["name"] == "worker_id")
    assert worker_id["schema"]["minimum"] == 1 and worker_id["schema"]["maximum"] == 2**63 - 1
    params = {p["name"]: p["schema"] for p in paths["/api/events"]["get"]["parameters"]}
    assert params["limit"]["maximum"] == 1000
    assert any(s.get("maximum") == 2**63 - 1 for s in params["worker_id"].get("anyOf", [params["worker_id"]]))
    tail = next(p for p in paths["/api/workers/{worker_id}/logs"]["get"]["parameters"] if p["name"] == "tail")
    assert tail["schema"]["maximum"] == 5000
    pid = paths["/api/workers/unmanaged/{pid}/stop"]["post"]["parameters"][0]
    assert pid["schema"]["maximum"] == 2**22
