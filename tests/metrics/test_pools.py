"""Pool stats read through engine_patches' own reader, from files in its documented format."""

from __future__ import annotations

import json
import os

from manager.metrics.pools import PoolsReader


def _write(run_dir, pid, **sections):
    doc = {"pid": pid, "role": "worker", "updated_at": 1.0, **sections}
    (run_dir / f"stats-{pid}.json").write_text(json.dumps(doc))


def test_pools_of_all_live_engine_processes_are_summed(tmp_path):
    # Two live pids (this test and its parent), as an API server and an engine core would be.
    _write(
        tmp_path,
        os.getpid(),
        pinned={"pinned_bytes": 3 << 30, "pageable_fallbacks": 1, "pinned": True},
    )
    _write(
        tmp_path,
        os.getppid(),
        pinned={"pinned_bytes": 1 << 30, "pageable_fallbacks": 0},
        expert_cache={"hits": 90, "misses": 10, "hit_rate": 0.9},
    )
    report = PoolsReader.from_plugin().sample(tmp_path)
    assert report.available and len(report.processes) == 2
    assert report.totals["pinned"]["pinned_bytes"] == 4 << 30
    assert report.totals["pinned"]["pageable_fallbacks"] == 1  # a fallback is visible, not averaged away
    assert "pinned" not in report.totals["pinned"]  # flags are not summed
    assert report.totals["expert_cache"]["hit_rate"] == 0.9


def test_hit_rate_is_recomputed_over_processes_not_added(tmp_path):
    _write(tmp_path, os.getpid(), expert_cache={"hits": 10, "misses": 90, "hit_rate": 0.1})
    _write(tmp_path, os.getppid(), expert_cache={"hits": 90, "misses": 10, "hit_rate": 0.9})
    report = PoolsReader.from_plugin().sample(tmp_path)
    assert report.totals["expert_cache"]["hit_rate"] == 0.5


def test_the_expert_caches_of_two_tensor_parallel_ranks_count_their_tokens_once_and_their_bytes_twice(tmp_path):
    rank = {"hits": 30, "misses": 10, "tokens": 100, "bytes_moved": 4000, "streamed_bytes": 1000, "copy_time_s": 2.0}
    _write(tmp_path, os.getpid(), expert_cache={**rank, "bytes_per_token": 50.0})
    _write(tmp_path, os.getppid(), expert_cache={**rank, "copy_time_s": 3.0, "bytes_per_token": 50.0})
    cache = PoolsReader.from_plugin().sample(tmp_path).totals["expert_cache"]
    assert cache["tokens"] == 100  # both ranks ran the same 100 tokens
    assert cache["bytes_moved"] == 8000 and cache["bytes_per_token"] == 100.0  # each over its own link
    assert cache["copy_time_s"] == 3.0  # side by side: the slower rank's
    assert cache["hits"] == 60 and cache["hit_rate"] == 0.75


def test_the_guess_hit_rate_of_experts_fetched_ahead_is_recomputed_over_the_ranks(tmp_path):
    _write(tmp_path, os.getpid(), expert_cache={"ahead_used": 30, "ahead_wasted": 10, "ahead_hit_rate": 0.75})
    _write(tmp_path, os.getppid(), expert_cache={"ahead_used": 10, "ahead_wasted": 30, "ahead_hit_rate": 0.25})
    cache = PoolsReader.from_plugin().sample(tmp_path).totals["expert_cache"]
    assert (cache["ahead_used"], cache["ahead_wasted"], cache["ahead_hit_rate"]) == (40, 40, 0.5)


def test_files_of_dead_processes_are_ignored(tmp_path):
    _write(tmp_path, 2**22 + 12345, pinned={"pinned_bytes": 1})  # above Linux's pid_max: never alive
    report = PoolsReader.from_plugin().sample(tmp_path)
    assert not report.available and "no pool stats published yet" in report.reason


def test_without_the_plugin_the_panel_says_not_available(tmp_path):
    report = PoolsReader(None).sample(tmp_path)
    assert not report.available and "engine_patches plugin is not installed" in report.reason


def test_a_failing_reader_does_not_raise(tmp_path):
    def broken(_run_dir):
        raise PermissionError("permission denied")

    report = PoolsReader(broken).sample(tmp_path)
    assert not report.available and "permission denied" in report.reason


def test_a_sleep_over_two_ranks_shows_the_bytes_of_both_and_the_time_of_the_slower(tmp_path):
    gb = 10**9
    for pid, seconds in ((os.getpid(), 0.5), (os.getppid(), 0.8)):
        _write(
            tmp_path,
            pid,
            sleep_pool={
                "pool_bytes": 28 * gb,
                "slept_bytes": 28 * gb,
                "sleeps": 2,
                "last_sleep_s": seconds,
                "last_sleep_bytes": 28 * gb,
                "last_sleep_gbps": 28 / seconds,
            },
        )
    sleep = PoolsReader.from_plugin().sample(tmp_path).totals["sleep_pool"]
    assert sleep["slept_bytes"] == 56 * gb
    assert sleep["last_sleep_s"] == 0.8  # the ranks copy side by side: the sleep took the longer one
    assert sleep["last_sleep_gbps"] == 70.0  # 56 GB in 0.8 s, not 56 + 35 summed


def test_a_workers_own_plugin_says_whether_it_runs_the_sleep_pool(tmp_path):
    from manager.metrics.pools import launched_with_sleep_pool, sleep_pool_bytes

    reader = PoolsReader.from_plugin()
    assert launched_with_sleep_pool(reader.sample(tmp_path)) is None  # nothing published yet
    _write(tmp_path, os.getpid(), plugin={"settings": {"sleep_pool": False}})
    assert launched_with_sleep_pool(reader.sample(tmp_path)) is False
    _write(
        tmp_path,
        os.getppid(),
        plugin={"settings": {"sleep_pool": True}},
        sleep_pool={"pool_bytes": 5 << 30, "sleeps": 3, "wakes": 3},
    )
    report = reader.sample(tmp_path)
    assert sleep_pool_bytes(report) == 5 << 30
    assert report.totals["sleep_pool"]["sleeps"] == 3  # counted once per worker, not per rank


def test_a_worker_with_no_pool_in_use_says_so_instead_of_a_table_of_zeros(tmp_path):
    from types import SimpleNamespace

    from manager.web.render import render

    _write(tmp_path, os.getpid(), pinned={"pinned_bytes": 0, "pageable_fallbacks": 0, "pinned": False})
    empty = PoolsReader.from_plugin().sample(tmp_path)
    assert empty.available and empty.in_use == {}
    snap = SimpleNamespace(taken_at=1.0)
    html = render("fragments/worker_engine.html", w=SimpleNamespace(engine=None, state="ready", pools=empty), snap=snap)
    assert 'data-testid="no-pools"' in html and "pinned bytes" not in html
    _write(tmp_path, os.getpid(), pinned={"pinned_bytes": 1 << 30, "pageable_fallbacks": 0})
    used = PoolsReader.from_plugin().sample(tmp_path)
    assert set(used.in_use) == {"pinned"}
    html = render("fragments/worker_engine.html", w=SimpleNamespace(engine=None, state="ready", pools=used), snap=snap)
    assert 'data-testid="no-pools"' not in html and "pinned bytes" in html
