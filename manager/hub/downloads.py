"""Downloads from the Hugging Face Hub into the cache the engines read: planned (which files, how many
bytes, room on the disk) before a byte is fetched, one process each, progress a few times a second,
cancel and resume, and carried on after a restart of the manager.

Resuming keeps every file already complete; a file cut short starts again (huggingface_hub 2.4 writes
each attempt to a file of its own and does not reuse a partial one), and the partial files a cancelled
or killed download leaves are removed.

This is the one owner of download rows: a row's state changes here only. Two callers that need the
same repo in the same cache share one download.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from sqlalchemy.engine import Engine
from sqlmodel import col, select

from manager.db import session
from manager.errors import Conflict, ManagerError, NotFound
from manager.hub import client
from manager.hub.download_plan import plan_download, refuse_if_no_room
from manager.hub.fetching import FetchFailed, Progress
from manager.hub.model_location import engine_cache, not_cached
from manager.schemas.common import utcnow
from manager.schemas.download import UNFINISHED, Download, DownloadState

log = logging.getLogger("vllm_manager.downloads")
GiB = 1024**3
RATE_WINDOW_S = 5.0  # the rate shown is over this many seconds
KEEP_FINISHED = 50  # finished downloads listed; older rows stay in the store


@dataclass
class _Run:
    """A download under way: its process and the figures it reports."""

    process: asyncio.subprocess.Process | None = None
    token: str | None = None  # the HF_TOKEN its process was given
    base_bytes: int = 0  # complete before this run: the process counts only what it writes
    done_bytes: int = 0
    samples: list[tuple[float, int]] = field(default_factory=list)
    finished: asyncio.Event = field(default_factory=asyncio.Event)
    cancelled: bool = False
    superseded: bool = False  # ended to run again with a token; the row goes on

    def saw(self, done: int, now: float) -> None:
        self.done_bytes = self.base_bytes + done
        self.samples = [s for s in self.samples if now - s[0] <= RATE_WINDOW_S] + [(now, self.done_bytes)]

    def rate_at(self, now: float) -> float | None:
        """Bytes a second over the last seconds up to ``now``: a stalled download's rate falls to 0 instead
        of showing its last speed. None until a second has passed."""
        recent = [s for s in self.samples if now - s[0] <= RATE_WINDOW_S]
        if not recent:
            return 0.0 if self.samples else None
        first = recent[0]
        if now - first[0] < 1.0:
            return None
        return (self.done_bytes - first[1]) / (now - first[0])


class Downloads:
    """Every download the manager runs (``python -m manager.hub.fetch_process`` each)."""

    def __init__(
        self,
        engine: Engine,
        logs_dir: Path,
        record: Callable[..., object] | None = None,
        python: str = sys.executable,
    ) -> None:
        self._engine = engine
        self._logs = logs_dir / "downloads"
        self._record = record  # the event log: started, finished, failed, cancelled
        self._python = python
        self._runs: dict[int, _Run] = {}
        self._tasks: set[asyncio.Task] = set()
        self._lock = asyncio.Lock()
        self._closing = False
        self.version = 0  # goes up on every change a page shows

    # ---- start, join, cancel, resume ---------------------------------------------------------------
    async def start(self, repo: str, revision: str | None = None, env: Mapping[str, str] | None = None) -> Download:
        """A download of ``repo`` into the cache of an engine with ``env`` (default: the manager's), or the
        one of it already under way there."""
        env = dict(env or {})
        client.check_repo_id(repo)
        client.refuse_if_offline(repo, "download")
        cache = engine_cache(env)
        plan = await asyncio.to_thread(plan_download, repo, revision, env, cache)
        async with self._lock:
            running = self._unfinished(repo, cache, plan.listing.commit)
            if running is not None:
                await self._give_token(running, env)
                return running
            refuse_if_no_room(plan)
            with session(self._engine) as db:
                row = Download(
                    repo=repo,
                    revision=plan.listing.revision,
                    commit=plan.listing.commit,
                    cache_dir=str(cache),
                    files=[f.path for f in plan.files],
                    total_bytes=plan.total_bytes,
                    done_bytes=plan.present_bytes,
                )
                db.add(row)
                db.commit()
                db.refresh(row)
            self._launch(row, env)
        self._note("download", f"downloading {repo} ({plan.needed_bytes / GiB:.2f} GiB) into {cache}", row)
        return row

    async def cancel(self, download_id: int) -> Download:
        row = self.get(download_id)
        run = self._runs.get(download_id)
        if row.state not in UNFINISHED:
            raise Conflict(
                f"download {download_id} of {row.repo} is {row.state.value}; only a running one can be cancelled"
            )
        if run is not None:
            run.cancelled = True
            if run.process is not None and run.process.returncode is None:
                run.process.kill()
            await run.finished.wait()
        else:
            self._finish(download_id, DownloadState.CANCELLED, None)
        return self.get(download_id)

    async def resume(self, download_id: int, env: Mapping[str, str] | None = None) -> Download:
        """Go on with a cancelled or failed download, from the bytes already on disk."""
        row = self.get(download_id)
        if row.state in UNFINISHED or row.state == DownloadState.DONE:
            raise Conflict(
                f"download {download_id} of {row.repo} is {row.state.value}; only a cancelled or failed one resumes"
            )
        async with self._lock:
            other = self._unfinished(row.repo, Path(row.cache_dir), row.commit)
            if other is not None:
                return other
            row = self._set(download_id, state=DownloadState.QUEUED, error=None, finished_at=None)
            self._launch(row, dict(env or {}))
        return row

    async def open(self) -> None:
        """After a restart: downloads that were under way go on (huggingface_hub resumes their files)."""
        with session(self._engine) as db:
            rows = list(db.exec(select(Download).where(col(Download.state).in_(list(UNFINISHED)))))
        for row in rows:
            log.info("download %s of %s goes on after the restart", row.id, row.repo)
            self._launch(row, {})

    async def close(self) -> None:
        """Stop the processes, leaving their rows unfinished: the next start of the manager goes on."""
        self._closing = True
        for run in self._runs.values():
            if run.process is not None and run.process.returncode is None:
                run.process.terminate()
        _, late = await asyncio.wait(self._tasks, timeout=10) if self._tasks else (set(), set())
        for task in late:
            task.cancel()
        await asyncio.gather(*late, return_exceptions=True)

    # ---- reading -----------------------------------------------------------------------------------
    def get(self, download_id: int) -> Download:
        with session(self._engine) as db:
            row = db.get(Download, download_id)
        if row is None:
            raise NotFound(f"no download {download_id}")
        return self._live(row)

    def unfinished(self) -> list[Download]:
        """Every download queued or running, however many finished since."""
        with session(self._engine) as db:
            rows = list(db.exec(select(Download).where(col(Download.state).in_(list(UNFINISHED)))))
        return [self._live(r) for r in rows]

    def list(self) -> list[Download]:
        with session(self._engine) as db:
            rows = list(db.exec(select(Download).order_by(col(Download.id).desc()).limit(KEEP_FINISHED)))
        return [self._live(r) for r in rows]

    def rate(self, download_id: int) -> float | None:
        run = self._runs.get(download_id)
        return run.rate_at(time.monotonic()) if run is not None else None

    # ---- what a start needs (manager.hub.fetching.Fetcher) -----------------------------------------
    def needed(self, model: str, env: Mapping[str, str]) -> bool:
        return model.count("/") == 1 and not_cached(model, env) is not None

    async def fetch(self, model: str, env: Mapping[str, str]) -> None:
        try:
            row = await self.start(model, None, env)
        except ManagerError as exc:  # gated, no room, offline, no such repo: the worker's reason
            raise FetchFailed(exc.message) from exc
        assert row.id is not None
        row = await self.wait(row.id)
        if row.state != DownloadState.DONE:
            raise FetchFailed(row.error or f"the download of {model} was {row.state.value}")

    def progress(self, model: str, env: Mapping[str, str]) -> Progress | None:
        cache = str(engine_cache(env))
        for download_id, run in self._runs.items():
            row = self.get(download_id)
            if row.repo == model and row.cache_dir == cache and row.state in UNFINISHED:
                return Progress(row.repo, row.done_bytes, row.total_bytes, run.rate_at(time.monotonic()))
        return None

    async def wait(self, download_id: int) -> Download:
        while (run := self._runs.get(download_id)) is not None:
            await run.finished.wait()
            if self._runs.get(download_id) is run:  # ended for good (or the manager is closing)
                break
        return self.get(download_id)

    async def _give_token(self, row: Download, env: Mapping[str, str]) -> None:
        """A download carried on after a restart runs without the token of the config that began it
        (tokens are never stored): a caller that brings one runs it again with it, from the files complete."""
        run = self._runs.get(row.id or 0)
        token = client.token(env)
        if run is None or run.token or not token:
            return
        log.info("download %s of %s goes on with the HF_TOKEN of its caller", row.id, row.repo)
        run.superseded = True
        if run.process is not None and run.process.returncode is None:
            run.process.kill()
        await run.finished.wait()
        self._launch(row, env)

    # ---- the processes -----------------------------------------------------------------------------
    def _launch(self, row: Download, env: Mapping[str, str]) -> None:
        assert row.id is not None
        run = _Run(base_bytes=_complete_bytes(row), token=client.token(env))
        run.done_bytes = run.base_bytes
        self._runs[row.id] = run
        task = asyncio.get_running_loop().create_task(self._run(row, env, run), name=f"download-{row.id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        self.version += 1

    async def _run(self, row: Download, env: Mapping[str, str], run: _Run) -> None:
        assert row.id is not None
        download_id = row.id
        request = {
            "repo": row.repo,
            "revision": row.revision,
            "commit": row.commit,
            "cache_dir": row.cache_dir,
            "files": row.files,
        }
        child_env = {**os.environ, "HF_HUB_DISABLE_TELEMETRY": "1", "PYTHONUNBUFFERED": "1"}
        if run.token:
            child_env["HF_TOKEN"] = run.token  # in the environment, never in argv
        self._logs.mkdir(parents=True, exist_ok=True)
        _remove_partial_files(row)  # a manager killed outright left them; they are never reused
        outcome: tuple[DownloadState, str | None] = (DownloadState.FAILED, "the download process ended without a word")
        try:
            self._set(download_id, state=DownloadState.RUNNING)
            with open(self._logs / f"download-{download_id}.log", "ab") as errors:
                run.process = await asyncio.create_subprocess_exec(
                    self._python,
                    "-m",
                    "manager.hub.fetch_process",
                    stdin=asyncio.subprocess.PIPE,
                    stdout=asyncio.subprocess.PIPE,
                    stderr=errors,
                    env=child_env,
                )
            if run.cancelled or run.superseded:  # asked while the process was being started
                run.process.kill()
            assert run.process.stdin is not None and run.process.stdout is not None
            run.process.stdin.write(json.dumps(request).encode())
            await run.process.stdin.drain()
            run.process.stdin.close()
            async for raw in run.process.stdout:
                try:
                    message = json.loads(raw)
                except ValueError:
                    continue
                if "done" in message:
                    run.saw(int(message["done"]), time.monotonic())
                    self.version += 1
                elif "finished" in message:
                    run.saw(row.total_bytes - run.base_bytes, time.monotonic())
                    outcome = (DownloadState.DONE, None)
                elif "error" in message:
                    outcome = (DownloadState.FAILED, str(message["error"]))
            await run.process.wait()
            if self._closing and outcome[0] != DownloadState.DONE:  # to go on at the next start
                self._set(download_id, done_bytes=run.done_bytes)
                run.finished.set()
                return
        except asyncio.CancelledError:  # the manager is closing: the row stays unfinished, to go on later
            self._set(download_id, done_bytes=run.done_bytes)
            run.finished.set()
            raise
        except OSError as exc:  # also a process killed before it read its request
            outcome = (DownloadState.FAILED, f"the download process could not run: {exc}")
        if run.superseded:  # it runs again at once, under the same row
            run.finished.set()
            return
        if run.cancelled:
            outcome = (DownloadState.CANCELLED, None)
        done = run.done_bytes
        if outcome[0] != DownloadState.DONE:  # what is kept is what a resume goes on from
            _remove_partial_files(row)
            done = _complete_bytes(row)
        self._finish(download_id, outcome[0], outcome[1], done)
        run.finished.set()
        self._runs.pop(download_id, None)

    # ---- rows --------------------------------------------------------------------------------------
    def _finish(self, download_id: int, state: DownloadState, error: str | None, done: int | None = None) -> None:
        changes: dict = {"state": state, "error": error, "finished_at": utcnow()}
        if done is not None:
            changes["done_bytes"] = done
        row = self._set(download_id, **changes)
        size = f"{row.total_bytes / GiB:.2f} GiB"
        messages = {
            DownloadState.DONE: f"downloaded {row.repo} ({size}) into {row.cache_dir}",
            DownloadState.CANCELLED: f"the download of {row.repo} was cancelled at {row.done_bytes / GiB:.2f} of {size} "
            "(resume goes on from there)",
            DownloadState.FAILED: f"the download of {row.repo} failed: {error}",
        }
        self._note("download", messages.get(state, f"download of {row.repo}: {state.value}"), row)

    def _set(self, download_id: int, **changes) -> Download:
        with session(self._engine) as db:
            row = db.get(Download, download_id)
            if row is None:
                raise NotFound(f"no download {download_id}")
            for key, value in changes.items():
                setattr(row, key, value)
            row.updated_at = utcnow()
            db.add(row)
            db.commit()
            db.refresh(row)
        self.version += 1
        return row

    def _unfinished(self, repo: str, cache: Path, commit: str | None) -> Download | None:
        with session(self._engine) as db:
            query = select(Download).where(
                Download.repo == repo, Download.cache_dir == str(cache), col(Download.state).in_(list(UNFINISHED))
            )
            rows = [r for r in db.exec(query) if commit is None or r.commit == commit]
        return self._live(rows[0]) if rows else None

    def _live(self, row: Download) -> Download:
        """The row with the bytes its process reported last (the store has them as of its last change)."""
        run = self._runs.get(row.id or 0)
        if run is not None and row.state in UNFINISHED:
            row = row.model_copy(update={"done_bytes": run.done_bytes})
        return row

    def _note(self, kind: str, message: str, row: Download) -> None:
        if self._record is not None:
            with contextlib.suppress(Exception):  # the event log is a record, never a reason to fail
                self._record(kind, message, None, repo=row.repo, download=row.id)


def _remove_partial_files(row: Download) -> None:
    """The ``.incomplete`` files a download stopped half-way leaves: never reused, they only take room."""
    blobs = Path(row.cache_dir) / ("models--" + row.repo.replace("/", "--")) / "blobs"
    for path in blobs.glob("*.incomplete"):
        with contextlib.suppress(OSError):
            path.unlink()


def _complete_bytes(row: Download) -> int:
    """Bytes of the row's files already complete in its snapshot (a resume starts its count there)."""
    if not row.commit:
        return 0
    snapshot = Path(row.cache_dir) / ("models--" + row.repo.replace("/", "--")) / "snapshots" / row.commit
    total = 0
    for name in row.files:
        path = snapshot / name
        with contextlib.suppress(OSError):
            if path.is_file():
                total += path.stat().st_size
    return total


def public(row: Download, rate_bps: float | None) -> dict:
    """A download as the API and the pages show it."""
    progress = Progress(row.repo, row.done_bytes, row.total_bytes, rate_bps if row.state in UNFINISHED else None)
    return {
        **row.model_dump(mode="json", exclude={"files"}),
        "files": len(row.files),
        "percent": progress.percent,
        "rate_bps": progress.rate_bps,
        "eta_s": progress.eta_s,
    }
