"""The stats channel: each engine process writes ``{run_dir}/stats-{pid}.json``.

Writers call ``publish(section, values)``; the file is replaced atomically (tmp + rename) at most
once a second, by a small daemon thread, so a hot path can publish as often as it likes. The
manager reads the files with ``read_stats(run_dir)``. No torch, no vllm.

File shape: ``{"pid": 123, "role": "worker", "updated_at": 1732150000.1,
"pinned": {...}, "lora_pool": {...}, "expert_cache": {...}}``.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import threading
import time
from pathlib import Path
from typing import Any

logger = logging.getLogger("engine_patches.stats")

RESERVED = ("pid", "role", "updated_at")
MIN_INTERVAL_S = 1.0


def _guess_role() -> str:
    # vLLM names its engine-core process "EngineCore_DP0" and workers "VllmWorker-N"; the
    # API server is the main process.
    name = multiprocessing.current_process().name
    if name == "MainProcess":
        return "api_server"
    if "EngineCore" in name:
        return "engine_core"
    if "Worker" in name:
        return "worker"
    return name


class _Channel:
    """Per-process state; rebuilt after a fork because the pid changes."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.pid = os.getpid()
        self.run_dir: Path | None = None
        self.role = _guess_role()
        self.sections: dict[str, dict[str, Any]] = {}
        self.dirty = False
        self.last_write = 0.0
        self.thread: threading.Thread | None = None
        self.interval = MIN_INTERVAL_S


_channel = _Channel()
_channel_lock = threading.Lock()


def _current() -> _Channel:
    global _channel
    if _channel.pid != os.getpid():
        with _channel_lock:
            if _channel.pid != os.getpid():
                old = _channel
                _channel = _Channel()
                _channel.run_dir = old.run_dir
                _channel.interval = old.interval
    return _channel


def configure(
    run_dir: str | os.PathLike[str] | None, *, role: str | None = None, interval_s: float = MIN_INTERVAL_S
) -> None:
    """Set where this process publishes; ``None`` keeps stats in memory only."""
    ch = _current()
    with ch.lock:
        ch.run_dir = Path(run_dir) if run_dir else None
        ch.interval = max(interval_s, 0.0)
        if role:
            ch.role = role
        ch.dirty = True
    _ensure_writer(ch)


def publish(section: str, values: dict[str, Any]) -> None:
    """Replace one section (e.g. "pinned", "lora_pool", "expert_cache") of this process's stats.

    ``values`` must be JSON-serialisable. Cheap: the write happens later, on the writer thread.
    """
    if section in RESERVED:
        raise ValueError(f"stats section may not be named {section!r}")
    ch = _current()
    with ch.lock:
        ch.sections[section] = dict(values)
        ch.dirty = True
    _ensure_writer(ch)


def snapshot() -> dict[str, Any]:
    """What this process would write now (also used by tests and flush())."""
    ch = _current()
    with ch.lock:
        doc: dict[str, Any] = {"pid": ch.pid, "role": ch.role, "updated_at": time.time()}
        doc.update({k: dict(v) for k, v in ch.sections.items()})
    return doc


def stats_path(run_dir: str | os.PathLike[str], pid: int | None = None) -> Path:
    return Path(run_dir) / f"stats-{pid or os.getpid()}.json"


def flush() -> Path | None:
    """Write the file now (at exit, or in tests); returns its path, or None with no run_dir."""
    ch = _current()
    if ch.run_dir is None:
        return None
    doc = snapshot()
    path = stats_path(ch.run_dir, ch.pid)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        ch.run_dir.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(doc, sort_keys=True))
        os.replace(tmp, path)  # readers never see a half-written file
    except OSError as exc:
        logger.warning("could not write stats file %s: %s", path, exc)
        return None
    with ch.lock:
        ch.dirty = False
        ch.last_write = time.monotonic()
    return path


def _ensure_writer(ch: _Channel) -> None:
    if ch.run_dir is None or (ch.thread is not None and ch.thread.is_alive()):
        return
    with ch.lock:
        if ch.thread is not None and ch.thread.is_alive():
            return
        ch.thread = threading.Thread(target=_writer_loop, args=(ch,), name="engine-patches-stats", daemon=True)
        ch.thread.start()


def _writer_loop(ch: _Channel) -> None:
    while ch.pid == os.getpid():
        time.sleep(min(0.1, ch.interval) or 0.1)
        due = time.monotonic() - ch.last_write >= ch.interval
        if ch.dirty and due and ch.run_dir is not None:
            flush()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True


def read_stats(run_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Stats of the live engine processes under ``run_dir``, sorted by pid.

    Files of processes that are gone and files that do not parse (being replaced, or foreign)
    are skipped, never raised.
    """
    folder = Path(run_dir)
    if not folder.is_dir():
        return []
    found = []
    for path in folder.glob("stats-*.json"):
        try:
            pid = int(path.stem.split("-", 1)[1])
        except (IndexError, ValueError):
            continue
        if not _pid_alive(pid):
            continue
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(doc, dict) and doc.get("pid") == pid:
            found.append(doc)
    return sorted(found, key=lambda d: d["pid"])
