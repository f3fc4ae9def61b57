"""An engine's output: a file per start (the engine writes it directly, so it outlives the manager),
tailed into an in-memory ring buffer that API calls and live streams read. Lines enter the ring with
the start's secrets hidden, so no reader (API, live stream, error summary) ever gets them."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
from collections import deque
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path

from manager.host.private_files import PRIVATE_DIR, open_private
from manager.launch.secrets import Redactor

KEEP_STARTS = 10  # log files kept per worker; older starts are deleted
MAX_LOG_BYTES = 64 << 20  # one start's file is rotated (copied to .1, then emptied) past this size
RING_LINES = 5000

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# vLLM's prefix: "(EngineCore pid=123) ERROR 11-21 03:40:01 [core.py:123] message"
_PREFIX = re.compile(r"^(\([\w.-]+(?: pid=\d+)?\)\s+)?(DEBUG|INFO|WARNING|ERROR|CRITICAL)\s+\S+\s+\S+\s+\[[^\]]*\]\s*")
_EXCEPTION = re.compile(r"^([A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt))(:\s.*)?$")
# Summaries vLLM prints after the real cause ("See root cause above"): quote the cause instead.
_WRAPPERS = (
    "see root cause above",
    "see stack trace for root cause",
    "engine core initialization failed",
    "initialization failed due to an exception in a background process",
)
_NOISE = ("Traceback (most recent call last)", 'File "', "^^^", "~~~", "raise ", "During handling")


def new_log_file(worker_dir: Path) -> Path:
    """A new, empty log file for one start, readable by the manager's user only."""
    worker_dir.mkdir(parents=True, exist_ok=True, mode=PRIVATE_DIR)
    old = sorted(worker_dir.glob("start-*.log"))
    for stale in old[: max(0, len(old) - (KEEP_STARTS - 1))]:
        stale.unlink(missing_ok=True)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S%f")
    path = worker_dir / f"start-{stamp}.log"
    open_private(path, os.O_WRONLY).close()
    return path


def clean(line: str) -> str:
    return _ANSI.sub("", line).rstrip()


def meaningful_error(lines: list[str]) -> str | None:
    """The line a person would quote as the reason an engine died: its last exception line; where vLLM
    ends with "see root cause above" (a start that failed), the first one, since what follows it is the
    cleanup failing in turn. Exceptions vLLM logs below ERROR (a missing optional extension, say) are
    not the reason."""
    stripped: list[str] = []
    quiet: set[int] = set()  # lines vLLM logged at DEBUG, INFO or WARNING
    for line in lines:
        text = clean(line)
        prefix = _PREFIX.match(text)
        text = _PREFIX.sub("", text).strip()
        if not text:
            continue
        if prefix and prefix.group(2) in ("DEBUG", "INFO", "WARNING"):
            quiet.add(len(stripped))
        stripped.append(text)
    exceptions = [
        i
        for i, line in enumerate(stripped)
        if i not in quiet and _EXCEPTION.match(line) and not line.startswith(_NOISE)
    ]
    causes = [i for i in exceptions if not any(w in stripped[i].lower() for w in _WRAPPERS)]
    if causes or exceptions:
        wrapped = len(causes) < len(exceptions)
        i = causes[0] if causes and wrapped else (causes or exceptions)[-1]
        line = stripped[i]
        if "validation error" in line and i + 1 < len(stripped):
            # pydantic puts the reason on the next line ("Value error, User-specified max_model_len ...
            # [type=value_error, input_value=...]"): vLLM's words, without pydantic's wrapping.
            what = line.rpartition(" validation error for ")[2] or "vLLM's config"
            reason = stripped[i + 1].removeprefix("Value error, ").rpartition(" [type=")
            line = f"{what} is invalid: {reason[0] or reason[2]}"
        return line
    for line in reversed(stripped):
        if ("error" in line.lower() or "failed" in line.lower()) and not line.startswith(_NOISE):
            return line
    return stripped[-1] if stripped else None


class LogTail:
    """Follows one worker's current log file; keeps the last lines and feeds live subscribers."""

    def __init__(self) -> None:
        self.ring: deque[str] = deque(maxlen=RING_LINES)
        self.path: Path | None = None
        self._offset = 0
        self._partial = ""
        self._secrets = Redactor()
        self._subscribers: set[asyncio.Queue[str]] = set()

    def follow(self, path: Path, from_start: bool = True, secrets: Redactor | None = None) -> None:
        """Tail `path` from now on; ``secrets``: what the start writing it must not show."""
        self.poll()  # keep what the previous file said up to now
        self.path = path
        self._secrets = secrets or Redactor()
        self._offset = 0 if from_start or not path.exists() else path.stat().st_size
        self._partial = ""

    def poll(self) -> list[str]:
        """Read what was appended since the last call; returns the new complete lines."""
        if self.path is None or not self.path.exists():
            return []
        with self.path.open("rb") as fh:
            fh.seek(self._offset)
            chunk = fh.read(4 << 20)
        if not chunk:
            return []
        self._offset += len(chunk)
        text = self._partial + chunk.decode("utf-8", errors="replace")
        *lines, self._partial = re.split(r"\r?\n|\r", text)
        lines = [self._secrets.text(clean(line)) for line in lines]
        for line in lines:
            self.ring.append(line)
            for queue in list(self._subscribers):
                if queue.qsize() < 10_000:
                    queue.put_nowait(line)
        return lines

    def cap_size(self, limit: int = MAX_LOG_BYTES) -> bool:
        """Rotate the current file once it is larger than `limit`: keep one previous part as .1.

        The engine appends (O_APPEND), so emptying the file in place is safe while it writes.
        """
        if self.path is None or not self.path.exists() or self.path.stat().st_size <= limit:
            return False
        self.poll()
        with self.path.open("rb") as current, open_private(self.path.with_suffix(".log.1")) as kept:
            shutil.copyfileobj(current, kept)
        with self.path.open("r+b") as fh:
            fh.truncate(0)
        self._offset = 0
        self._partial = ""
        return True

    def tail(self, n: int) -> list[str]:
        if n <= 0:
            return []
        return list(self.ring)[-n:]

    def latest(self) -> str | None:
        for line in reversed(self.ring):
            if line.strip():
                return _PREFIX.sub("", line).strip()
        return None

    def subscribe(self) -> asyncio.Queue[str]:
        queue: asyncio.Queue[str] = asyncio.Queue()
        self._subscribers.add(queue)
        return queue

    def unsubscribe(self, queue: asyncio.Queue[str]) -> None:
        self._subscribers.discard(queue)

    async def stream(self, tail: int) -> AsyncIterator[str]:
        """The last `tail` lines, then every new line as it is written, until the reader goes away."""
        queue = self.subscribe()
        try:
            for line in self.tail(tail):
                yield line
            while True:
                try:
                    line = await asyncio.wait_for(queue.get(), timeout=1.0)
                except TimeoutError:
                    self.poll()  # a stopped worker has no owner task reading its file
                    continue
                yield line
        finally:
            self.unsubscribe(queue)
