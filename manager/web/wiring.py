"""Connects the metrics library to the supervisor: the only place that knows both.

The collector wants ``WorkerInfo`` records; the supervisor publishes plain snapshots of its
workers. This adapter translates one into the other, so neither package imports the other.
"""

from __future__ import annotations

import os
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlalchemy.engine import Engine
from sqlmodel import select

from manager.db import session
from manager.metrics import HistoryStore, MetricsCollector, WorkerInfo
from manager.schemas.model_config import ModelConfig
from manager.settings import Settings


def worker_info(snapshot: dict[str, Any]) -> WorkerInfo:
    """One supervisor worker snapshot as the collector sees it."""
    started = snapshot.get("started_at")
    started_at = None
    if started and snapshot.get("state") == "ready":
        when = datetime.fromisoformat(started)
        started_at = (when if when.tzinfo else when.replace(tzinfo=UTC)).timestamp()
    run_dir = snapshot.get("run_dir")
    return WorkerInfo(
        id=str(snapshot["id"]),
        model=snapshot["model"],
        state=snapshot["state"],
        port=snapshot.get("port"),
        root_pid=snapshot.get("pid"),
        run_dir=Path(run_dir) if run_dir else None,
        restarts=int(snapshot.get("restart_count") or 0),
        started_at=started_at,
    )


def watched_disks(settings: Settings, engine: Engine) -> list[tuple[str, Path]]:
    """The data dir, the Hugging Face cache and the local model folders, one per filesystem."""
    candidates: list[tuple[str, Path]] = [("data", settings.data_dir)]
    hf_home = Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface"))
    candidates.append(("hf cache", hf_home))
    with session(engine) as db:
        for config in db.exec(select(ModelConfig)):
            if config.model.startswith(("/", "~", ".")):
                candidates.append((f"model {config.name}", Path(config.model).expanduser()))
    seen: set[int] = set()
    disks = []
    for label, path in candidates:
        try:
            device = path.stat().st_dev
        except OSError:
            continue  # a folder that is not there has no disk to watch
        if device not in seen:  # one card per filesystem, not one per folder on it
            seen.add(device)
            disks.append((label, path))
    return disks


def make_collector(settings: Settings, engine: Engine, supervisor) -> MetricsCollector:
    return MetricsCollector(
        lambda: [worker_info(s) for s in supervisor.list()],
        disks=watched_disks(settings, engine),
        history=HistoryStore(engine, retention_days=settings.metrics_retention_days),
    )
