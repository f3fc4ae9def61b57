"""HEAD is answered wherever GET is, and no response of the manager may be framed by another site."""

from __future__ import annotations

import re

import pytest
from fastapi.routing import APIRoute

STREAMS = ("/api/events/stream", "/api/metrics/stream")
SAMPLE = {"worker_id": "1", "name": "nothing-here", "pid": "1", "download_id": "1"}


def _get_paths(app) -> list[str]:
    paths = []
    for route in app.routes:
        if isinstance(route, APIRoute) and "GET" in route.methods:
            paths.append(re.sub(r"\{(\w+)\}", lambda m: SAMPLE[m.group(1)], route.path))
    return sorted(set(paths))


def test_every_get_route_answers_head_with_the_same_status_and_no_body(client):
    paths = _get_paths(client.app)
    assert "/api/health" in paths and "/models" in paths
    for path in paths:
        if path.endswith("/stream"):
            continue
        got = client.get(path)
        head = client.head(path)
        assert head.status_code == got.status_code != 405, (path, head.status_code, got.status_code)
        assert head.content == b"", path
        assert head.headers.get("content-type") == got.headers.get("content-type"), path


@pytest.mark.parametrize("path", [*STREAMS, "/static/vendor/htmx.min.js"])
def test_head_of_a_stream_or_file_ends_after_the_headers(client, path):
    head = client.head(path)
    assert head.status_code == 200 and head.content == b""
    assert client.get("/api/health").status_code == 200


def test_head_of_a_missing_worker_stream_is_404(client):
    assert client.head("/api/workers/1/logs/stream").status_code == 404


@pytest.mark.parametrize(
    ("method", "path", "kwargs"),
    [
        ("GET", "/", {}),
        ("GET", "/models", {}),
        ("GET", "/plan", {}),
        ("GET", "/models/nothing", {}),
        ("GET", "/api/health", {}),
        ("GET", "/api/models/nothing", {}),
        ("GET", "/static/vendor/htmx.min.js", {}),
        ("GET", "/api/events?limit=0", {}),
        ("HEAD", "/", {}),
        ("POST", "/api/profiles", {"json": {"name": "p", "description": "d" * 3_000_000}}),
        ("GET", "/api/health", {"headers": {"Host": "attacker.example"}}),
    ],
)
def test_no_response_may_be_framed(client, method, path, kwargs):
    resp = client.request(method, path, **kwargs)
    assert resp.headers["x-frame-options"] == "DENY", (path, resp.status_code)
    assert "frame-ancestors 'none'" in resp.headers["content-security-policy"]
