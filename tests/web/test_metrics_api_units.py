"""The pure parts of the metrics routes and the value filters the pages use."""

from __future__ import annotations

import pytest

from manager.web.metrics_api import match_series, parse_window
from manager.web.render import latency, nbytes, num, pct, seconds, share


@pytest.mark.parametrize(("text", "seconds_"), [("15m", 900), ("1h", 3600), ("24h", 86400),
                                                ("90", 90), ("7d", 604800), ("1.5h", 5400)])  # fmt: skip
def test_windows_read_as_a_user_writes_them(text, seconds_):
    assert parse_window(text, longest_s=7 * 86400) == seconds_


def test_a_window_beyond_the_history_says_how_to_keep_more():
    with pytest.raises(ValueError, match="METRICS_RETENTION_DAYS"):
        parse_window("8d", longest_s=7 * 86400)
    with pytest.raises(ValueError, match="15m, 1h, 24h"):
        parse_window("an hour", longest_s=7 * 86400)
    with pytest.raises(ValueError, match="longer than 0"):
        parse_window("0", longest_s=7 * 86400)


def test_series_globs_match_every_worker_and_report_what_matched_nothing():
    known = ["host.ram_used_bytes", "worker.1.kv_cache_usage_pct", "worker.12.kv_cache_usage_pct",
             "worker.1.rss_bytes"]  # fmt: skip
    names, unmatched = match_series(["worker.*.kv_cache_usage_pct", "gpu.*.memory_used_bytes",
                                     "worker.1.kv_cache_usage_pct"], known)  # fmt: skip
    assert names == ["worker.1.kv_cache_usage_pct", "worker.12.kv_cache_usage_pct"]
    assert unmatched == ["gpu.*.memory_used_bytes"]


def test_values_a_source_does_not_report_show_as_na_not_zero():
    assert [nbytes(None), num(None), pct(None), seconds(None), latency(None)] == ["n/a"] * 5
    assert share(5, None) is None and share(None, 10) is None


def test_values_read_in_the_units_a_user_expects():
    assert nbytes(3 * 1024**3) == "3.0 GiB" and nbytes(512) == "512 B"
    assert seconds(42) == "42 s" and seconds(3725) == "1 h 2 min" and seconds(90061) == "1 d 1 h"
    assert latency(0.0123) == "12 ms" and latency(12.5) == "12.5 s"
    assert share(30, 120) == 25.0 and share(200, 100) == 100.0


def test_the_disk_view_sends_the_downloads_when_they_move_and_reloads_the_list_when_one_starts_or_ends():
    from manager.web.live import LiveViews

    shown: dict = {"version": 1, "rows": []}
    views = LiveViews(lambda: [], lambda: (shown["version"], shown["rows"]))
    row = {"id": 4, "repo": "acme/big", "commit": None, "state": "running", "percent": 10, "done_bytes": 1,
           "total_bytes": 10, "rate_bps": None, "eta_s": None, "error": None}  # fmt: skip

    sent, events = views.disk(None)  # a page connects: the table, its list was rendered with the page
    assert [name for name, _ in events] == ["downloads"] and "No downloads yet" in events[0][1]
    assert views.disk(sent) == (sent, [])  # nothing moved: nothing sent

    shown.update(version=2, rows=[row])  # a download starts
    sent, events = views.disk(sent)
    assert [name for name, _ in events] == ["downloads", "disk-changed"] and events[1][1] == "2"
    assert 'data-download="4" data-state="running"' in events[0][1]

    shown.update(version=3, rows=[{**row, "percent": 50, "done_bytes": 5}])  # it moves
    sent, events = views.disk(sent)
    assert [name for name, _ in events] == ["downloads"] and ">50 %<" in events[0][1]

    shown.update(version=4, rows=[{**row, "state": "done", "percent": 100, "done_bytes": 10}])  # it ends
    sent, events = views.disk(sent)
    assert [name for name, _ in events] == ["downloads", "disk-changed"]
