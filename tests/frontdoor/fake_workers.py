"""A stand-in for the supervisor's public side, for scheduler tests without processes.

Workers move through the same states as real ones (downloading, starting, ready, stopped, failed) on a timer;
every command is logged, so a test can check that five requests made one start. As the supervisor does, a
worker whose download is over awaits the scheduler's ``make_room`` before its engine starts.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from manager.errors import Conflict, Invalid, ManagerError, NotFound
from manager.hub.fetching import Progress
from manager.placement import CannotFit, Place
from manager.supervisor.view import DownloadProgress, WorkerView
from manager.supervisor.worker_state import State


@dataclass
class Behaviour:
    """How a config's starts go."""

    start_s: float = 0.05  # seconds from start to ready
    error: str | None = None  # the start fails with this (vLLM's reason)
    never_ready: bool = False
    refused: str | None = None  # the start is refused at once (the planner's message)
    sleep_error: str | None = None  # the engine refuses to sleep
    wake_error: str | None = None  # the engine cannot wake
    wake_s: float = 0.01
    download_s: float | None = None  # its first start downloads the model for this long first
    download_error: str | None = None  # the download fails with this
    progress: Progress | None = None  # how far the download is, as its worker shows it


@dataclass
class FakeEvents:
    recorded: list[tuple[str, str, int | None]] = field(default_factory=list)

    def record(self, kind: str, message: str, worker_id: int | None = None, **data: object) -> dict:
        self.recorded.append((kind, message, worker_id))
        return {"kind": kind, "message": message}


class FakeWorkers:
    def __init__(
        self,
        behaviours: dict[str, Behaviour] | None = None,
        stop_s: float = 0.01,
        preflight: Callable[[str, list[WorkerView]], None] | None = None,
    ) -> None:
        self.behaviours = behaviours or {}
        self.stop_s = stop_s
        # The pre-start check: (the model to start, every worker) -> raises to refuse the start.
        self.preflight = preflight
        self._views: dict[int, WorkerView] = {}
        self._events = FakeEvents()
        self.commands: list[tuple[str, int | str]] = []
        self.sleep_levels: list[int] = []
        self.engine_keys: dict[int, str] = {}  # worker id -> the API key its engine asks for
        self.preferred: list[tuple[str, str | None]] = []  # (model, the node its start should try first)
        self._timers: set[asyncio.Task[None]] = set()
        self.downloaded: set[str] = set()  # models whose download is complete
        self._make_room: Callable[[str], Awaitable[None]] | None = None
        self._place_replica: Callable[[str], Place | CannotFit] | None = None

    @property
    def events(self) -> FakeEvents:
        return self._events

    # ---- the Workers protocol -------------------------------------------------------------------
    def views(self) -> list[WorkerView]:
        return [self._views[i] for i in sorted(self._views)]

    def ready_workers(self, model_name: str) -> list[WorkerView]:
        return [v for v in self.views() if v.model == model_name and v.state == State.READY and v.port is not None]

    def view(self, worker_id: int) -> WorkerView:
        try:
            return self._views[worker_id]
        except KeyError:
            raise NotFound(f"no worker with id {worker_id}") from None

    def engine_key(self, worker_id: int) -> str | None:
        return self.engine_keys.get(worker_id)

    def prefer_node(self, model: str, node: str | None) -> None:
        self.preferred.append((model, node))

    async def create_worker(
        self, model: str, gpus: list[int] | None = None, port: int | None = None, force: bool = False
    ) -> tuple[WorkerView, bool]:
        running = [v for v in self.views() if v.model == model and v.state not in (State.STOPPED, State.FAILED)]
        if running:  # as the supervisor does: a config already running gets no second worker
            return running[0], False
        self.commands.append(("create", model))
        wid = max(self._views, default=0) + 1
        # No GPU ids of its own, as for a config without gpu_ids: the scheduler uses its placement's.
        self._views[wid] = _view(wid, model, State.STOPPED, port=18000 + wid, gpus=[])
        return await self._start(wid), True

    async def command(
        self, worker_id: int, kind: str, model: str | None = None, force: bool = False, level: int | None = None
    ) -> WorkerView:
        self.commands.append((kind, worker_id))
        view = self.view(worker_id)
        behaviour = self.behaviours.get(view.model, Behaviour())
        if kind == "sleep":
            assert view.state == State.READY and level in (1, 2), (view.state, level)
            self.sleep_levels.append(level)
            if behaviour.sleep_error:
                raise Conflict(f"{view.model} could not be put to sleep: {behaviour.sleep_error}")
            return self._set(worker_id, State.SLEEPING)
        if kind == "wake":
            assert view.state == State.SLEEPING, view.state
            self._set(worker_id, State.WAKING)
            await asyncio.sleep(behaviour.wake_s)
            if behaviour.wake_error:
                self._set(worker_id, State.FAILED, last_error=f"waking failed: {behaviour.wake_error}")
                raise Conflict(f"{view.model}: waking failed: {behaviour.wake_error}")
            return self._set(worker_id, State.READY)
        if kind == "start":
            return await self._start(worker_id)
        if kind == "stop" and view.state == State.DOWNLOADING:
            return self._set(worker_id, State.STOPPED, download=None)
        if kind == "stop":
            self._set(worker_id, State.STOPPING)
            await asyncio.sleep(self.stop_s)
            return self._set(worker_id, State.STOPPED)
        raise AssertionError(f"unexpected command {kind} for {view.model}")

    def downloads_first(self, model_name: str) -> bool:
        behaviour = self.behaviours.get(model_name, Behaviour())
        return behaviour.download_s is not None and model_name not in self.downloaded

    def make_room_with(self, make_room: Callable[[str], Awaitable[None]]) -> None:
        self._make_room = make_room

    def place_replicas_with(self, place: Callable[[str], Place | CannotFit]) -> None:
        self._place_replica = place

    async def add_replica(self, model: str, why: str) -> WorkerView | None:
        self.commands.append(("add_replica", model))
        place = self._place_replica(model) if self._place_replica else Place(None, ())
        if isinstance(place, CannotFit):
            self._events.record("replica_not_placed", place.reason)
            return None
        wid = max(self._views, default=0) + 1
        self._views[wid] = _view(wid, model, State.STOPPED, port=18000 + wid, gpus=list(place.gpus), node=place.node)
        return await self._start(wid)

    async def remove_replica(self, worker_id: int, why: str) -> None:
        self.commands.append(("remove_replica", worker_id))
        self._views.pop(worker_id)

    # ---- for tests ----------------------------------------------------------------------------------
    def add_ready(self, model: str, gpus: tuple[int, ...] = (0,), node: str | None = None) -> int:
        """A worker that is already serving (started before the scheduler saw it), on ``node`` of a cluster."""
        wid = max(self._views, default=0) + 1
        self._views[wid] = _view(wid, model, State.READY, port=18000 + wid, gpus=list(gpus), node=node)
        return wid

    def state(self, worker_id: int) -> State:
        return self._views[worker_id].state

    def starts(self, model: str | None = None) -> int:
        """Creates and start commands (of ``model``'s workers, if given)."""
        count = 0
        for kind, what in self.commands:
            if kind == "create" and (model is None or what == model):
                count += 1
            if kind == "start" and isinstance(what, int) and (model is None or self._views[what].model == model):
                count += 1
        return count

    def stops(self) -> list[str]:
        return [self._views[w].model for kind, w in self.commands if kind == "stop" and isinstance(w, int)]

    # ---- machinery ------------------------------------------------------------------------------------
    async def _start(self, wid: int) -> WorkerView:
        behaviour = self.behaviours.get(self._views[wid].model, Behaviour())
        if behaviour.refused:
            raise Invalid(behaviour.refused)
        if self.preflight is not None:
            self.preflight(self._views[wid].model, self.views())
        model = self._views[wid].model
        if behaviour.download_s is not None and model not in self.downloaded:
            shown = DownloadProgress.of(behaviour.progress) if behaviour.progress else None
            view = self._set(wid, State.DOWNLOADING, last_error=None, download=shown)
            timer = asyncio.create_task(self._finish_download(wid, behaviour))
        else:
            view = self._set(wid, State.STARTING, last_error=None)
            timer = asyncio.create_task(self._finish_start(wid, behaviour))
        self._timers.add(timer)
        timer.add_done_callback(self._timers.discard)
        return view

    async def _finish_download(self, wid: int, behaviour: Behaviour) -> None:
        await asyncio.sleep(behaviour.download_s or 0.0)
        if self._views[wid].state != State.DOWNLOADING:
            return
        if behaviour.download_error:
            self._set(wid, State.FAILED, last_error=behaviour.download_error, download=None)
            return
        model = self._views[wid].model
        self.downloaded.add(model)
        if self._make_room is not None:
            try:
                await self._make_room(model)
            except ManagerError as exc:
                self._set(wid, State.FAILED, last_error=f"start refused: {exc.message}", download=None)
                return
        self._set(wid, State.STARTING, download=None)
        await self._finish_start(wid, behaviour)

    async def _finish_start(self, wid: int, behaviour: Behaviour) -> None:
        await asyncio.sleep(behaviour.start_s)
        if behaviour.never_ready or self._views[wid].state != State.STARTING:
            return
        if behaviour.error:
            self._set(wid, State.FAILED, last_error=behaviour.error)
        else:
            self._set(wid, State.READY)

    def _set(self, wid: int, state: State, **changes: object) -> WorkerView:
        self._views[wid] = self._views[wid].model_copy(update={"state": state, **changes})
        return self._views[wid]


def _view(
    wid: int, model: str, state: State, port: int, gpus: list[int] | None = None, node: str | None = None
) -> WorkerView:
    return WorkerView(
        id=wid, model=model, node=node, served_model_name=model, state=state, detail=None, pid=None, port=port,
        gpus=gpus if gpus is not None else [0], uptime_s=None, restart_count=0, next_restart_in_s=None,
        last_error=None, started_at=None, run_dir="/tmp/run", log_file=None,
    )  # fmt: skip
