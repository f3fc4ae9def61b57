"""Metric history in SQLite: one row per series per minute (mean, min, max), kept 7 days by default.

The ring buffers hold the last hours at 1 s; this table is what lets the 24 h chart and the charts
after a restart exist. A minute is written once it is over; a partly written minute (the manager
stopped mid-minute, then started again) is merged into the stored row rather than duplicated.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import ClassVar

from sqlalchemy import Index, Table, UniqueConstraint, func
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine import Engine
from sqlmodel import Field, Session, SQLModel, col, delete, select

DEFAULT_RETENTION_DAYS = 7.0


class MetricHistory(SQLModel, table=True):
    """The table of revision 0002_metric_history; keep both in step."""

    __tablename__ = "metric_history"
    __table__: ClassVar[Table]  # set by SQLModel's metaclass, which does not declare it for type checkers
    __table_args__ = (
        UniqueConstraint("series", "minute", name="uq_metric_history_series_minute"),
        Index("ix_metric_history_minute", "minute"),  # retention deletes by age
    )

    id: int | None = Field(default=None, primary_key=True)
    series: str
    minute: int  # unix time (s) of the minute's start
    mean: float
    low: float
    high: float
    samples: int


@dataclass(frozen=True)
class MinuteRow:
    series: str
    minute: int
    mean: float
    low: float
    high: float
    samples: int


class _Acc:
    __slots__ = ("minute", "total", "n", "low", "high")

    def __init__(self, minute: int) -> None:
        self.minute, self.total, self.n = minute, 0.0, 0
        self.low, self.high = math.inf, -math.inf

    def add(self, v: float) -> None:
        self.total += v
        self.n += 1
        self.low = min(self.low, v)
        self.high = max(self.high, v)

    def row(self, series: str) -> MinuteRow:
        return MinuteRow(series, self.minute, self.total / self.n, self.low, self.high, self.n)


class MinuteDownsampler:
    """Turns 1 s samples into minute rows; ``add`` returns the rows of minutes that just ended."""

    def __init__(self) -> None:
        self._acc: dict[str, _Acc] = {}

    def add(self, t: float, values: Mapping[str, float | None]) -> list[MinuteRow]:
        minute = int(t // 60) * 60
        done = self._close_before(minute)
        for name, value in values.items():
            if value is None or math.isnan(value):
                continue  # n/a is a gap, not a zero
            acc = self._acc.get(name)
            if acc is None:
                acc = self._acc[name] = _Acc(minute)
            acc.add(float(value))
        return done

    def _close_before(self, minute: int) -> list[MinuteRow]:
        # Also closes series that got no value this tick (a worker that stopped).
        done = [acc.row(name) for name, acc in self._acc.items() if acc.minute < minute]
        for row in done:
            del self._acc[row.series]
        return done

    def partial(self, series: str) -> MinuteRow | None:
        """The minute in progress, for charts that want the newest point before it is stored."""
        acc = self._acc.get(series)
        return acc.row(series) if acc else None

    def flush(self) -> list[MinuteRow]:
        """Everything in progress (at shutdown); the stored rows are merged with later ones."""
        done = [acc.row(name) for name, acc in self._acc.items()]
        self._acc.clear()
        return done


class HistoryStore:
    """Reads and writes ``metric_history``. Blocking: call it from a thread, not the event loop."""

    def __init__(self, engine: Engine, *, retention_days: float = DEFAULT_RETENTION_DAYS) -> None:
        if retention_days <= 0:
            raise ValueError(f"metrics retention must be a positive number of days, got {retention_days}")
        self.engine = engine
        self.retention_s = retention_days * 86400.0

    def write(self, rows: Iterable[MinuteRow]) -> int:
        rows = list(rows)
        with self.engine.begin() as conn:
            # SQLite allows 32766 bound parameters per statement; 6 per row.
            for i in range(0, len(rows), 4000):
                conn.execute(_upsert(rows[i : i + 4000]))
        return len(rows)

    def query(self, series: str, since: float, until: float | None = None) -> list[MinuteRow]:
        """Rows of ``series`` whose minute starts in [since, until], oldest first."""
        with Session(self.engine) as session:
            q = select(MetricHistory).where(
                MetricHistory.series == series, MetricHistory.minute >= int(since // 60) * 60
            )
            if until is not None:
                q = q.where(MetricHistory.minute <= until)
            q = q.order_by(col(MetricHistory.minute))
            return [MinuteRow(r.series, r.minute, r.mean, r.low, r.high, r.samples) for r in session.exec(q)]

    def series_names(self) -> list[str]:
        with Session(self.engine) as session:
            return list(session.exec(select(MetricHistory.series).distinct()))

    def prune(self, now: float) -> int:
        """Delete rows older than the retention; returns how many went."""
        cutoff = now - self.retention_s
        with Session(self.engine) as session:
            result = session.exec(delete(MetricHistory).where(col(MetricHistory.minute) < cutoff))
            session.commit()
            return result.rowcount or 0


def _upsert(rows: list[MinuteRow]):
    table = MetricHistory.__table__
    stmt = sqlite_insert(table).values(
        [
            {
                "series": r.series,
                "minute": r.minute,
                "mean": r.mean,
                "low": r.low,
                "high": r.high,
                "samples": r.samples,
            }
            for r in rows
        ]
    )
    new = stmt.excluded
    return stmt.on_conflict_do_update(
        index_elements=["series", "minute"],
        set_={
            # Weighted by sample count: a minute written in two parts (a restart) averages right.
            "mean": (table.c.mean * table.c.samples + new.mean * new.samples) / (table.c.samples + new.samples),
            # SQLite's two-argument min()/max() are scalar functions, not the aggregates.
            "low": func.min(table.c.low, new.low),
            "high": func.max(table.c.high, new.high),
            "samples": table.c.samples + new.samples,
        },
    )
