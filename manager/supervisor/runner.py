"""One worker's owner task. It alone changes the worker's state; API calls send it commands."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy.engine import Engine

from manager.db import session
from manager.errors import Conflict, Invalid, ManagerError, NotFound
from manager.launch.command import LaunchCommand
from manager.schemas.worker import Worker
from manager.settings import Settings
from manager.supervisor import process
from manager.supervisor.events import EventLog
from manager.supervisor.logs import LogTail, meaningful_error, new_log_file
from manager.supervisor.probe import probe
from manager.supervisor.states import State, backoff_delay

log = logging.getLogger("vllm_manager.runner")


@dataclass
class Launch:
    """What the supervisor prepared for one start: the command and the limits that go with it."""

    model_name: str
    served_name: str
    command: LaunchCommand
    start_timeout_s: float


@dataclass
class Command:
    kind: str  # start | stop | restart | switch | delete
    model: str | None = None
    force: bool = False
    future: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())


@dataclass
class RunnerDeps:
    settings: Settings
    engine: Engine
    events: EventLog
    http: httpx.AsyncClient
    # Builds the launch for a model config on a given port and GPUs (raises ManagerError when it can't).
    prepare: Callable[[int, str, int, list[int], Path, bool], Launch]
    after_stop: Callable[[list[int], list[int]], list[str]] = lambda gpus, pids: []


class WorkerRunner:
    def __init__(self, row: Worker, deps: RunnerDeps) -> None:
        self.row = row
        self.deps = deps
        self.state = State(row.state)
        self.popen: subprocess.Popen | None = None
        self.logs = LogTail()
        self.detail: str | None = None
        self.served_name: str | None = None
        self._queue: asyncio.Queue[Command] = asyncio.Queue()
        self._task: asyncio.Task | None = None
        self._deadline = 0.0
        self._ready_since: float | None = None
        self._next_restart_at: float | None = None
        self._health_failures = 0
        self._switch_from: str | None = None
        self._crash_restarting = False

    # ---- public: used by the supervisor and routes -------------------------------------------
    @property
    def id(self) -> int:
        return self.row.id

    @property
    def run_dir(self) -> Path:
        return self.deps.settings.run_dir / f"worker-{self.id}"

    @property
    def log_dir(self) -> Path:
        return self.deps.settings.logs_dir / f"worker-{self.id}"

    def begin(self) -> None:
        self._task = asyncio.create_task(self._own(), name=f"worker-{self.id}")

    async def halt(self) -> None:
        """Stop the owner task only; the engine keeps running (the manager is restarting)."""
        if self._task:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task

    async def send(self, kind: str, model: str | None = None, force: bool = False) -> dict:
        if self._task is None or self._task.done():
            raise NotFound(f"worker {self.id} is gone (deleted)")
        cmd = Command(kind, model, force)
        await self._queue.put(cmd)
        return await cmd.future

    def snapshot(self) -> dict[str, Any]:
        started = self.row.started_at
        uptime = None
        if self.state == State.READY and started is not None:
            started_utc = started if started.tzinfo else started.replace(tzinfo=UTC)
            uptime = max(0.0, (datetime.now(UTC) - started_utc).total_seconds())
        next_restart = None
        if self.state == State.CRASHED and self._next_restart_at is not None:
            next_restart = max(0.0, self._next_restart_at - time.monotonic())
        return {
            "id": self.id,
            "model": self.row.model_name,
            "served_model_name": self.served_name,
            "state": self.state.value,
            "detail": self.detail,
            "pid": self.row.pid if self.state in (State.STARTING, State.READY, State.STOPPING) else None,
            "port": self.row.port,
            "gpus": self.row.gpus,
            "uptime_s": uptime,
            "restart_count": self.row.restart_count,
            "next_restart_in_s": next_restart,
            "last_error": self.row.last_error,
            "started_at": started.isoformat() if started else None,
            "run_dir": str(self.run_dir),
            "log_file": str(self.logs.path) if self.logs.path else None,
        }

    # ---- adoption --------------------------------------------------------------------------
    def adopt(self, served_name: str | None, start_timeout_s: float = 900) -> None:
        """Take over an engine that outlived the previous manager: watch it, never start another."""
        self.state = State.STARTING
        self.served_name = served_name
        # A big model may still be loading: give it what is left of its own start timeout.
        started = self.row.started_at
        elapsed = 0.0
        if started is not None:
            started_utc = started if started.tzinfo else started.replace(tzinfo=UTC)
            elapsed = (datetime.now(UTC) - started_utc).total_seconds()
        self._deadline = time.monotonic() + max(60.0, start_timeout_s - elapsed)
        logs = sorted(self.log_dir.glob("start-*.log"))
        if logs:
            self.logs.follow(logs[-1], from_start=True)
        self._save()

    # ---- the owner loop --------------------------------------------------------------------
    async def _own(self) -> None:
        while True:
            try:
                cmd = await asyncio.wait_for(self._queue.get(), timeout=self._tick_interval())
            except TimeoutError:
                cmd = None
            self.logs.poll()
            if cmd is not None:
                try:
                    cmd.future.set_result(await self._handle(cmd))
                except ManagerError as exc:
                    cmd.future.set_exception(exc)
                except Exception as exc:  # never let one bad command kill the owner task
                    log.exception("worker %s: command %s failed", self.id, cmd.kind)
                    cmd.future.set_exception(exc)
                if cmd.kind == "delete" and cmd.future.exception() is None:
                    self._refuse_queued()
                    return
            try:
                await self._tick()
            except Exception:
                log.exception("worker %s: supervision step failed", self.id)

    def _refuse_queued(self) -> None:
        while not self._queue.empty():
            late = self._queue.get_nowait()
            late.future.set_exception(NotFound(f"worker {self.id} was deleted"))

    def _tick_interval(self) -> float | None:
        if self.state == State.STARTING:
            return 0.5
        if self.state == State.READY:
            return self.deps.settings.health_interval_s
        if self.state == State.CRASHED and self._next_restart_at is not None:
            return max(0.05, min(1.0, self._next_restart_at - time.monotonic()))
        return None

    async def _handle(self, cmd: Command) -> dict:
        if cmd.kind == "start":
            if self.state in (State.STARTING, State.READY):
                return self.snapshot()  # already running: two starts make one process
            self.row.restart_count = 0
            await self._start(self.row.model_name, "start", cmd.force)
        elif cmd.kind == "stop":
            await self._stop("stop requested")
        elif cmd.kind == "restart":
            await self._stop("restart requested")
            self.row.restart_count = 0
            await self._start(self.row.model_name, "restart", cmd.force)
        elif cmd.kind == "switch":
            await self._switch(cmd.model, cmd.force)
        elif cmd.kind == "delete":
            await self._stop("worker deleted")
            with session(self.deps.engine) as db:
                row = db.get(Worker, self.id)
                if row is not None:
                    db.delete(row)
                    db.commit()
            self.deps.events.record("deleted", "worker deleted", self.id)
        else:
            raise Conflict(f"unknown command {cmd.kind!r}")
        return self.snapshot()

    # ---- transitions -----------------------------------------------------------------------
    def _transition(self, state: State, kind: str, message: str, **data) -> None:
        old = self.state
        self.state = state
        self.row.state = state.value
        self._save()
        self.deps.events.record(kind, message, self.id, state=state.value, previous=old.value, **data)

    def _save(self) -> None:
        self.row.state = self.state.value
        with session(self.deps.engine) as db:
            db.merge(self.row)
            db.commit()

    async def _start(self, model_name: str, reason: str, force: bool = False) -> None:
        port = self.row.port
        launch = self.deps.prepare(self.id, model_name, port, list(self.row.gpus), self.run_dir, force)
        stale = await asyncio.to_thread(process.stale_offload_files)
        for path in list(stale):
            try:
                path.unlink(missing_ok=True)
            except OSError:
                stale.remove(path)
        if stale:
            self.deps.events.record(
                "cleanup",
                f"removed {len(stale)} stale KV-offload file(s) from /dev/shm",
                self.id,
                files=[str(p) for p in stale],
            )
        shutil.rmtree(self.run_dir, ignore_errors=True)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        log_path = new_log_file(self.log_dir)
        log_path.write_text(f"# vllm-manager: {reason}: {model_name}\n# argv: {launch.command.argv}\n")
        self.logs.follow(log_path)
        try:
            self.popen = await asyncio.to_thread(
                process.spawn, launch.command.argv, launch.command.env, log_path, self.run_dir
            )
        except OSError as exc:
            raise Invalid(
                f"cannot run the engine interpreter {launch.command.argv[0]!r}: {exc}; check VLLM_MANAGER_ENGINE_PYTHON"
            ) from exc
        found = process.identity(self.popen.pid)
        self.row.model_name = model_name
        self.row.pid = self.popen.pid
        self.row.pid_create_time = found.create_time if found else None
        self.row.cmdline = list(found.cmdline) if found else launch.command.argv
        self.row.started_at = datetime.now(UTC)
        self.row.desired = "running"
        self.row.last_error = self.row.last_error if reason == "restart after crash" else None
        self.served_name = launch.served_name
        self.detail = "process started"
        self._deadline = time.monotonic() + launch.start_timeout_s
        self._health_failures = 0
        self._transition(
            State.STARTING,
            "starting",
            f"{reason}: {model_name} on port {port}",
            pid=self.popen.pid,
            argv=launch.command.argv,
        )

    async def _stop(self, reason: str) -> None:
        self._next_restart_at = None
        self._switch_from = None
        self._crash_restarting = False
        pid = self.row.pid
        if pid and self._process_alive():
            self._transition(State.STOPPING, "stopping", reason, pid=pid)
            report = await asyncio.to_thread(process.stop_group, pid, self.deps.settings.stop_grace_s, self.popen)
            notes = self.deps.after_stop(list(self.row.gpus), report.killed)
            how = "gracefully" if report.graceful else f"with SIGKILL after {self.deps.settings.stop_grace_s:g} s"
            message = f"stopped {how} in {report.seconds:.1f} s"
            if report.leftover:
                message += f"; processes still alive: {report.leftover}"
            for note in notes:
                message += f"; {note}"
            self.row.pid = None
            self.row.desired = "stopped"
            self.popen = None
            self.logs.poll()
            self._transition(
                State.STOPPED,
                "stopped",
                message,
                graceful=report.graceful,
                leftover=report.leftover,
                killed=report.killed,
            )
        else:
            self.row.pid = None
            self.row.desired = "stopped"
            self.popen = None
            if self.state != State.STOPPED:
                self._transition(State.STOPPED, "stopped", reason)

    async def _switch(self, model: str | None, force: bool) -> None:
        if not model:
            raise Conflict("switch needs the name of a model config")
        previous = self.row.model_name
        self.deps.prepare(self.id, model, self.row.port, list(self.row.gpus), self.run_dir, force)  # refuse early
        if model == previous and self.state in (State.STARTING, State.READY):
            return
        await self._stop(f"switching from {previous} to {model}")
        self._switch_from = previous
        self.row.restart_count = 0
        self.deps.events.record(
            "switching", f"switching from {previous} to {model}", self.id, previous=previous, model=model
        )
        await self._start(model, f"switch from {previous}", force)

    # ---- supervision steps -----------------------------------------------------------------
    def _process_alive(self) -> bool:
        if self.popen is not None:
            return self.popen.poll() is None
        return process.matches(self.row.pid, self.row.pid_create_time, self.row.cmdline)

    def _exit_text(self) -> str:
        code = self.popen.returncode if self.popen is not None else None
        return f"exited with code {code}" if code is not None else "exited"

    async def _tick(self) -> None:
        now = time.monotonic()
        if self.state == State.STARTING:
            if not self._process_alive():
                await self._reap()
                reason = meaningful_error(self.logs.tail(300)) or "no output"
                await self._start_failed(f"{self._exit_text()} before it was ready: {reason}")
                return
            result = await probe(self.deps.http, self.row.port, self.served_name or self.row.model_name)
            if result.serves:
                self._ready_since = now
                self.detail = None
                self._transition(State.READY, "ready", f"{self.row.model_name} is serving on port {self.row.port}")
                if self._switch_from:
                    self.deps.events.record(
                        "switched",
                        f"switched from {self._switch_from} to {self.row.model_name}",
                        self.id,
                        previous=self._switch_from,
                        model=self.row.model_name,
                    )
                    self._switch_from = None
                self._crash_restarting = False
                return
            self.detail = self.logs.latest() or result.detail
            if now > self._deadline:
                await self._kill_quietly()
                await self._start_failed(
                    f"not ready within the start timeout; last log line: {self.logs.latest() or '-'}"
                )
        elif self.state == State.READY:
            if not self._process_alive():
                await self._reap()
                reason = meaningful_error(self.logs.tail(300)) or ""
                await self._crashed(f"{self._exit_text()} while serving" + (f": {reason}" if reason else ""))
                return
            result = await probe(self.deps.http, self.row.port, self.served_name or self.row.model_name)
            if result.healthy:
                self._health_failures = 0
            else:
                self._health_failures += 1
                limit = self.deps.settings.health_failures_before_crash
                if self._health_failures >= limit:
                    await self._kill_quietly()
                    await self._crashed(f"/health failed {limit} times in a row ({result.detail})")
                    return
            self.logs.cap_size()
            if (
                self.row.restart_count
                and self._ready_since is not None
                and now - self._ready_since >= self.deps.settings.healthy_reset_s
            ):
                self.row.restart_count = 0
                self._save()
                self.deps.events.record("healthy", "healthy long enough: restart counter reset", self.id)
        elif self.state == State.CRASHED and self._next_restart_at is not None and now >= self._next_restart_at:
            self._next_restart_at = None
            self._crash_restarting = True
            try:
                await self._start(self.row.model_name, "restart after crash")
            except ManagerError as exc:
                self.row.last_error = f"restart refused: {exc.message}"
                self._transition(State.FAILED, "failed", self.row.last_error)

    async def _reap(self) -> None:
        """The API server is gone; make sure nothing of its group lingers (engine core, workers)."""
        if self.row.pid:
            await asyncio.to_thread(process.stop_group, self.row.pid, 2.0, self.popen)
        self.logs.poll()

    async def _kill_quietly(self) -> None:
        if self.row.pid:
            await asyncio.to_thread(process.stop_group, self.row.pid, self.deps.settings.stop_grace_s, self.popen)
        self.logs.poll()

    async def _start_failed(self, reason: str) -> None:
        self.row.pid = None
        if self._switch_from:
            previous, self._switch_from = self._switch_from, None
            failed_model = self.row.model_name
            self.deps.events.record(
                "switch_failed",
                f"switch to {failed_model} failed: {reason}",
                self.id,
                model=failed_model,
                previous=previous,
            )
            self.row.last_error = f"switch to {failed_model} failed: {reason}; rolled back to {previous}"
            try:
                await self._start(previous, f"roll back after failed switch to {failed_model}")
                self.row.last_error = f"switch to {failed_model} failed: {reason}; rolled back to {previous}"
                self._save()
            except ManagerError as exc:
                self.row.last_error += f"; the roll back was refused: {exc.message}"
                self._transition(State.FAILED, "failed", self.row.last_error)
            return
        if self._crash_restarting:
            await self._crashed(f"restart did not become ready: {reason}")
            return
        self.row.last_error = reason
        self._transition(State.FAILED, "failed", reason)

    async def _crashed(self, reason: str) -> None:
        self.row.pid = None
        self.popen = None
        self.row.restart_count += 1
        ceiling = self.deps.settings.restart_ceiling
        if self.row.restart_count > ceiling:
            self.row.last_error = f"{reason}; gave up after {ceiling} restarts"
            self._crash_restarting = False
            self._transition(State.FAILED, "failed", self.row.last_error)
            return
        delay = backoff_delay(
            self.row.restart_count, self.deps.settings.backoff_base_s, self.deps.settings.backoff_cap_s
        )
        self._next_restart_at = time.monotonic() + delay
        self.row.last_error = reason
        self._transition(
            State.CRASHED, "crashed", f"{reason}; restart {self.row.restart_count} in {delay:g} s", delay_s=delay
        )
