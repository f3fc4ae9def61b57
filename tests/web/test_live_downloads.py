"""Download progress in the stream's JSON snapshot, for scripts and charts: each download under way with
its bytes, rate and time left, the ones that ended lately with how they ended, and no token or path."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from manager.db import make_engine, migrate
from manager.hub.downloads import Downloads
from manager.metrics import Snapshot
from manager.metrics.gpu import GpuReport
from manager.metrics.host import HostSample
from manager.schemas.download import DownloadState
from manager.web.live import LiveViews, download_progress
from manager.web.live_dep import downloads_shown
from tests.support.hub_server import GOOD_TOKEN, TestHub
from tests.support.tiny_hub_model import big_safetensors

HOST = HostSample(0.0, 2, 8 << 30, 1 << 30, 7 << 30, 0, 0, None, ())
MiB = 1024**2
FIELDS = {"id", "repo", "revision", "state", "percent", "done_bytes", "total_bytes", "rate_bps", "eta_s"}


@pytest.fixture
def manager(test_hub: TestHub, tmp_path: Path, monkeypatch) -> Iterator[Downloads]:
    monkeypatch.setenv("HF_ENDPOINT", test_hub.url)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.delenv("HF_HOME", raising=False)
    engine = make_engine(tmp_path / "manager.db")
    migrate(engine)
    yield Downloads(engine, tmp_path / "logs")
    engine.dispose()


def snapshot_json(views: LiveViews, seq: int) -> dict:
    name, data = views.snapshot_event(Snapshot(seq, time.time(), GpuReport.unavailable("test"), HOST, ()))
    assert name == "snapshot"
    return json.loads(data)


def test_the_snapshot_carries_each_downloads_progress_and_how_it_ended(manager: Downloads, test_hub: TestHub):
    test_hub.add_repo("acme/gated-big", {"config.json": b"{}", "model.safetensors": big_safetensors(32)}, gated=True)
    test_hub.set_faults("acme/gated-big", rate_bytes_per_s=8 * MiB, stall_after_bytes=16 * MiB)
    views = LiveViews(lambda: [], lambda: downloads_shown(manager))

    async def watch():
        row = await manager.start("acme/gated-big", None, {"HF_TOKEN": GOOD_TOKEN})
        seen = []
        for seq in range(40):  # while the bytes come, until the hub stalls
            seen.append(snapshot_json(views, seq))
            if test_hub.wait_stalled(0.0):
                break
            await asyncio.sleep(0.25)
        await manager.cancel(row.id)
        return row, seen, snapshot_json(views, 100)

    row, seen, after = run(watch())
    test_hub.release()

    shown = [s["downloads"] for s in seen if s["downloads"]]
    assert shown and all(len(d) == 1 and set(d[0]) == FIELDS for d in shown)
    last = shown[-1][0]
    assert (last["id"], last["repo"], last["revision"], last["state"]) == (row.id, "acme/gated-big", "main", "running")
    assert last["total_bytes"] == row.total_bytes and 0 < last["done_bytes"] < last["total_bytes"]
    assert last["percent"] == int(100 * last["done_bytes"] / last["total_bytes"])
    assert any(d[0]["rate_bps"] and 2 * MiB < d[0]["rate_bps"] < 32 * MiB and d[0]["eta_s"] > 0 for d in shown)
    assert [(d["id"], d["state"]) for d in after["downloads"]] == [(row.id, "cancelled")]
    assert all(GOOD_TOKEN not in json.dumps(s) and "hf-cache" not in json.dumps(s) for s in [*seen, after])


def test_a_download_that_ended_over_a_minute_ago_leaves_the_snapshot() -> None:
    now = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
    rows = [
        {"id": 1, "state": DownloadState.RUNNING.value, "finished_at": None, "cache_dir": "/secret/place"},
        {"id": 2, "state": "done", "finished_at": (now - timedelta(seconds=30)).replace(tzinfo=None).isoformat()},
        {"id": 3, "state": "failed", "finished_at": (now - timedelta(seconds=90)).replace(tzinfo=None).isoformat()},
    ]

    shown = download_progress(rows, now)

    assert [d["id"] for d in shown] == [1, 2] and all("cache_dir" not in d for d in shown)


def run(coro):
    return asyncio.run(coro)
