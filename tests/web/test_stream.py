"""The SSE stream a page listens to, read over a real socket from a running manager."""

from __future__ import annotations

import json
import time

import httpx


def _events(url: str, until: set[str], limit_s: float = 15) -> list[tuple[str, str]]:
    """SSE (event, data) pairs until every name in ``until`` was seen twice (two samples)."""
    seen: list[tuple[str, str]] = []
    deadline = time.monotonic() + limit_s
    event, data = "message", []
    with httpx.stream("GET", url, timeout=limit_s) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        for line in resp.iter_lines():
            if line.startswith("event:"):
                event = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].removeprefix(" "))
            elif line == "" and data:
                seen.append((event, "\n".join(data)))
                event, data = "message", []
                names = [e for e, _ in seen]
                if all(names.count(n) >= 2 for n in until) or time.monotonic() > deadline:
                    return seen
    return seen


def test_overview_stream_sends_fragments_and_a_timed_snapshot_each_second(live_manager):
    events = _events(live_manager.url + "/api/metrics/stream", {"snapshot", "gpus", "host"})
    snapshots = [json.loads(d) for e, d in events if e == "snapshot"]
    assert len(snapshots) >= 2
    first, second = snapshots[0], snapshots[1]
    assert second["seq"] > first["seq"]
    assert 0.5 < second["taken_at"] - first["taken_at"] < 3  # about once a second
    assert "host.ram_used_bytes" in first["series"]
    host = [d for e, d in events if e == "host"]
    assert 'data-testid="host-ram"' in host[0] and "data-taken-at=" in host[0]
    # The worker cards' frame is sent once (no workers change here), not every second.
    assert [e for e, _ in events].count("worker-cards") == 1


def test_worker_view_needs_a_worker_id(live_manager):
    resp = httpx.get(live_manager.url + "/api/metrics/stream", params={"view": "worker"})
    assert resp.status_code == 422 and "worker=<id>" in resp.text
