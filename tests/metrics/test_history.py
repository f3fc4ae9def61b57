"""Minute history in SQLite: downsampling, merging a minute written twice, retention, migration."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.operations import Operations
from sqlalchemy import MetaData
from sqlmodel import SQLModel, create_engine

from manager.metrics.history import HistoryStore, MetricHistory, MinuteDownsampler, MinuteRow

MIGRATION = Path(__file__).resolve().parents[2] / "manager/migrations/versions/0002_metric_history.py"
T0 = 1_700_000_040.0  # a minute boundary


@pytest.fixture
def store(tmp_path) -> HistoryStore:
    engine = create_engine(f"sqlite:///{tmp_path / 'm.db'}")
    SQLModel.metadata.create_all(engine, tables=[MetricHistory.__table__])
    return HistoryStore(engine)


def test_one_row_per_minute_with_mean_min_and_max():
    ds = MinuteDownsampler()
    values = [float((i * 7) % 13) for i in range(180)]  # three minutes of 1 s samples
    rows = []
    for i, v in enumerate(values):
        rows += ds.add(T0 + i, {"host.cpu_pct": v, "gpu.0.power_w": None})
    rows += ds.add(T0 + 180, {})  # the next minute starts: the third one closes
    assert [r.minute for r in rows] == [T0, T0 + 60, T0 + 120]
    for k, row in enumerate(rows):
        minute = values[60 * k : 60 * (k + 1)]
        assert row.samples == 60
        assert row.mean == pytest.approx(sum(minute) / 60)
        assert (row.low, row.high) == (min(minute), max(minute))
    assert all(r.series == "host.cpu_pct" for r in rows)  # an all-n/a series makes no rows


def test_a_series_that_stops_is_closed_when_its_minute_ends():
    ds = MinuteDownsampler()
    ds.add(T0, {"worker.a.rss_bytes": 5.0})
    assert ds.add(T0 + 61, {"host.cpu_pct": 1.0}) == [MinuteRow("worker.a.rss_bytes", int(T0), 5.0, 5.0, 5.0, 1)]


def test_rows_survive_a_new_store_on_the_same_database(store):
    store.write([MinuteRow("host.ram_used_bytes", int(T0), 10.0, 8.0, 12.0, 60)])
    again = HistoryStore(store.engine)
    assert again.query("host.ram_used_bytes", T0 - 600) == [
        MinuteRow("host.ram_used_bytes", int(T0), 10.0, 8.0, 12.0, 60)
    ]
    assert again.query("host.cpu_pct", T0 - 600) == []


def test_a_minute_written_in_two_parts_is_merged_by_sample_count(store):
    # The manager stopped 20 s into a minute (flush) and wrote the other 40 s after its restart.
    store.write([MinuteRow("s", int(T0), 1.0, 0.5, 2.0, 20)])
    store.write([MinuteRow("s", int(T0), 4.0, 3.0, 9.0, 40)])
    (row,) = store.query("s", T0)
    assert row.samples == 60 and row.mean == pytest.approx((20 * 1.0 + 40 * 4.0) / 60)
    assert (row.low, row.high) == (0.5, 9.0)


def test_query_window_and_retention(store):
    day = 86400
    rows = [MinuteRow("s", int(T0 - d * day), float(d), float(d), float(d), 1) for d in range(10)]
    store.write(rows)
    assert [r.mean for r in store.query("s", T0 - 2.5 * day)] == [2.0, 1.0, 0.0]
    assert store.prune(now=T0) == 2  # days 8 and 9 are older than 7 days; day 7 is at the limit
    assert len(store.query("s", 0)) == 8
    short = HistoryStore(store.engine, retention_days=1)
    short.prune(now=T0)
    assert [r.mean for r in store.query("s", 0)] == [1.0, 0.0]


def test_retention_must_be_positive(store):
    with pytest.raises(ValueError, match="positive number of days"):
        HistoryStore(store.engine, retention_days=0)


def test_many_rows_are_written_in_batches_sqlite_accepts(store):
    rows = [MinuteRow(f"worker.w{i}.x", int(T0), 1.0, 1.0, 1.0, 1) for i in range(9000)]
    assert store.write(rows) == 9000
    assert len(store.series_names()) == 9000


def _load_migration():
    spec = importlib.util.spec_from_file_location("m0002", MIGRATION)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_migration_creates_exactly_the_model_table(tmp_path):
    module = _load_migration()
    assert (module.revision, module.down_revision) == ("0002_metric_history", "0001_initial")
    engine = create_engine(f"sqlite:///{tmp_path / 'mig.db'}")
    with engine.begin() as conn:
        ctx = MigrationContext.configure(conn)
        with Operations.context(ctx):
            module.upgrade()
        model = MetaData()
        MetricHistory.__table__.to_metadata(model)
        diffs = compare_metadata(MigrationContext.configure(conn), model)
    assert diffs == []
    HistoryStore(engine).write([MinuteRow("s", 60, 1.0, 1.0, 1.0, 1)])  # upsert needs the unique key
    HistoryStore(engine).write([MinuteRow("s", 60, 3.0, 3.0, 3.0, 1)])
    assert HistoryStore(engine).query("s", 0)[0].mean == 2.0


def test_the_managers_own_migrations_reach_the_history_table(tmp_path):
    db = pytest.importorskip("manager.db")
    engine = db.make_engine(tmp_path / "manager.db")
    db.migrate(engine)
    store = HistoryStore(engine)
    store.write([MinuteRow("host.cpu_pct", int(T0), 5.0, 1.0, 9.0, 60)])
    assert store.query("host.cpu_pct", T0)[0].high == 9.0
