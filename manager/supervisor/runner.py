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
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from manager.cluster.node_folders import node_folders
from manager.db import session
from manager.errors import Conflict, Invalid, ManagerError, NotFound, Unavailable
from manager.host.local import LocalHost, ProcessHost
from manager.hub.fetching import FetchFailed
from manager.launch.secrets import Redactor
from manager.launch.validation import cannot_run
from manager.schemas.worker import Worker
from manager.supervisor import sleep_mode
from manager.supervisor.lifecycle import step
from manager.supervisor.logs import LogTail, meaningful_error, new_log_file
from manager.supervisor.policy import tick_interval
from manager.supervisor.probe import probe
from manager.supervisor.runner_deps import Download, RunnerDeps, life_of, policy_of
from manager.supervisor.view import DownloadProgress, WorkerView
from manager.supervisor.worker_effects import (
    Effect,
    Fetch,
    Forget,
    KillGroup,
    Launch,
    PutToSleep,
    Record,
    Reject,
    StopFetching,
    StopGroup,
    WakeUp,
)
from manager.supervisor.worker_events import (
    Adopted,
    DeleteRequested,
    Event,
    Exited,
    Fetched,
    FoundGone,
    GroupStopped,
    Killed,
    Launched,
    LaunchRefused,
    NeedsDownload,
    NodeLost,
    Probed,
    RestartRequested,
    SleepRequested,
    Slept,
    StartRequested,
    StopRequested,
    SwitchRequested,
    Tick,
    WakeRequested,
    Woke,
)
from manager.supervisor.worker_state import SERVING, Engine, State

log = logging.getLogger("vllm_manager.runner")


@dataclass
class Command:
    kind: str  # start | stop | restart | switch | delete | sleep | wake | event
    model: str | None = None
    force: bool = False
    level: int | None = None  # sleep: vLLM's sleep level
    event: Event | None = None  # event: what the supervisor saw of the worker's node
    future: asyncio.Future[WorkerView] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


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
        self.engine_key: str | None = None  # the API key that engine asks for on its /v1 endpoints
        self._row = row
        self.node: str | None = row.node
        self.host: ProcessHost = deps.host_of(row.node)
        self._run_dir: Path | None = Path(row.run_dir) if row.run_dir else None
        self._remote_log: tuple[Path, Path, int] | None = None  # (on its node, local copy, bytes copied)
        # The node a lost worker's engine was on (its own node, also after a manager restart).
        self._lost_node: str | None = row.node if row.state == State.LOST.value else None
        self._wanted_node: str | None = None  # the node its next start must run on (asked for at creation)
        self._queue: asyncio.Queue[Command] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None
        self._download: Download | None = None  # what its start downloads (or last did)
        self._fetching: asyncio.Task[None] | None = None  # the wait for that download
        self._forgotten = False

    @property
    def run_dir(self) -> Path:
        """The engine's run folder, on the box it runs on."""
        return self._run_dir or self.deps.settings.run_dir / f"worker-{self.id}"

    @property
    def log_dir(self) -> Path:
        return self.deps.settings.logs_dir / f"worker-{self.id}"

    # ---- used by the supervisor ----------------------------------------------------------------
    def want_node(self, node: str | None) -> None:
        """The node its next start must run on (that start only: a later move goes where it fits)."""
        self._wanted_node = node

    def take_wanted_node(self) -> str | None:
        """The node its start was asked to run on, once: the start that reads it is that start."""
        node, self._wanted_node = self._wanted_node, None
        return node

    async def begin(
        self,
        first: Adopted | FoundGone | NodeLost | None = None,
        secrets: Redactor | None = None,
        engine_key: str | None = None,
    ) -> None:
        """Start the owner task; `first` reconciles the stored worker with what is running now, whose
        config's ``secrets`` its events and log lines hide, and whose engine asks for ``engine_key``."""
        self.secrets = secrets or Redactor()
        self.engine_key = engine_key
        # A worker the store already had (a new one has no log yet): its last start's output stays
        # readable, a failed start's above all.
        logs = sorted(self.log_dir.glob("start-*.log"))
        if logs:
            self.logs.follow(logs[-1], from_start=True, secrets=self.secrets)
            if isinstance(first, Adopted):
                self._copy_log_from(logs[-1])
        if first is not None:
            await self._feed(first)
        self._task = asyncio.create_task(self._own(), name=f"worker-{self.id}")

    async def halt(self) -> None:
        """Stop the owner task only; the engine keeps running (the manager is restarting) and so does a
        download (the next manager's start of the worker waits for it again)."""
        self._stop_fetching()
        if self._task:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task

    async def send(
        self,
        kind: str,
        model: str | None = None,
        force: bool = False,
        level: int | None = None,
        event: Event | None = None,
    ) -> WorkerView:
        if self._task is None or self._task.done():
            raise NotFound(f"worker {self.id} is gone (deleted)")
        cmd = Command(kind, model, force, level, event)
        await self._queue.put(cmd)
        return await cmd.future

    def view(self) -> WorkerView:
        life, now = self.life, time.monotonic()
        started = life.started_at
        uptime = None
        if life.state == State.READY and started is not None:
            uptime = max(0.0, (datetime.now(UTC) - started).total_seconds())
        next_restart = None
        if life.state == State.CRASHED and life.next_restart_at is not None:
            next_restart = max(0.0, life.next_restart_at - now)
        has_process = life.state in (
            State.STARTING,
            State.READY,
            State.STOPPING,
            State.SLEEPING,
            State.WAKING,
            State.LOST,
        )
        return WorkerView(
            id=self.id,
            download=self._progress() if life.state == State.DOWNLOADING else None,
            model=life.model,
            served_model_name=life.served_name,
            state=life.state,
            detail=life.detail,
            pid=life.engine.pid if has_process and life.engine else None,
            port=life.port,
            node=self.node,
            address=self.host.address,
            gpus=self.gpus,
            uptime_s=uptime,
            restart_count=life.restart_count,
            next_restart_in_s=next_restart,
            last_error=life.last_error,
            started_at=started,
            run_dir=str(self.run_dir),
            log_file=str(self.logs.path) if self.logs.path else None,
        )

    def _progress(self) -> DownloadProgress | None:
        fetcher, download = self.deps.fetcher, self._download
        if fetcher is None or download is None:
            return None
        try:
            progress = fetcher.progress(download.repo, download.env)
        except Exception:  # a view is read by every page and request: it never fails for a progress figure
            log.exception("worker %s: reading the download progress of %s failed", self.id, download.repo)
            return None
        return DownloadProgress.of(progress) if progress is not None else None

    # ---- the owner loop --------------------------------------------------------------------
    async def _own(self) -> None:
        while True:
            interval = tick_interval(self.life, time.monotonic(), self.policy)
            try:
                cmd: Command | None = await asyncio.wait_for(self._queue.get(), timeout=interval)
            except TimeoutError:
                cmd = None
            await self._pull_log()
            self.logs.poll()
            if cmd is not None:
                try:
                    await self._handle(cmd)
                    cmd.future.set_result(self.view())
                except ManagerError as exc:
                    cmd.future.set_exception(exc)
                except OSError as exc:  # its node did not answer: the engine's fate is not known
                    cmd.future.set_exception(Unavailable(f"worker {self.id}: {exc}; try again"))
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
        if cmd.kind == "event" and cmd.event is not None:
            await self._feed(cmd.event)
            return
        if cmd.kind == "node_back":
            await self._node_back()
            return
        answer = await self._alive()
        if answer is None and self.life.state != State.LOST:
            raise Unavailable(
                f"node {self.node} does not answer, so whether worker {self.id}'s engine runs is not known: try "
                "again, or wait until the node is marked lost"
            )
        alive = bool(answer)
        if cmd.kind == "start":
            await self._feed(StartRequested(cmd.force))
        elif cmd.kind == "stop":
            await self._feed(StopRequested("stop requested", alive))
        elif cmd.kind == "restart":
            await self._feed(RestartRequested(alive, cmd.force))
        elif cmd.kind == "switch":
            if not cmd.model:
                raise Conflict("switch needs the name of a model config")
            # Refuse a config that cannot be launched before the running one is stopped.
            await asyncio.to_thread(self.deps.prepare, self.id, cmd.model, self._port(), self.gpus, cmd.force)
            await self._feed(SwitchRequested(cmd.model, alive, cmd.force))
        elif cmd.kind == "delete":
            await self._feed(DeleteRequested(alive))
        elif cmd.kind == "sleep":
            if cmd.level not in (1, 2):
                raise Invalid(f"sleep level must be 1 or 2, got {cmd.level!r}")
            await self._feed(SleepRequested(cmd.level))
        elif cmd.kind == "wake":
            await self._feed(WakeRequested())
        else:
            raise Conflict(f"unknown command {cmd.kind!r}")

    async def _look(self) -> None:
        """Observe the engine as its state asks, and tell the machine what was seen."""
        state = self.life.state
        if state == State.STARTING or state in SERVING:
            alive = await self._alive()
            if alive is None:
                return  # its node did not answer: the cluster's heartbeat decides whether it is lost
            if not alive:
                await self._pull_log()
                await self._end_group(quick=True)
                reason = meaningful_error(self.logs.tail(300))
                await self._feed(Exited(self._exit_text(), reason, time.monotonic()))
                return
            result = await probe(
                self.deps.http,
                self._port(),
                self.life.served_name or self.life.model,
                self.host.address,
                self.engine_key,
            )
            await self._feed(Probed(result.healthy, result.serves, result.detail, self.logs.latest(), time.monotonic()))
            if self.life.state == State.READY:
                self.logs.cap_size()
        elif state == State.CRASHED:
            await self._feed(Tick(time.monotonic()))

    # ---- events in, effects out ----------------------------------------------------------------
    async def _feed(self, event: Event) -> None:
        before = self.life
        self.life, effects = step(before, event, self.policy)
        if self.life.state == State.LOST and before.state != State.LOST:
            self._lost_node = self.node
        elif before.state == State.LOST and self.life.state != State.LOST:
            let_go = before.engine is not None and self.life.engine != before.engine
            if let_go and self._lost_node and before.engine is not None:
                self.deps.abandon(self._lost_node, before.engine)
            self._lost_node = None
        if self.life != before and not self._forgotten:
            self._store()
        for effect in effects:
            result = await self._carry_out(effect)
            if result is not None:
                await self._feed(result)
        if before.state == State.STARTING and self.life.state == State.READY:
            await self._check_plan()

    async def _check_plan(self) -> None:
        """vLLM's KV cache size against the plan for this start: more than 1 % apart is a plan_mismatch event."""
        model, log_path = self.life.model, self.logs.path
        # The plan is made with this machine's GPU and RAM: an engine on another node is not compared.
        if self.deps.check_plan is None or model is None or log_path is None or not isinstance(self.host, LocalHost):
            return
        try:
            found = await asyncio.to_thread(self.deps.check_plan, model, log_path)
        except Exception:  # the comparison is a report: it never stops the worker
            log.exception("worker %s: comparing the plan with vLLM's KV cache failed", self.id)
            return
        if found is not None:
            message, data = found
            hidden = {key: self.secrets.value(value) for key, value in data.items()}
            self.deps.events.record("plan_mismatch", self.secrets.text(message), self.id, **hidden)

    async def _carry_out(self, effect: Effect) -> Event | None:
        match effect:
            case Record(kind=kind, message=message, data=data):
                # Events are broadcast and stored: no reader, token or not, sees a secret in one.
                hidden = {key: self.secrets.value(value) for key, value in data}
                self.deps.events.record(kind, self.secrets.text(message), self.id, **hidden)
            case Launch():
                return await self._launch(effect)
            case Fetch(since=since):
                self._stop_fetching()
                self._fetching = asyncio.create_task(self._fetch(since), name=f"worker-{self.id} download")
            case StopFetching():
                self._stop_fetching()
            case StopGroup(pid=pid):
                try:
                    report = await asyncio.to_thread(self.host.stop_group, pid, self.deps.settings.stop_grace_s)
                    notes = await asyncio.to_thread(self.host.end_gpu_orphans, self.gpus, report.killed)
                except OSError as exc:
                    # Its node stopped answering: the engine is ended when the node comes back.
                    if self.life.engine is not None and self.node:
                        self.deps.abandon(self.node, self.life.engine)
                    return GroupStopped(False, 0.0, (), (), (f"node {self.node} did not answer ({exc})",))
                await self._pull_log()
                self.logs.poll()
                return GroupStopped(
                    report.graceful, report.seconds, tuple(report.killed), tuple(report.leftover), tuple(notes)
                )
            case KillGroup(pid=pid, reason=reason):
                await self._end_group(quick=False, pid=pid)
                return Killed(reason, time.monotonic())
            case PutToSleep(level=level):
                ok, seconds, detail = await sleep_mode.put_to_sleep(
                    self.deps.http, self._port(), level, self.host.address, self.engine_key
                )
                return Slept(ok, seconds, detail)
            case WakeUp(level=level):
                ok, seconds, detail = await sleep_mode.wake_up(
                    self.deps.http, self._port(), level, self.host.address, self.engine_key
                )
                return Woke(ok, seconds, detail, time.monotonic())
            case Reject(error=error):
                raise error
            case Forget():
                self._forget()
        return None

    async def _launch(self, effect: Launch) -> Event:
        port = self._port()
        if effect.downloaded and (refusal := await self._make_room(effect.model)) is not None:
            return LaunchRefused(refusal)
        try:
            launch = await asyncio.to_thread(self.deps.prepare, self.id, effect.model, port, self.gpus, effect.force)
        except ManagerError as exc:
            return LaunchRefused(exc)
        if launch.download is not None and self.deps.fetcher is not None and not effect.downloaded:
            self._download = launch.download
            return NeedsDownload(effect, launch.download.repo, time.monotonic())
        host = launch.host
        run_dir = launch.run_dir or self.deps.settings.run_dir / f"worker-{self.id}"
        try:
            removed = await asyncio.to_thread(host.remove_stale_offload_files)
        except OSError:
            removed = []
        if isinstance(host, LocalHost):
            shutil.rmtree(run_dir, ignore_errors=True)
            run_dir.mkdir(parents=True, exist_ok=True)
        self.secrets = launch.secrets
        self.engine_key = launch.engine_key
        shown_argv = self.secrets.argv(launch.command.argv)
        log_path = new_log_file(self.log_dir)
        log_path.write_text(f"# vllm-manager: {effect.reason}: {effect.model}\n# argv: {shown_argv}\n")
        self.logs.follow(log_path, secrets=self.secrets)
        engine_log = log_path if launch.log_dir is None else launch.log_dir / log_path.name
        try:
            spawned = await asyncio.to_thread(host.spawn, launch.command.argv, launch.command.env, engine_log, run_dir)
        except (OSError, ValueError) as exc:
            return LaunchRefused(Invalid(cannot_run(launch.command.argv[0], exc)))
        self.host, self.node, self._run_dir = host, host.node, run_dir
        self._remote_log = (engine_log, log_path, 0) if engine_log != log_path else None
        engine = Engine(spawned.pid, spawned.create_time, spawned.cmdline)
        where = f" on node {host.node}" if host.node else ""
        return Launched(
            reason=effect.reason + where,
            model=effect.model,
            served_name=launch.served_name,
            engine=engine,
            argv=tuple(shown_argv),
            started_at=datetime.now(UTC),
            start_timeout_s=launch.start_timeout_s,
            now=time.monotonic(),
            removed_stale=tuple(removed),
            port=launch.port,
        )

    async def _make_room(self, model: str) -> ManagerError | None:
        """Room for the engine about to start after its download (others stopped first), before the
        pre-start check counts what is free; the reason when it cannot be made."""
        if self.deps.make_room is None:
            return None
        try:
            await self.deps.make_room(model)
        except ManagerError as exc:
            return exc
        except Exception as exc:  # the worker must not stay downloading for good
            log.exception("worker %s: making room for %s failed", self.id, model)
            return Conflict(f"room for {model} could not be made: {exc}")
        return None

    # ---- the download -----------------------------------------------------------------------------
    async def _fetch(self, since: float) -> None:
        """Wait for the start's download (under its download_timeout_s), then tell the machine how it ended."""
        fetcher, download = self.deps.fetcher, self._download
        assert fetcher is not None and download is not None
        ok, detail = False, ""
        limit = asyncio.timeout(download.timeout_s)
        try:
            async with limit:
                await fetcher.fetch(download.repo, download.env)
            ok = True
        except TimeoutError as exc:
            if limit.expired():
                detail = f"the download took longer than download_timeout_s ({download.timeout_s:g} s)"
            else:  # the hub, not the limit
                detail = f"the download of {download.repo} failed: {exc or 'it timed out'}"
        except FetchFailed as exc:
            detail = str(exc) or f"the download of {download.repo} failed"
        except Exception as exc:
            log.exception("worker %s: the download of %s failed", self.id, download.repo)
            detail = f"the download of {download.repo} failed: {exc}"
        # Queued, not awaited: the answer to it may be a new wait, which ends this task.
        told = Command("event", event=Fetched(ok, detail, since, time.monotonic()))
        told.future.add_done_callback(_read_outcome)
        self._queue.put_nowait(told)

    def _stop_fetching(self) -> None:
        if self._fetching is not None and not self._fetching.done():
            self._fetching.cancel()
        self._fetching = None

    # ---- the process -----------------------------------------------------------------------------
    def _port(self) -> int:
        assert self.life.port is not None, "a worker always has a port"
        return self.life.port

    async def _alive(self) -> bool | None:
        """Is the engine there; None when its node did not answer."""
        engine = self.life.engine
        if engine is None:
            return False
        try:
            return await asyncio.to_thread(self.host.alive, engine.pid, engine.create_time, engine.cmdline)
        except OSError:
            return None

    def _exit_text(self) -> str:
        engine = self.life.engine
        code = self.host.exit_code(engine.pid) if engine else None
        return f"exited with code {code}" if code is not None else "exited"

    async def _end_group(self, quick: bool, pid: int | None = None) -> None:
        """Make sure nothing of a dead or failed engine's group lingers (engine core, workers)."""
        pid = pid or (self.life.engine.pid if self.life.engine else None)
        if pid:
            grace = 2.0 if quick else self.deps.settings.stop_grace_s
            with contextlib.suppress(OSError):
                await asyncio.to_thread(self.host.stop_group, pid, grace)
        self.logs.poll()

    async def _node_back(self) -> None:
        """The lost worker's node is back: re-adopt its engine if it still runs there, else start again."""
        if self.life.state != State.LOST:
            return  # stopped or moved meanwhile
        engine = self.life.engine
        host = self.deps.host_of(self._lost_node or self.node)
        found = False
        if engine is not None:
            try:
                found = await asyncio.to_thread(host.alive, engine.pid, engine.create_time, engine.cmdline)
            except OSError:
                return  # not answering yet: the next heartbeat tries again
        if not found or engine is None or self.deps.adopted is None:
            await self._feed(FoundGone())
            return
        self.host, self.node = host, host.node
        logs = sorted(self.log_dir.glob("start-*.log"))
        if logs and self._remote_log is None:
            self.logs.follow(logs[-1], from_start=True, secrets=self.secrets)
            self._copy_log_from(logs[-1])
        await self._feed(self.deps.adopted(self, f"re-adopted pid {engine.pid} on node {host.node}, which is back"))

    # ---- the log of an engine on another node ------------------------------------------------------
    def _copy_log_from(self, local: Path) -> None:
        """After a manager restart: go on copying a remote engine's log where the local copy ends."""
        if isinstance(self.host, LocalHost) or self.node is None:
            return
        _, remote_logs = node_folders(self.deps.settings.data_dir, self.node, self.id)
        self._remote_log = (remote_logs / local.name, local, _engine_bytes(local))

    async def _pull_log(self) -> None:
        """Copy what a remote engine wrote since the last look into the local log file that the
        worker's log tail, the API and the live stream read."""
        if self._remote_log is None or self.life.state == State.LOST:
            return
        remote, local, offset = self._remote_log
        try:
            chunk = await asyncio.to_thread(self.host.read_log, remote, offset)
        except OSError:
            return
        if chunk:
            with local.open("ab") as handle:
                handle.write(chunk)
            self._remote_log = (remote, local, offset + len(chunk))

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
        row.waits_for_node = life.waits_for_node
        row.port = life.port
        row.node = self.node
        row.run_dir = str(self._run_dir) if self._run_dir else None
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


def _read_outcome(future: asyncio.Future[WorkerView]) -> None:
    # Nobody waits for the outcome of a download's end: a failure of it is in the worker's state and events.
    if not future.cancelled():
        future.exception()


def _engine_bytes(local: Path) -> int:
    """How much of a remote engine's log a local copy holds: its size less the manager's own header
    lines ("# vllm-manager: ...", "# argv: ..."), which the engine's file does not have."""
    try:
        data = local.read_bytes()
    except OSError:
        return 0
    header = 0
    for line in data.splitlines(keepends=True):
        if not line.startswith(b"# "):
            break
        header += len(line)
    return len(data) - header
