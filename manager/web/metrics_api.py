"""HTTP for live metrics: the manager's Prometheus endpoint, a JSON snapshot, chart history, and
the dashboard's SSE stream. Translation only; the numbers come from manager.metrics."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from fnmatch import fnmatchcase
from typing import Annotated, Any, Literal

from fastapi import APIRouter, HTTPException, Query, Response
from fastapi.concurrency import run_in_threadpool
from pydantic import Field
from sse_starlette.sse import EventSourceResponse

from manager.deps import MetricsDep, RuntimeDep, SettingsDep
from manager.openapi import EVENT_STREAM, errors
from manager.web.live import worker_signature
from manager.web.live_dep import LiveViewsDep

router = APIRouter(tags=["metrics"])

WINDOWS = {"15m": 900, "1h": 3600, "24h": 86400}
MAX_SERIES = 64  # a chart with more lines is unreadable; a glob that matches more is a mistake
_WINDOW = re.compile(r"^(\d+(?:\.\d+)?)([smhd]?)$")
_UNIT_S = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}
# What the schema states of a window and a series pattern; parse_window and the route check them with
# messages that say what is accepted.
WINDOW_FORMAT = r"^\s*\d+(\.\d+)?[smhdSMHD]?\s*$"
SeriesPattern = Annotated[str, Field(json_schema_extra={"pattern": r"[^,\s]"})]


def parse_window(text: str, longest_s: float) -> float:
    """'15m', '1h', '24h', '7d' or plain seconds; raises ValueError with what is accepted."""
    match = _WINDOW.match(text.strip().lower())
    if not match:
        raise ValueError(f"window {text!r} is not a duration: use seconds or a number with s, m, h or d (15m, 1h, 24h)")
    seconds = float(match.group(1)) * _UNIT_S[match.group(2)]
    if seconds <= 0:
        raise ValueError("window must be longer than 0 s")
    if seconds > longest_s:
        raise ValueError(
            f"window {text!r} is longer than the history kept ({longest_s / 86400:g} days); "
            "raise VLLM_MANAGER_METRICS_RETENTION_DAYS to keep more"
        )
    return seconds


def match_series(patterns: list[str], known: list[str]) -> tuple[list[str], list[str]]:
    """Series names matching any pattern (exact names or globs such as worker.*.kv_cache_usage_pct),
    and the patterns that matched nothing."""
    names: list[str] = []
    unmatched: list[str] = []
    for pattern in patterns:
        hits = [n for n in known if fnmatchcase(n, pattern)]
        if not hits:
            unmatched.append(pattern)
        names.extend(n for n in hits if n not in names)
    return names, unmatched


@router.get("/metrics", include_in_schema=False)
def prometheus(runtime: RuntimeDep) -> Response:
    """Worker states and restarts, GPU and host gauges, for Prometheus and Grafana."""
    exposition = runtime.exposition
    return Response(exposition.render(), media_type=exposition.content_type)


@router.get("/api/metrics", responses=errors(503, _503="The first metrics sample is not taken yet"))
def snapshot(collector: MetricsDep) -> Response:
    """The latest sample of every GPU, the host and each worker, as one JSON object."""
    latest = collector.latest
    if latest is None:
        raise HTTPException(503, "the first metrics sample is not taken yet; try again in a second")
    return Response(latest.json, media_type="application/json")


@router.get("/api/metrics/series")
async def series_names(collector: MetricsDep) -> list[str]:
    """Names accepted by /api/metrics/history (live ones and those still in the history)."""
    return await run_in_threadpool(collector.known_series)


@router.get("/api/metrics/history")
async def history(
    collector: MetricsDep,
    settings: SettingsDep,
    series: Annotated[
        list[SeriesPattern],
        Query(description="names or globs, e.g. worker.*.kv_cache_usage_pct; several in one, comma-separated"),
    ],
    window: Annotated[
        str,
        Query(
            description="15m, 1h, 24h, 7d or seconds: longer than 0 and at most the history kept",
            json_schema_extra={"pattern": WINDOW_FORMAT},
        ),
    ] = "15m",
) -> dict:
    """Points of each series over the window: 1 s apart up to 1 h, one per minute beyond."""
    retention_s = settings.metrics_retention_days * 86400
    try:
        window_s = parse_window(window, retention_s)
    except ValueError as exc:
        raise HTTPException(422, str(exc)) from exc
    patterns = [p.strip() for item in series for p in item.split(",") if p.strip()]
    if not patterns:
        raise HTTPException(422, "give at least one series name, e.g. series=host.ram_used_bytes")

    def read() -> dict:
        names, unmatched = match_series(patterns, collector.known_series())
        if len(names) > MAX_SERIES:
            raise HTTPException(422, f"{len(names)} series match; narrow the pattern to at most {MAX_SERIES}")
        return {
            "window_s": window_s,
            "series": {n: collector.points(n, window_s) for n in names},
            "unmatched": unmatched,
        }

    return await run_in_threadpool(read)


@router.get("/api/metrics/stream", response_class=EventSourceResponse, responses=EVENT_STREAM)
async def stream(
    collector: MetricsDep,
    views: LiveViewsDep,
    view: Literal["overview", "worker", "disk"] = "overview",
    worker: str | None = None,
) -> EventSourceResponse:
    """Server-sent events, once a second: a JSON ``snapshot`` for the charts (with ``downloads``: each
    download from the Hub under way, or ended in the last minute, as id, repo, revision, state, percent,
    done_bytes, total_bytes, rate_bps and eta_s) and HTML fragments for the page (``view=overview``, or
    ``view=worker&worker=ID`` for one worker's page); ``view=disk``
    sends the ``downloads`` table whenever a download moves (at most once a second), and ``disk-changed``
    when one starts or ends (the models on disk change then)."""
    if view == "worker" and not worker:
        raise HTTPException(422, "view=worker needs worker=<id>")

    async def messages() -> AsyncIterator[dict[str, Any]]:
        cards_sent = None
        first = True
        disk_sent = None
        async for snap in collector.broadcast.subscribe():
            if view == "disk":
                disk_sent, events = views.disk(disk_sent)
                if not events:
                    continue
            elif view == "worker":
                events = views.worker_detail(snap, worker or "")
            else:
                events = views.overview(snap)
                signature = worker_signature(snap)
                if signature != cards_sent:  # frames first, so the numbers have somewhere to go
                    events = [events[0], views.worker_cards(snap), *events[1:]]
                    cards_sent = signature
            for name, data in events:
                message: dict[str, Any] = {"event": name, "data": data}
                if first:  # a browser whose connection drops retries after 1 s, not 3
                    message["retry"] = 1000
                    first = False
                yield message

    return EventSourceResponse(messages(), ping=15, send_timeout=10)
