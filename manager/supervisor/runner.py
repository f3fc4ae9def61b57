"""One worker's owner task: it carries out what ``lifecycle.step`` decides, and nothing else.

Commands from the API and what the runner sees (the process died, /health answered, time passed)
become lifecycle events; the effects that come back are done here (launch, stop a process group,
record an event) and their results go back in as events. The worker's state changes only in
``lifecycle.py``; this file stores it and publishes a ``WorkerView`` of it.
"""

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

import httpx
from sqlalchemy.engine import Engine as DbEngine

from manager.db import session
from manager.errors import Conflict, Invalid, ManagerError, NotFound
from manager.launch.command import LaunchCommand
from manager.launch.secrets import Redactor
from manager.launch.validation import cannot_run
from manager.schemas.worker import Worker
from manager.settings import Settings
from manager.supervisor import lifecycle as lc
from manager.supervisor import process, sleep_mode
from manager.supervisor.events import EventLog
from manager.supervisor.logs import LogTail, meaningful_error, new_log_file
from manager.supervisor.probe import probe
from manager.supervisor.view import WorkerView

log = logging.getLogger("vllm_manager.runner")


@dataclass
class Prepared:
    """What the supervisor prepared for one start: the command and the limits that go with it."""

    served_name: str
    command: LaunchCommand
    start_timeout_s: float
    secrets: Redactor = field(default_factory=Redactor)  # the config's, hidden in its events and log lines


# Builds the launch for a model config: (worker id, config name, port, gpus, run dir, force).
Prepare = Callable[[int, str, int, list[int], Path, bool], Prepared]


@dataclass
class Command:
    kind: str  # start | stop | restart | switch | delete | sleep | wake
    model: str | None = None
    force: bool = False
    level: int | None = None  # sleep: vLLM's sleep level
    future: asyncio.Future[WorkerView] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


@dataclass
class RunnerDeps:
    settings: Settings
    engine: DbEngine
    events: EventLog
    http: httpx.AsyncClient
    prepare: Prepare
    # After a stop: end engine processes still on the GPUs (gpus, engine pids) -> notes.
    after_stop: Callable[[list[int], list[int]], list[str]] = lambda gpus, pids: []


def policy_of(settings: Settings) -> lc.Policy:
    return lc.Policy(
        health_interval_s=settings.health_interval_s,
        health_failures_before_crash=settings.health_failures_before_crash,
        healthy_reset_s=settings.healthy_reset_s,
        restart_ceiling=settings.restart_ceiling,
        backoff_base_s=settings.backoff_base_s,
        backoff_cap_s=settings.backoff_cap_s,
        stop_grace_s=settings.stop_grace_s,
    )


def life_of(row: Worker) -> lc.Life:
    engine = None
    if row.pid:
        engine = lc.Engine(row.pid, row.pid_create_time, tuple(row.cmdline))
    return lc.Life(
        state=lc.State(row.state),
        model=row.model_name,
        port=row.port,
        engine=engine,
        # SQLite gives the stored time back without its zone; it was written in UTC.
        started_at=row.started_at.replace(tzinfo=UTC)
        if row.started_at and not row.started_at.tzinfo
        else row.started_at,
        desired=row.desired,
        restart_count=row.restart_count,
        last_error=row.last_error,
    )


class WorkerRunner:
    def __init__(self, row: Worker, deps: RunnerDeps) -> None:
        assert row.id is not None
        self.id: int = row.id
        self.gpus = list(row.gpus)
        self.deps = deps
        self.policy = policy_of(deps.settings)
        self.life = life_of(row)
        self.logs = LogTail()
        self.secrets = Redactor()  # of the config the engine was started with
        self._row = row
        self._popen: subprocess.Popen[bytes] | None = None
        self._queue: asyncio.Queue[Command] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None
        self._forgotten = False

    @property
    def run_dir(self) -> Path:
        return self.deps.settings.run_dir / f"worker-{self.id}"

    @property
    def log_dir(self) -> Path:
        return self.deps.settings.logs_dir / f"worker-{self.id}"

    # ---- used by the supervisor ----------------------------------------------------------------
    async def begin(self, first: lc.Adopted | lc.FoundGone | None = None, secrets: Redactor | None = None) -> None:
        """Start the owner task; `first` reconciles the stored worker with what is running now, whose
        config's ``secrets`` its events and log lines hide."""
        self.secrets = secrets or Redactor()
        if isinstance(first, lc.Adopted):
            logs = sorted(self.log_dir.glob("start-*.log"))
            if logs:
                self.logs.follow(logs[-1], from_start=True, secrets=self.secrets)
        if first is not None:
            await self._feed(first)
        self._task = asyncio.create_task(self._own(), name=f"worker-{self.id}")

    async def halt(self) -> None:
        """Stop the owner task only; the engine keeps running (the manager is restarting)."""
        if self._task:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task

    async def send(
        self, kind: str, model: str | None = None, force: bool = False, level: int | None = None
    ) -> WorkerView:
        if self._task is None or self._task.done():
            raise NotFound(f"worker {self.id} is gone (deleted)")
        cmd = Command(kind, model, force, level)
        await self._queue.put(cmd)
        return await cmd.future

    def view(self) -> WorkerView:
        life, now = self.life, time.monotonic()
        started = life.started_at
        uptime = None
        if life.state == lc.State.READY and started is not None:
            uptime = max(0.0, (datetime.now(UTC) - started).total_seconds())
        next_restart = None
        if life.state == lc.State.CRASHED and life.next_restart_at is not None:
            next_restart = max(0.0, life.next_restart_at - now)
        has_process = life.state in (
            lc.State.STARTING,
            lc.State.READY,
            lc.State.STOPPING,
            lc.State.SLEEPING,
            lc.State.WAKING,
        )
        return WorkerView(
            id=self.id,
            model=life.model,
            served_model_name=life.served_name,
            state=life.state,
            detail=life.detail,
            pid=life.engine.pid if has_process and life.engine else None,
            port=life.port,
            gpus=self.gpus,
            uptime_s=uptime,
            restart_count=life.restart_count,
            next_restart_in_s=next_restart,
            last_error=life.last_error,
            started_at=started,
            run_dir=str(self.run_dir),
            log_file=str(self.logs.path) if self.logs.path else None,
        )

    # ---- the owner loop --------------------------------------------------------------------
    async def _own(self) -> None:
        while True:
            interval = lc.tick_interval(self.life, time.monotonic(), self.policy)
            try:
                cmd: Command | None = await asyncio.wait_for(self._queue.get(), timeout=interval)
            except TimeoutError:
                cmd = None
            self.logs.poll()
            if cmd is not None:
                try:
                    await self._handle(cmd)
                    cmd.future.set_result(self.view())
                except ManagerError as exc:
                    cmd.future.set_exception(exc)
                except Exception as exc:  # never let one bad command kill the owner task
                    log.exception("worker %s: command %s failed", self.id, cmd.kind)
                    cmd.future.set_exception(exc)
                if self._forgotten:
                    self._refuse_queued()
                    return
            try:
                await self._look()
            except Exception:
                log.exception("worker %s: supervision step failed", self.id)

    def _refuse_queued(self) -> None:
        while not self._queue.empty():
            late = self._queue.get_nowait()
            late.future.set_exception(NotFound(f"worker {self.id} was deleted"))

    async def _handle(self, cmd: Command) -> None:
        alive = self._alive()
        if cmd.kind == "start":
            await self._feed(lc.StartRequested(cmd.force))
        elif cmd.kind == "stop":
            await self._feed(lc.StopRequested("stop requested", alive))
        elif cmd.kind == "restart":
            await self._feed(lc.RestartRequested(alive, cmd.force))
        elif cmd.kind == "switch":
            if not cmd.model:
                raise Conflict("switch needs the name of a model config")
            # Refuse a config that cannot be launched before the running one is stopped.
            self.deps.prepare(self.id, cmd.model, self._port(), self.gpus, self.run_dir, cmd.force)
            await self._feed(lc.SwitchRequested(cmd.model, alive, cmd.force))
        elif cmd.kind == "delete":
            await self._feed(lc.DeleteRequested(alive))
        elif cmd.kind == "sleep":
            if cmd.level not in (1, 2):
                raise Invalid(f"sleep level must be 1 or 2, got {cmd.level!r}")
            await self._feed(lc.SleepRequested(cmd.level))
        elif cmd.kind == "wake":
            await self._feed(lc.WakeRequested())
        else:
            raise Conflict(f"unknown command {cmd.kind!r}")

    async def _look(self) -> None:
        """Observe the engine as its state asks, and tell the machine what was seen."""
        state = self.life.state
        if state == lc.State.STARTING or state in lc.SERVING:
            if not self._alive():
                await self._end_group(quick=True)
                reason = meaningful_error(self.logs.tail(300))
                await self._feed(lc.Exited(self._exit_text(), reason, time.monotonic()))
                return
            result = await probe(self.deps.http, self._port(), self.life.served_name or self.life.model)
            await self._feed(
                lc.Probed(result.healthy, result.serves, result.detail, self.logs.latest(), time.monotonic())
            )
            if self.life.state == lc.State.READY:
                self.logs.cap_size()
        elif state == lc.State.CRASHED:
            await self._feed(lc.Tick(time.monotonic()))

    # ---- events in, effects out ----------------------------------------------------------------
    async def _feed(self, event: lc.Event) -> None:
        before = self.life
        self.life, effects = lc.step(before, event, self.policy)
        if self.life != before and not self._forgotten:
            self._store()
        for effect in effects:
            result = await self._carry_out(effect)
            if result is not None:
                await self._feed(result)

    async def _carry_out(self, effect: lc.Effect) -> lc.Event | None:
        match effect:
            case lc.Record(kind=kind, message=message, data=data):
                # Events are broadcast and stored: no reader, token or not, sees a secret in one.
                hidden = {key: self.secrets.value(value) for key, value in data}
                self.deps.events.record(kind, self.secrets.text(message), self.id, **hidden)
            case lc.Launch():
                return await self._launch(effect)
            case lc.StopGroup(pid=pid):
                report = await asyncio.to_thread(
                    process.stop_group, pid, self.deps.settings.stop_grace_s, self._popen_of(pid)
                )
                self._popen = None
                notes = self.deps.after_stop(self.gpus, report.killed)
                self.logs.poll()
                return lc.GroupStopped(
                    report.graceful, report.seconds, tuple(report.killed), tuple(report.leftover), tuple(notes)
                )
            case lc.KillGroup(pid=pid, reason=reason):
                await self._end_group(quick=False, pid=pid)
                return lc.Killed(reason, time.monotonic())
            case lc.PutToSleep(level=level):
                ok, seconds, detail = await sleep_mode.put_to_sleep(self.deps.http, self._port(), level)
                return lc.Slept(ok, seconds, detail)
            case lc.WakeUp(level=level):
                ok, seconds, detail = await sleep_mode.wake_up(self.deps.http, self._port(), level)
                return lc.Woke(ok, seconds, detail, time.monotonic())
            case lc.Reject(error=error):
                raise error
            case lc.Forget():
                self._forget()
        return None

    async def _launch(self, effect: lc.Launch) -> lc.Event:
        port = self._port()
        try:
            launch = self.deps.prepare(self.id, effect.model, port, self.gpus, self.run_dir, effect.force)
        except ManagerError as exc:
            return lc.LaunchRefused(exc)
        removed = await asyncio.to_thread(_remove_stale_offload_files)
        shutil.rmtree(self.run_dir, ignore_errors=True)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.secrets = launch.secrets
        shown_argv = self.secrets.argv(launch.command.argv)
        log_path = new_log_file(self.log_dir)
        log_path.write_text(f"# vllm-manager: {effect.reason}: {effect.model}\n# argv: {shown_argv}\n")
        self.logs.follow(log_path, secrets=self.secrets)
        try:
            popen = await asyncio.to_thread(
                process.spawn, launch.command.argv, launch.command.env, log_path, self.run_dir
            )
        except (OSError, ValueError) as exc:
            return lc.LaunchRefused(Invalid(cannot_run(launch.command.argv[0], exc)))
        self._popen = popen
        found = process.identity(popen.pid)
        engine = lc.Engine(
            popen.pid,
            found.create_time if found else None,
            tuple(found.cmdline) if found else tuple(launch.command.argv),
        )
        return lc.Launched(
            reason=effect.reason,
            model=effect.model,
            served_name=launch.served_name,
            engine=engine,
            argv=tuple(shown_argv),
            started_at=datetime.now(UTC),
            start_timeout_s=launch.start_timeout_s,
            now=time.monotonic(),
            removed_stale=tuple(removed),
        )

    # ---- the process -----------------------------------------------------------------------------
    def _port(self) -> int:
        assert self.life.port is not None, "a worker always has a port"
        return self.life.port

    def _popen_of(self, pid: int) -> subprocess.Popen[bytes] | None:
        return self._popen if self._popen is not None and self._popen.pid == pid else None

    def _alive(self) -> bool:
        engine = self.life.engine
        if engine is None:
            return False
        popen = self._popen_of(engine.pid)
        if popen is not None:
            return popen.poll() is None
        return process.matches(engine.pid, engine.create_time, engine.cmdline)

    def _exit_text(self) -> str:
        code = self._popen.returncode if self._popen is not None else None
        return f"exited with code {code}" if code is not None else "exited"

    async def _end_group(self, quick: bool, pid: int | None = None) -> None:
        """Make sure nothing of a dead or failed engine's group lingers (engine core, workers)."""
        pid = pid or (self.life.engine.pid if self.life.engine else None)
        if pid:
            grace = 2.0 if quick else self.deps.settings.stop_grace_s
            await asyncio.to_thread(process.stop_group, pid, grace, self._popen_of(pid))
        self.logs.poll()

    # ---- storage -----------------------------------------------------------------------------------
    def _store(self) -> None:
        life, row = self.life, self._row
        row.state = life.state.value
        row.model_name = life.model
        row.pid = life.engine.pid if life.engine else None
        row.pid_create_time = life.engine.create_time if life.engine else None
        row.cmdline = list(life.engine.cmdline) if life.engine else []
        row.started_at = life.started_at
        row.desired = life.desired
        row.restart_count = life.restart_count
        row.last_error = life.last_error
        with session(self.deps.engine) as db:
            db.merge(row)
            db.commit()

    def _forget(self) -> None:
        self._forgotten = True
        with session(self.deps.engine) as db:
            row = db.get(Worker, self.id)
            if row is not None:
                db.delete(row)
                db.commit()


def _remove_stale_offload_files() -> list[str]:
    removed = []
    for path in process.stale_offload_files():
        try:
            path.unlink(missing_ok=True)
        except OSError:
            continue
        removed.append(str(path))
    return removed
