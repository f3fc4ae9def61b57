"""Ring buffers: an hour of 1 s points per series, newest kept, gaps kept as gaps."""

from __future__ import annotations

import pytest

from manager.metrics.series import ONE_HOUR_AT_1S, RingBuffer, SeriesStore


def test_default_store_holds_at_least_an_hour_at_one_second():
    store = SeriesStore()
    for t in range(2 * ONE_HOUR_AT_1S):
        store.add(float(t), {"gpu.0.memory_used_bytes": t * 10.0})
    points = store.window("gpu.0.memory_used_bytes", ONE_HOUR_AT_1S, now=2 * ONE_HOUR_AT_1S - 1).points
    assert len(points) == ONE_HOUR_AT_1S + 1
    assert points[0] == (float(ONE_HOUR_AT_1S - 1), (ONE_HOUR_AT_1S - 1) * 10.0)


def test_full_buffer_overwrites_the_oldest_points_first():
    buf = RingBuffer(5)
    for t in range(12):
        buf.append(float(t), float(t * t))
    assert len(buf) == 5
    assert buf.since(0.0) == [(float(t), float(t * t)) for t in range(7, 12)]
    assert buf.since(9.5) == [(10.0, 100.0), (11.0, 121.0)]
    assert buf.latest() == (11.0, 121.0) and buf.oldest_time() == 7.0


def test_missing_values_stay_gaps_not_zeros():
    store = SeriesStore(capacity=10)
    store.add(1.0, {"worker.a.generation_tokens_per_s": 5.0})
    store.add(2.0, {"worker.a.generation_tokens_per_s": None})
    store.add(3.0, {"worker.a.generation_tokens_per_s": 0.0})
    pts = store.window("worker.a.generation_tokens_per_s", 10, now=3.0).points
    assert pts == [(1.0, 5.0), (2.0, None), (3.0, 0.0)]


def test_unknown_series_is_empty_and_dropped_series_are_forgotten():
    store = SeriesStore(capacity=10)
    store.add(1.0, {"worker.old.rss_bytes": 1.0, "host.cpu_pct": 3.0})
    assert store.window("nope", 60, now=1.0).points == []
    store.drop(keep={"host.cpu_pct"})
    assert store.names() == ["host.cpu_pct"]


def test_zero_capacity_is_refused_with_a_reason():
    with pytest.raises(ValueError, match="at least one point"):
        RingBuffer(0)
