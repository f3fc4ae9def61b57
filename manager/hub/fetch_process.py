"""One download, in its own process: ``python -m manager.hub.fetch_process`` reads what to fetch as JSON
on stdin and writes JSON lines on stdout: ``{"done": bytes}`` a few times a second, then one
``{"finished": snapshot_folder}`` or ``{"error": message, "status": http_status}``.

A process of its own, so that cancelling is ending it (huggingface_hub keeps the ``.incomplete``
files, and the next run resumes them), and so that the bytes it moves never hold the manager's
event loop. The token comes in the environment (``HF_TOKEN``), never in argv.
"""

from __future__ import annotations

import glob
import json
import os
import sys
import threading
import time
from typing import Any

from manager.errors import ManagerError
from manager.hub import client

EVERY_S = 0.25  # progress lines at most 4 times a second


class Reporter:
    """Takes the place of tqdm in huggingface_hub's snapshot_download: of its byte bars, the one that
    counts bytes on disk (resumed bytes included) is the largest; that is the progress."""

    lock = threading.Lock()
    bars: list[Reporter] = []
    reporting = threading.Lock()
    sent = -1  # the count last reported

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.unit = kwargs.get("unit", "it")
        self.total = kwargs.get("total")
        self.n = kwargs.get("initial", 0) or 0
        self.desc = kwargs.get("desc", "")
        if self.unit == "B":
            with Reporter.lock:
                Reporter.bars.append(self)

    def update(self, n: float | None = 1) -> None:
        self.n += n or 0

    def update_transfer(self, n: float | None = 1) -> None:
        pass  # network bytes; the bytes written are what the user waits for

    @classmethod
    def done(cls) -> int:
        with cls.lock:
            return int(max((bar.n for bar in cls.bars), default=0))

    @classmethod
    def report(cls) -> None:
        """The count, when it changed since it was last reported."""
        with cls.reporting:
            done = cls.done()
            if done != cls.sent:
                cls.sent = done
                emit({"done": done})

    @classmethod
    def report_every(cls, seconds: float) -> None:
        """Report from a clock, not from each update: the bytes of the last update before a pause (a
        slow or stalled connection; the bytes come 10 MiB at a time) are shown then, not at the next one."""

        def tick() -> None:
            while True:
                time.sleep(seconds)
                cls.report()

        threading.Thread(target=tick, daemon=True, name="progress").start()

    # What else snapshot_download and its thread map call on a bar.
    def __enter__(self) -> Reporter:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def __iter__(self):
        return iter(())

    def close(self) -> None:
        pass

    def refresh(self, *args: Any, **kwargs: Any) -> None:
        pass

    def set_description(self, *args: Any, **kwargs: Any) -> None:
        pass

    def set_description_str(self, *args: Any, **kwargs: Any) -> None:
        pass

    def set_postfix_str(self, *args: Any, **kwargs: Any) -> None:
        pass

    def set_transfer_postfix_str(self, *args: Any, **kwargs: Any) -> None:
        pass


_writing = threading.Lock()


def emit(message: dict[str, Any]) -> None:
    with _writing:  # the progress clock and the main thread both write; a line is never cut by another
        sys.stdout.write(json.dumps(message) + "\n")
        sys.stdout.flush()


def fetch(request: dict[str, Any]) -> str:
    from huggingface_hub import snapshot_download

    repo = request["repo"]
    with client.hub_errors(repo, request["commit"]):
        return snapshot_download(
            repo,
            revision=request["commit"],
            cache_dir=request["cache_dir"],
            allow_patterns=[glob.escape(name) for name in request["files"]],
            endpoint=client.endpoint(),
            token=client.token() or False,
            tqdm_class=Reporter,
            max_workers=int(request.get("workers", 8)),
        )


def end_with_parent() -> None:
    """A manager killed outright leaves this process to init: it stops then, and the manager, started
    again, goes on with the download itself (two writers of one file would wait on each other's lock)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(3)

    threading.Thread(target=watch, daemon=True, name="parent-watch").start()


def main() -> int:
    end_with_parent()
    request = json.loads(sys.stdin.read())
    Reporter.report_every(EVERY_S)
    try:
        folder = fetch(request)
    except ManagerError as exc:
        emit({"error": exc.message, "status": exc.status})
        return 1
    except OSError as exc:  # the disk filled up, the cache is not writable
        emit({"error": f"writing into {request['cache_dir']} failed: {exc.strerror or exc}", "status": 507})
        return 1
    Reporter.report()
    emit({"finished": folder})
    return 0


if __name__ == "__main__":
    sys.exit(main())
