"""What the dashboard's SSE stream sends: HTML fragments and one small JSON per snapshot.

Fragments are rendered once per snapshot, however many browsers are connected: the cache is keyed
by the snapshot's sequence number and dropped when a newer one arrives. Every message carries the
snapshot's sample time (JSON ``taken_at`` or ``data-taken-at``) so a page, and the SSE bench, can
tell how old its data is.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from typing import Any, NamedTuple

from manager.metrics import Snapshot, WorkerMetrics
from manager.web.render import render

Event = tuple[str, str]  # (SSE event name, data)
# What the snapshot tells of a download: its progress, never its cache path, error text or anything else.
DOWNLOAD_FIELDS = ("id", "repo", "revision", "state", "percent", "done_bytes", "total_bytes", "rate_bps", "eta_s")
ENDED_SHOWN_S = 60.0  # a download that ended stays in the snapshot this long, so a reader sees how it ended


def worker_signature(snap: Snapshot) -> tuple:
    """What decides the worker cards' frame (buttons, state badge); numbers change inside it. A download's
    state line is redrawn at each percent (not at each second of its time left)."""
    return tuple((w.id, w.state, w.model, w.port, w.download_percent) for w in snap.workers)


def chart_payload(snap: Snapshot, downloads: Iterable[dict[str, Any]] = ()) -> dict[str, Any]:
    """The JSON the charts and the staleness check read: series values by name, as in history; and the
    downloads under way (or ended in the last minute) with their progress."""
    return {
        "seq": snap.seq,
        "taken_at": snap.taken_at,
        "gpu_available": snap.gpu.available,
        "workers": [{"id": w.id, "model": w.model, "state": w.state} for w in snap.workers],
        "series": snap.series_values(),
        "downloads": download_progress(downloads, datetime.fromtimestamp(snap.taken_at, UTC)),
    }


def download_progress(rows: Iterable[dict[str, Any]], now: datetime) -> list[dict[str, Any]]:
    """The downloads as the API lists them, cut to their progress: those queued or running, and those
    that ended less than ENDED_SHOWN_S before ``now``."""
    shown = []
    for row in rows:
        ended = row.get("finished_at")
        if ended is not None and (now - _utc(ended)).total_seconds() > ENDED_SHOWN_S:
            continue
        shown.append({key: row.get(key) for key in DOWNLOAD_FIELDS})
    return shown


def _utc(value: str | datetime) -> datetime:
    moment = datetime.fromisoformat(value) if isinstance(value, str) else value
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


class LiveViews:
    """Renders the stream's messages; ``model_names`` lists model configs for the Switch menus,
    ``downloads`` the Hub downloads with their progress (and a number that changes with them)."""

    def __init__(
        self,
        model_names: Callable[[], list[str]],
        downloads: Callable[[], tuple[int, list[dict[str, Any]]]] | None = None,
    ) -> None:
        self._model_names = model_names
        self._downloads = downloads
        self._seq: int | None = None
        self._cache: dict[Any, Any] = {}

    def _once(self, snap: Snapshot, key: Any, make: Callable[[], Any]) -> Any:
        if snap.seq != self._seq:
            self._seq, self._cache = snap.seq, {}
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]

    def snapshot_event(self, snap: Snapshot) -> Event:
        def make() -> Event:
            _, downloads = self._downloads() if self._downloads is not None else (0, [])
            return "snapshot", json.dumps(chart_payload(snap, downloads), separators=(",", ":"))

        return self._once(snap, "json", make)

    def overview(self, snap: Snapshot) -> list[Event]:
        """Everything the overview page swaps each second (not the worker cards' frame)."""

        def make() -> list[Event]:
            events = [
                ("gpus", render("fragments/gpus.html", snap=snap)),
                ("host", render("fragments/host.html", snap=snap)),
            ]
            for w in snap.workers:
                events.append((f"worker-{w.id}", render("fragments/worker_stats.html", w=w, snap=snap)))
            return events

        return [self.snapshot_event(snap), *self._once(snap, "overview", make)]

    def worker_cards(self, snap: Snapshot) -> Event:
        """The worker cards with their buttons; sent when a worker appears, goes or changes state."""
        return self._once(
            snap,
            "cards",
            lambda: (
                "worker-cards",
                render("fragments/worker_cards.html", snap=snap, model_names=self._model_names()),
            ),
        )

    def worker_detail(self, snap: Snapshot, worker_id: str) -> list[Event]:
        """The worker page: its state line and its engine's and pools' numbers."""
        w = find_worker(snap, worker_id)

        def make() -> list[Event]:
            return [
                ("worker-head", render("fragments/worker_head.html", w=w, snap=snap)),
                ("worker-engine", render("fragments/worker_engine.html", w=w, snap=snap)),
            ]

        return [self.snapshot_event(snap), *self._once(snap, ("detail", worker_id), make)]

    def downloads_table(self) -> str:
        """The downloads table as the Models on disk page shows it at first load."""
        _, rows = self._downloads() if self._downloads is not None else (0, [])
        return render("fragments/downloads.html", downloads=rows)

    def disk(self, sent: DiskSent | None) -> tuple[DiskSent, list[Event]]:
        """What the Models on disk page gets now, given ``sent`` (what the last call returned): the
        downloads table when the downloads moved, and ``disk-changed`` when one started or ended since,
        so that the page reloads its list of models (the list shows paths only some readers may see,
        so the page asks for it, with its own credentials)."""
        version, rows = self._downloads() if self._downloads is not None else (0, [])
        if sent is not None and sent.version == version:
            return sent, []
        now = DiskSent(version, tuple((row["id"], row["state"]) for row in rows))
        events = [("downloads", render("fragments/downloads.html", downloads=rows))]
        if sent is not None and sent.states != now.states:
            events.append(("disk-changed", str(version)))  # an event with no data is never dispatched
        return now, events


class DiskSent(NamedTuple):
    """What the Models on disk page was sent last: the downloads' version, and each one's state."""

    version: int
    states: tuple[tuple[int, str], ...]


def find_worker(snap: Snapshot, worker_id: str) -> WorkerMetrics | None:
    return next((w for w in snap.workers if w.id == worker_id), None)
