"""One download, in its own process: ``python -m manager.hub.fetch_process`` reads what to fetch as JSON
on stdin and writes JSON lines on stdout: ``{"done": bytes}`` a few times a second, then one
``{"finished": snapshot_folder}`` or ``{"error": message, "status": http_status}``.

A process of its own, so that cancelling is ending it (huggingface_hub keeps the ``.incomplete``
files, and the next run resumes them), and so that the bytes it moves never hold the manager's
event loop. The token comes in the environment (``HF_TOKEN``), never in argv.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import sys
import threading
import time
from pathlib import Path
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
    with client.hub_errors(repo, request["commit"], token_sent=bool(client.token())):
        folder = snapshot_download(
            repo,
            revision=request["commit"],
            cache_dir=request["cache_dir"],
            allow_patterns=[glob.escape(name) for name in request["files"]],
            endpoint=client.endpoint(),
            token=client.token() or False,
            tqdm_class=Reporter,
            max_workers=int(request.get("workers", 8)),
        )
    remember_revision(request["cache_dir"], repo, request.get("revision"), request["commit"])
    forget_file_list(request["cache_dir"], repo, request["commit"])
    return folder


def forget_file_list(cache_dir: str, repo: str, commit: str) -> None:
    """Remove the list of the repo's files huggingface_hub keeps beside a download (``trees/<commit>.json``).
    Offline, snapshot_download calls a snapshot incomplete when a file of that list matching the pattern
    asked for is missing, and vLLM asks offline for every ``*.safetensors``: weights its index leaves out
    (not downloaded, never loaded) would fail the start. Without the list the check is not made; online,
    huggingface_hub lists the repo again."""
    with contextlib.suppress(OSError):
        (_repo_folder(cache_dir, repo) / "trees" / f"{commit}.json").unlink(missing_ok=True)


def _repo_folder(cache_dir: str, repo: str) -> Path:
    return Path(cache_dir) / ("models--" + repo.replace("/", "--"))


def remember_revision(cache_dir: str, repo: str, revision: str | None, commit: str) -> None:
    """Write the cache's ref from the revision asked for (``main``) to the commit downloaded. A download by
    commit writes none, and an engine started offline finds a model by its ref: without it vLLM fails
    with "Cannot find an appropriate cached snapshot folder"."""
    if not revision or revision == commit:
        return
    refs = _repo_folder(cache_dir, repo) / "refs"
    ref = refs / revision
    if ".." in Path(revision).parts or not ref.resolve().is_relative_to(refs.resolve()):
        return  # not a name a ref has; the hub answered for it, but nothing is written outside the cache
    ref.parent.mkdir(parents=True, exist_ok=True)
    tmp = ref.with_name(ref.name + ".tmp")
    tmp.write_text(commit)
    tmp.replace(ref)  # a reader never sees half a commit


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
