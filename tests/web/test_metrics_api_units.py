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
