"""The scheduler: serve a model now, join the start already under way, or make room and start it.

Per model config: a request is served at once when the config's worker is ready; when it is
starting, the request joins that start (one start per config, however many requests wait for it);
when it is stopped or asleep, placement (``manager.placement.decide``, with each worker's node) names
the workers to put to sleep or stop, the supervisor does so and starts (or wakes) this one, and every
waiting request goes on when it is ready. A model that must be downloaded first is started without
evicting anyone (its download holds no GPU, and may take minutes): the same decision is made when the
download is over and its engine is about to start (the supervisor asks, ``make_room_with``). A start
the pre-start check refuses because sleeping workers hold the host RAM it needs stops some of them on
that node (``placement.free_host_ram``) and is tried again. It also counts the
requests in flight per model, when each last answered and its last swap (``snapshot`` for the
dashboard), and unloads models idle past their ``idle_timeout_s`` (to sleep when their config
allows it and host RAM has room for what sleeping keeps there, else stopped).

Worker state is never changed here: every stop and start goes through the supervisor's public
commands, which hand them to the worker's runner and its state machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal, Protocol

from manager.errors import Conflict, ManagerError
from manager.frontdoor.errors import FrontDoorError, ModelDownloading, ModelUnavailable, QueueFull, StartTimeout
from manager.frontdoor.metrics import FrontDoorMetrics
from manager.frontdoor.replica_scale import Add, Remove, Scaling, scale_step
from manager.frontdoor.replicas import Replicas
from manager.launch.preflight import HostRamHeldBySleepers
from manager.placement import (
    CannotFit,
    MakeRoom,
    Need,
    Node,
    Place,
    RunningWorker,
    SleepingWorker,
    Snapshot,
    WaitForDrain,
    decide,
    free_host_ram,
    place_replica,
)
from manager.supervisor.view import WorkerView
from manager.supervisor.worker_state import State

log = logging.getLogger("vllm_manager.frontdoor")

# Workers that hold (or are about to hold) their GPUs; a crashed one restarts on its own soon.
# A sleeping worker has given its GPU memory back.
HOLDING = (State.STARTING, State.READY, State.CRASHED, State.WAKING)
# The worker a config already has: used as it is, woken, (crashed) started at once, or waited for while
# its model downloads (it holds no GPU until then: it is never evicted).
CURRENT = (*HOLDING, State.SLEEPING, State.DOWNLOADING)
# A stopped worker of the config is started again rather than a new one created.
RESTARTABLE = (State.STOPPED, State.FAILED, State.CRASHED)


class EventRecorder(Protocol):
    def record(self, kind: str, message: str, worker_id: int | None = None, **data: object) -> dict: ...


class Workers(Protocol):
    """The supervisor's public side that the scheduler uses."""

    @property
    def events(self) -> EventRecorder: ...

    def views(self) -> list[WorkerView]: ...

    def ready_workers(self, model_name: str) -> list[WorkerView]: ...

    def view(self, worker_id: int) -> WorkerView: ...

    def engine_key(self, worker_id: int) -> str | None: ...

    def prefer_node(self, model: str, node: str | None) -> None: ...

    async def create_worker(
        self, model: str, gpus: list[int] | None = None, port: int | None = None, force: bool = False
    ) -> tuple[WorkerView, bool]: ...

    async def command(
        self, worker_id: int, kind: str, model: str | None = None, force: bool = False, level: int | None = None
    ) -> WorkerView: ...

    def downloads_first(self, model_name: str) -> bool:
        """Whether a start of this model config now downloads its model before the engine starts."""
        ...

    def place_replicas_with(self, place: Callable[[str], Place | CannotFit]) -> None:
        """Have ``place(config)`` say where another replica of a running model goes."""
        ...

    async def add_replica(self, model: str, why: str) -> WorkerView | None:
        """Start one more replica of ``model`` where ``place_replicas_with`` says; None: it fits nowhere."""
        ...

    async def remove_replica(self, worker_id: int, why: str) -> None: ...

    def make_room_with(self, make_room: Callable[[str], Awaitable[None]]) -> None:
        """Have ``make_room(config)`` awaited before the engine of a start that downloaded its model first
        is launched; a ManagerError from it refuses the launch."""
        ...


@dataclass(frozen=True)
class Placement:
    """What the scheduler needs to know of one model config."""

    config: str
    gpus: tuple[int, ...]  # the GPU ids its worker uses
    gpu_bytes: int | None  # what it takes on each (vLLM's gpu_memory_utilization share); None: unknown
    start_timeout_s: float
    idle_timeout_s: float | None = None
    persistent: bool = False
    sleep_level: int | None = None  # vLLM sleep mode: 1 or 2; None: off
    sleep_host_bytes: int | None = None  # host RAM its sleep keeps (level 1: the weights); None: unknown
    sleep_pooled: bool = False  # level 1 through the sleep pool, whose RAM its start already counted
    wait_for_download: bool = False  # a request waits while its model downloads (else 503 + Retry-After)
    # The nodes its config allows (None: any node, or this box without a cluster).
    nodes: tuple[str | None, ...] | None = None
    # Its gpu_memory_utilization: the bytes it takes on a node's GPUs where gpu_bytes is None (a cluster,
    # whose nodes' GPUs may differ from this box's).
    gpu_share: float | None = None
    gpus_pinned: bool = False  # its config names its GPUs: its replicas use those, not others
    at_once: int = 256  # requests one of its engines runs at once (max_num_seqs); more wait in its queue
    scaling: Scaling | None = None  # its replicas' bounds when they scale with the load; None: they don't


@dataclass(frozen=True)
class SchedulerOptions:
    max_queue: int = 64  # requests waiting for one model (its start, a swap, a drain) before 429
    retry_after_s: int = 5
    drain_timeout_s: float = 60.0  # how long a swap waits for busy workers to finish, then 503
    poll_s: float = 0.2  # how often a start is checked for readiness
    idle_check_s: float = 5.0


@dataclass
class Lease:
    """One request's hold on a ready worker; ``release()`` when its response has ended."""

    config: str
    worker_id: int
    pid: int | None  # the engine process: a restarted worker is another engine
    port: int
    served_name: str
    waited_s: float
    _on_release: Callable[[Lease], None]
    released: bool = False
    queued: bool = False  # it waited (for a start, a swap or a drain) rather than being served at once
    address: str = "127.0.0.1"  # where the engine answers (another node's address in a cluster)
    engine_key: str | None = field(default=None, repr=False)  # the API key the engine asks for

    def release(self) -> None:
        if not self.released:
            self.released = True
            self._on_release(self)


SwapKind = Literal["cold", "wake"]
# What the dashboard shows for a model config: its current worker's state, or stopped.
ModelState = Literal[
    "ready", "sleeping", "downloading", "starting", "waking", "crashed", "stopping", "failed", "stopped"
]


@dataclass(frozen=True)
class Swap:
    """A model brought in for requests: started cold (a process start) or woken from sleep."""

    kind: SwapKind
    seconds: float  # from deciding to serve it to its worker being ready
    ended_at: float  # on the scheduler's clock


@dataclass(frozen=True)
class ModelStatus:
    """One model config as the front door sees it."""

    config: str
    state: ModelState
    worker_id: int | None  # the worker that serves it (or will, or failed to); None: stopped
    in_flight: int
    queued: int
    last_swap: Swap | None
    last_swap_ago_s: float | None
    replicas: tuple[int, ...] = ()  # its workers that serve or are coming up (several: replicas), by id


@dataclass
class _Leaving:
    """A model being stopped (or drained before a stop): its new requests wait until this is done."""

    done: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass
class _Slot:
    """The scheduler's bookkeeping for one model config."""

    in_flight: int = 0  # requests forwarded to its worker, not yet answered in full
    queued: int = 0  # requests waiting for it (a start, a swap, a drain)
    joined: int = 0  # of those, the ones waiting for its start: they count as in flight
    last_done: float | None = None  # when its last response ended
    ready_seen: float | None = None  # when the scheduler first saw its current worker ready
    start: asyncio.Task[WorkerView] | None = None  # the one start under way, joined by every waiter
    leaving: _Leaving | None = None
    last_swap: Swap | None = None
    # Started for requests while its model downloads, without evicting anyone: room for it is made
    # when its engine is about to start.
    room_at_launch: bool = False


class Scheduler:
    def __init__(
        self,
        workers: Workers,
        placements: Callable[[], Mapping[str, Placement]],
        # Each node's GPUs and their total bytes, by node (None: this box), in the order starts prefer
        # them; a node's GPUs None where they are not known. None: this box, GPUs not known.
        gpu_capacity: Callable[[], Mapping[str | None, Mapping[int, int] | None] | None] = lambda: None,
        options: SchedulerOptions | None = None,
        metrics: FrontDoorMetrics | None = None,
        # Host RAM available on a node (None: this box, without a cluster); None: not known.
        host_available: Callable[[str | None], int | None] = lambda node: None,
        clock: Callable[[], float] = time.monotonic,
        sleep_pool_held: Callable[[int], int] = lambda worker_id: 0,
    ) -> None:
        self.workers = workers
        self.options = options or SchedulerOptions()
        self.metrics = metrics
        self._placements = placements
        self._gpu_capacity = gpu_capacity
        self._host_available = host_available
        self._sleep_pool_held = sleep_pool_held
        self._clock = clock
        self._slots: dict[str, _Slot] = {}
        self._placing = asyncio.Lock()  # one decision to evict and start at a time
        self._released = asyncio.Event()  # set (and replaced) whenever a request ends
        self._idle_task: asyncio.Task[None] | None = None
        self.replicas = Replicas(clock)
        workers.make_room_with(self._room_at_launch)
        workers.place_replicas_with(self.place_replica)

    # ---- requests ---------------------------------------------------------------------------
    async def acquire(self, config: str, affinity: str | None = None, avoid: tuple[int, ...] = ()) -> Lease:
        """A lease on a ready worker of ``config``, starting it (and making room) when needed. With
        replicas, the one ``replica_choice`` picks: ``affinity`` names the request's conversation, and
        ``avoid`` the workers that just failed to answer it."""
        started = self._clock()
        slot = self._slot(config)
        if slot.leaving is None:
            ready = self._pick(config, affinity, avoid)
            if ready is not None:
                return self._lease(config, slot, ready, started)
        if slot.queued >= self.options.max_queue:
            raise QueueFull(
                f"{slot.queued} requests are already waiting for {config!r} (the limit is "
                f"{self.options.max_queue}); retry in a few seconds",
                self.options.retry_after_s,
            )
        slot.queued += 1
        joined = False
        try:
            while True:
                # A request that waited for this very start is served even if another model already
                # waits for this one to drain (it counts as in flight until it is served). A replica is
                # picked only for a request that is served now: picking counts a request on it.
                if slot.leaving is None or joined:
                    ready = self._pick(config, affinity, avoid)
                    if ready is not None:
                        return self._lease(config, slot, ready, started, queued=True)
                if slot.leaving is not None:
                    await slot.leaving.done.wait()
                    continue
                if slot.start is None or slot.start.done():
                    slot.start = asyncio.create_task(self._bring_up(config), name=f"start {config}")
                    slot.start.add_done_callback(_retrieve)
                if not joined:
                    joined = True
                    slot.joined += 1
                # Shielded: a waiter that gives up (its client left) must not cancel the start for the others.
                await asyncio.shield(slot.start)
        finally:
            slot.queued -= 1
            if joined:
                slot.joined -= 1

    def _pick(self, config: str, affinity: str | None, avoid: tuple[int, ...]) -> WorkerView | None:
        ready = self.workers.ready_workers(config)
        if not ready:
            return None
        return self.replicas.pick(config, ready, affinity, avoid)

    def _lease(self, config: str, slot: _Slot, view: WorkerView, started: float, queued: bool = False) -> Lease:
        assert view.port is not None
        slot.in_flight += 1
        if slot.ready_seen is None:
            slot.ready_seen = self._clock()
        waited = self._clock() - started
        if self.metrics is not None:
            self.metrics.in_flight.labels(config).inc()
            self.metrics.queue_wait.observe(waited)
        served = view.served_model_name or config
        return Lease(
            config,
            view.id,
            view.pid,
            view.port,
            served,
            waited,
            self._release,
            queued=queued,
            address=view.address,
            engine_key=self.workers.engine_key(view.id),
        )

    def _release(self, lease: Lease) -> None:
        slot = self._slot(lease.config)
        slot.in_flight -= 1
        self.replicas.released(lease.config, lease.worker_id)
        slot.last_done = self._clock()
        if self.metrics is not None:
            self.metrics.in_flight.labels(lease.config).dec()
        self._released.set()
        self._released = asyncio.Event()

    def queue_state(self) -> dict[str, dict[str, int]]:
        """Per model config: requests in flight and requests waiting (for pages and tests)."""
        return {name: {"in_flight": s.in_flight, "queued": s.queued} for name, s in self._slots.items()}

    def snapshot(self) -> list[ModelStatus]:
        """Every model config, by name: its state, its requests in flight and waiting, its last swap."""
        views = self.workers.views()
        now = self._clock()
        out = []
        for config in sorted(self._placements()):
            slot = self._slots.get(config) or _Slot()
            current = next((v for v in views if v.model == config and v.state in CURRENT), None)
            stopping = next((v for v in views if v.model == config and v.state == State.STOPPING), None)
            # A failed start stays "failed" (its card says why) until the next request or start tries again.
            failed = next((v for v in views if v.model == config and v.state == State.FAILED), None)
            shown = current or stopping or failed
            swap = slot.last_swap
            out.append(
                ModelStatus(
                    config=config,
                    state=_MODEL_STATE.get(shown.state, "stopped") if shown else "stopped",
                    worker_id=shown.id if shown else None,
                    in_flight=slot.in_flight,
                    queued=slot.queued,
                    last_swap=swap,
                    last_swap_ago_s=max(0.0, now - swap.ended_at) if swap else None,
                    replicas=tuple(v.id for v in views if v.model == config and v.state in CURRENT),
                )
            )
        return out

    # ---- bringing a model up ----------------------------------------------------------------------
    async def _bring_up(self, config: str) -> WorkerView:
        """Make room for ``config`` and start it; the one start every waiting request joins."""
        started = self._clock()
        placement = self._placements().get(config)
        if placement is None:
            raise ModelUnavailable(f"model config {config!r} no longer exists")
        drain_deadline = started + self.options.drain_timeout_s
        draining: dict[str, _Leaving] = {}  # models this start asked to drain: their new requests wait
        slot = self._slot(config)
        try:
            # A stop asked for elsewhere (the API) is let finish: its worker is then started again.
            while any(v.model == config and v.state == State.STOPPING for v in self.workers.views()):
                if self._clock() - started > placement.start_timeout_s:
                    raise StartTimeout(f"{config} is still stopping after {placement.start_timeout_s:g} s")
                await asyncio.sleep(self.options.poll_s)
            target = await self._download_first(placement) if self.workers.downloads_first(config) else None
            while target is None:
                async with self._placing:
                    current = self._current_worker(config)
                    if current is not None and current.state not in (State.CRASHED, State.SLEEPING):
                        target = current  # started meanwhile (by the API, or an earlier start)
                        break
                    decision = self._decide(placement)
                    if isinstance(decision, Place | MakeRoom):
                        if isinstance(decision, MakeRoom):
                            await self._evict(decision, f"to make room for {config}")
                        if current is not None and current.state == State.SLEEPING:
                            target = await self._wake(current, started)
                        else:
                            slot.room_at_launch = False  # made now
                            target = await self._start(config, current)
                        break
                    self._drain(decision, draining)
                await self._until_drained(decision, drain_deadline)
        except ManagerError as exc:  # a worker deleted meanwhile, a stop that failed
            raise ModelUnavailable(f"{config} could not be started: {exc.message}") from exc
        finally:
            for name, leaving in draining.items():
                self._end_leaving(name, leaving)
        return await self._until_ready(target, placement, started)

    async def _download_first(self, placement: Placement) -> WorkerView | None:
        """Start a config whose model must be downloaded first without evicting anyone: the download holds
        no GPU, and room is made once it is over (``_room_at_launch``). None when it is to be started as
        any other: it has a worker already, or the pre-start check refused it while workers that eviction
        would stop were running (their memory counted against it)."""
        config = placement.config
        slot = self._slot(config)
        async with self._placing:
            if self._current_worker(config) is not None:
                return None
            # One that can never get its GPUs (persistent models hold them) is not downloaded for nothing.
            decision = self._decide(placement)
            slot.room_at_launch = True
        try:
            view = await self._start(config, None)
        except ModelUnavailable:
            slot.room_at_launch = False
            if isinstance(decision, Place):
                raise  # nobody is in its way: the refusal is the model's own
            return None
        if view.state != State.DOWNLOADING:  # downloaded by someone else just now: its engine starts as it is
            slot.room_at_launch = False
        return view

    async def _room_at_launch(self, config: str) -> None:
        """Before the engine of ``config`` starts once its model is downloaded: the eviction its start for
        requests left until now (the supervisor awaits this). A start made elsewhere evicts nobody, as
        before. Raises Conflict when room cannot be made: the worker fails with the reason."""
        slot = self._slots.get(config)
        placement = self._placements().get(config)
        if slot is None or not slot.room_at_launch or placement is None:
            return
        slot.room_at_launch = False
        deadline = self._clock() + self.options.drain_timeout_s
        draining: dict[str, _Leaving] = {}
        try:
            while True:
                async with self._placing:
                    decision = self._decide(placement)
                    if isinstance(decision, Place | MakeRoom):
                        if isinstance(decision, MakeRoom):
                            await self._evict(decision, f"to make room for {config}")
                        return
                    self._drain(decision, draining)
                await self._until_drained(decision, deadline)
        except FrontDoorError as exc:
            raise Conflict(exc.message) from exc
        finally:
            for name, leaving in draining.items():
                self._end_leaving(name, leaving)

    def _decide(self, placement: Placement) -> Place | MakeRoom | WaitForDrain:
        """Where ``placement`` starts and what must go first (the node it is tried on first is the one with
        the room); ModelUnavailable when it cannot start at all."""
        decision = decide(self._need(placement), self._snapshot(placement.config))
        if isinstance(decision, CannotFit):
            raise ModelUnavailable(f"{placement.config} cannot be started: {decision.reason}")
        if isinstance(decision, Place | MakeRoom):
            place = decision.then if isinstance(decision, MakeRoom) else decision
            self.workers.prefer_node(placement.config, place.node)  # where the room is
        return decision

    def _drain(self, decision: WaitForDrain, draining: dict[str, _Leaving]) -> None:
        """New requests for the models that must drain wait (until ``draining`` is ended)."""
        for name in self._configs_of(decision.workers):
            leaving = self._mark_leaving(name)
            if leaving is not None:
                draining[name] = leaving

    async def _until_drained(self, decision: WaitForDrain, deadline: float) -> None:
        if not await self._drained(decision.workers, deadline):
            raise ModelUnavailable(
                f"{decision.reason}; they did not finish within {self.options.drain_timeout_s:g} s. "
                "Retry later, or give the models different GPUs"
            )

    def _need(self, placement: Placement) -> Need:
        return Need(placement.config, placement.gpus, placement.gpu_bytes, placement.nodes, placement.gpu_share)

    def _snapshot(self, config: str, own_too: bool = False) -> Snapshot:
        running = self._running(config, own_too)
        capacity = self._gpu_capacity()
        nodes: dict[str | None, Mapping[int, int] | None] = dict(capacity) if capacity is not None else {None: None}
        for worker in running:
            nodes.setdefault(worker.node, None)
        return Snapshot(tuple(Node(name, gpus) for name, gpus in nodes.items()), tuple(running))

    def _running(self, config: str, own_too: bool = False) -> list[RunningWorker]:
        placements = self._placements()
        running = []
        for view in self.workers.views():
            if view.state not in HOLDING or (view.model == config and not own_too):
                continue
            placement = placements.get(view.model)
            slot = self._slot(view.model)
            running.append(
                RunningWorker(
                    id=view.id,
                    config=view.model,
                    gpus=tuple(view.gpus) or (placement.gpus if placement else (0,)),
                    gpu_bytes=placement.gpu_bytes if placement else None,
                    gpu_share=placement.gpu_share if placement else None,
                    last_request_at=_latest(slot.last_done, slot.ready_seen),
                    # Requests waiting for its start count as in flight: evicting it would strand them.
                    in_flight=slot.in_flight + slot.joined,
                    persistent=placement.persistent if placement else False,
                    may_sleep=self._may_sleep(placement, view.id, view.node),
                    node=view.node,
                )
            )
        return running

    def _configs_of(self, worker_ids: tuple[int, ...]) -> list[str]:
        by_id = {v.id: v.model for v in self.workers.views()}
        return [by_id[i] for i in worker_ids if i in by_id]

    async def _drained(self, worker_ids: tuple[int, ...], deadline: float) -> bool:
        """Wait until these workers have no request in flight; False when the deadline passes first."""
        while True:
            running = {w.id: w for w in self._running(config="")}
            if all(running[i].in_flight == 0 for i in worker_ids if i in running):
                return True
            left = deadline - self._clock()
            if left <= 0:
                return False
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._released.wait(), timeout=min(left, 1.0))

    def _may_sleep(self, placement: Placement | None, worker_id: int, node: str | None) -> bool:
        """Sleep mode is on, and the host RAM of the worker's node has room for what the sleep keeps
        there (beyond what the worker's sleep pool already holds)."""
        if placement is None or placement.sleep_level is None:
            return False
        if placement.sleep_level >= 2:
            return True  # level 2 keeps nothing in host RAM
        if placement.sleep_host_bytes is None:
            return False
        held = self._sleep_pool_held(worker_id) if placement.sleep_pooled else 0
        need = max(0, placement.sleep_host_bytes - held)
        if need == 0:
            return True
        available = self._host_available(node)
        return available is not None and available >= need

    async def _evict(self, decision: MakeRoom, why: str) -> None:
        views = [self.workers.view(i) for i in decision.sleep + decision.stop]
        # All of them first: none may take a new request while another one is being stopped.
        marks = [(v.model, self._mark_leaving(v.model)) for v in views]
        placements = self._placements()
        try:
            for view in views:
                placement = placements.get(view.model)
                if view.id in decision.sleep and placement is not None and placement.sleep_level is not None:
                    await self._unload(view, placement.sleep_level, f" {why}", kind="evicted")
                else:
                    await self._stop(view, f"stopped {view.model} {why}", kind="evicted")
        finally:
            for model, leaving in marks:
                if leaving is not None:
                    self._end_leaving(model, leaving)

    async def _stop(self, view: WorkerView, message: str, kind: str, **data: object) -> None:
        """Stop one worker through the supervisor; its model's new requests wait until it is down."""
        leaving = self._mark_leaving(view.model)
        try:
            await self.workers.command(view.id, "stop")
            self.workers.events.record(kind, message, view.id, model=view.model, **data)
        finally:
            self._slot(view.model).ready_seen = None
            if leaving is not None:
                self._end_leaving(view.model, leaving)

    async def _unload(self, view: WorkerView, sleep_level: int | None, why: str, kind: str, **data: object) -> None:
        """Put the worker to sleep (when ``sleep_level``), or stop it; a sleep the engine refuses is a stop."""
        if sleep_level is None:
            await self._stop(view, f"stopped {view.model}{why}", kind=kind, **data)
            return
        leaving = self._mark_leaving(view.model)
        try:
            await self.workers.command(view.id, "sleep", level=sleep_level)
            self.workers.events.record(kind, f"put {view.model} to sleep{why}", view.id, model=view.model, **data)
        except ManagerError as exc:
            log.warning("%s could not sleep (%s): stopping it instead", view.model, exc.message)
            await self._stop(view, f"stopped {view.model}{why} (sleep failed: {exc.message})", kind=kind, **data)
        finally:
            self._slot(view.model).ready_seen = None
            if leaving is not None:
                self._end_leaving(view.model, leaving)

    def _mark_leaving(self, config: str) -> _Leaving | None:
        """Make new requests for ``config`` wait; None when someone else already did (they end it)."""
        slot = self._slot(config)
        if slot.leaving is not None:
            return None
        slot.leaving = _Leaving()
        return slot.leaving

    def _end_leaving(self, config: str, leaving: _Leaving) -> None:
        slot = self._slot(config)
        if slot.leaving is leaving:
            slot.leaving = None
        leaving.done.set()

    async def _start(self, config: str, crashed: WorkerView | None) -> WorkerView:
        """Start the config's stopped worker again (the newest), or create one; when sleeping workers
        hold the host RAM the start needs, stop the fewest of them and try once more."""
        try:
            return await self._start_once(config, crashed)
        except HostRamHeldBySleepers as held:
            decision = free_host_ram(self._sleeping(held), held.short_bytes, config, held.node)
            if isinstance(decision, CannotFit):
                raise ModelUnavailable(f"{config} could not be started: {decision.reason}") from held
            for view in [self.workers.view(i) for i in decision.stop]:
                await self._stop(view, f"stopped {view.model} (asleep) to free host RAM for {config}", kind="evicted")
        try:
            return await self._start_once(config, crashed)
        except HostRamHeldBySleepers as held:
            raise ModelUnavailable(f"{config} could not be started: {held.message}") from held

    async def _start_once(self, config: str, crashed: WorkerView | None) -> WorkerView:
        earlier = crashed or max(
            (v for v in self.workers.views() if v.model == config and v.state in RESTARTABLE),
            key=lambda v: v.id,
            default=None,
        )
        try:
            if earlier is not None:
                view = await self.workers.command(earlier.id, "start")
                await self.workers.create_worker(config)  # its other replicas, where they fit
                return view
            view, _ = await self.workers.create_worker(config)
            return view
        except HostRamHeldBySleepers:
            raise
        except ManagerError as exc:
            # The planner's refusal, a port that is taken, an engine interpreter that is missing ...
            raise ModelUnavailable(f"{config} could not be started: {exc.message}") from exc

    def _sleeping(self, held: HostRamHeldBySleepers) -> list[SleepingWorker]:
        """The sleepers the pre-start check named, with what each holds, that are still asleep."""
        placements = self._placements()
        sleeping = {v.id: v for v in self.workers.views() if v.state == State.SLEEPING}
        out = []
        for sleeper in held.sleepers:
            view = sleeping.get(sleeper.worker_id)
            if view is None:
                continue
            placement = placements.get(view.model)
            slot = self._slot(view.model)
            out.append(
                SleepingWorker(
                    id=view.id,
                    config=view.model,
                    host_bytes=sleeper.host_bytes,
                    last_request_at=_latest(slot.last_done, slot.ready_seen),
                    persistent=placement.persistent if placement else False,
                    node=view.node,
                )
            )
        return out

    async def _wake(self, sleeper: WorkerView, started: float) -> WorkerView:
        try:
            view = await self.workers.command(sleeper.id, "wake")
        except ManagerError as exc:
            raise ModelUnavailable(f"{sleeper.model} could not be woken: {exc.message}") from exc
        self._swapped(sleeper.model, "wake", self._clock() - started)
        return view

    def _swapped(self, config: str, kind: SwapKind, seconds: float) -> None:
        self._slot(config).last_swap = Swap(kind, seconds, self._clock())
        if self.metrics is not None:
            self.metrics.swap.labels(kind).observe(seconds)

    async def _until_ready(self, target: WorkerView, placement: Placement, started: float) -> WorkerView:
        # The start timeout counts from the engine's launch: the model's download (its own timeout, kept
        # by the worker) is not part of it.
        deadline: float | None = None if target.state == State.DOWNLOADING else started + placement.start_timeout_s
        config = placement.config
        while True:
            try:
                view = self.workers.view(target.id)
            except ManagerError as exc:
                raise ModelUnavailable(f"{config} could not be started: {exc.message}") from exc
            if view.model != config:
                raise ModelUnavailable(f"the worker starting {config} was switched to {view.model}")
            if view.state == State.READY:
                if target.state != State.READY:  # it was started for these requests: a cold swap
                    seconds = self._clock() - started
                    self._swapped(config, "cold", seconds)
                    self.workers.events.record(
                        "swapped_in", f"started {config} in {seconds:.1f} s", view.id, model=config, seconds=seconds
                    )
                return view
            if view.state == State.DOWNLOADING:
                if not placement.wait_for_download:
                    raise ModelDownloading.of(config, view.download.progress if view.download else None)
                deadline = None
                await asyncio.sleep(self.options.poll_s)
                continue
            if deadline is None:
                deadline = self._clock() + placement.start_timeout_s
            late = self._clock() >= deadline
            if view.state not in (State.STARTING, State.WAKING) and not late:
                reason = view.last_error or f"its worker is {view.state.value}"
                raise ModelUnavailable(f"{config} failed to start: {reason}")
            if late:
                # The worker's own start deadline counts from its launch, a moment after this one: by
                # the time this sees it, the worker may already have been failed for the same reason.
                now = view.detail if view.state == State.STARTING else view.last_error
                raise StartTimeout(
                    f"{config} was not ready within its start_timeout_s ({placement.start_timeout_s:g} s) "
                    f"({now or 'no log line yet'}). Retry later, or raise start_timeout_s in its model config"
                )
            await asyncio.sleep(self.options.poll_s)

    # ---- idle unload ---------------------------------------------------------------------------
    def start(self) -> None:
        if self._idle_task is None:
            self._idle_task = asyncio.create_task(self._idle_loop(), name="front door idle unload")

    async def stop(self) -> None:
        if self._idle_task is not None:
            self._idle_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._idle_task
            self._idle_task = None
        for slot in self._slots.values():
            if slot.start is not None and not slot.start.done():
                slot.start.cancel()

    async def _idle_loop(self) -> None:
        while True:
            await asyncio.sleep(self.options.idle_check_s)
            try:
                await self.unload_idle()
                await self.scale_replicas()
            except Exception:  # one bad round must not end idle unloading for good
                log.exception("idle unload or replica scaling failed")

    async def unload_idle(self) -> list[str]:
        """Put to sleep or stop every ready model idle longer than its idle_timeout_s; returns them."""
        placements = self._placements()
        stopped = []
        for view in self.workers.views():
            slot = self._slot(view.model)
            if view.state != State.READY:
                slot.ready_seen = None
                continue
            now = self._clock()
            if slot.ready_seen is None:
                slot.ready_seen = now  # the idle time of a worker counts from when it was seen ready
            placement = placements.get(view.model)
            if placement is None or placement.idle_timeout_s is None:
                continue
            async with self._placing:
                if not self._is_idle(view, slot):
                    continue
                idle = now - (_latest(slot.last_done, slot.ready_seen) or now)
                if idle < placement.idle_timeout_s:
                    continue
                level = placement.sleep_level if self._may_sleep(placement, view.id, view.node) else None
                kind = "idle_slept" if level is not None else "idle_stopped"
                await self._unload(view, level, f": idle {idle:.0f} s", kind=kind, idle_s=round(idle, 1))
                stopped.append(view.model)
        return stopped

    def _is_idle(self, view: WorkerView, slot: _Slot) -> bool:
        try:
            current = self.workers.view(view.id)
        except ManagerError:
            return False
        return (
            current.state == State.READY
            and current.model == view.model
            and slot.in_flight == 0
            and slot.queued == 0
            and slot.leaving is None
        )

    # ---- replicas --------------------------------------------------------------------------------------
    def place_replica(self, config: str) -> Place | CannotFit:
        """Where another replica of ``config`` goes: free room only, beside every worker (its own too)."""
        placement = self._placements().get(config)
        if placement is None:
            return CannotFit(f"model config {config!r} no longer exists")
        snapshot = self._snapshot(config, own_too=True)
        return place_replica(self._need(placement), snapshot, pinned=placement.gpus_pinned)

    async def scale_replicas(self) -> list[Add | Remove]:
        """One step of scaling for every model whose replicas scale with the load; returns the steps taken."""
        taken: list[Add | Remove] = []
        views = self.workers.views()
        for config, placement in self._placements().items():
            if placement.scaling is None:
                continue
            current = [v for v in views if v.model == config and v.state in CURRENT]
            states = self.replicas.states(config, current)
            saturated = self.replicas.saturated_since(config, placement.at_once)
            step = scale_step(states, placement.scaling, saturated, self._clock())
            if isinstance(step, Add):
                async with self._placing:  # the room it takes is not promised to a start meanwhile
                    added = await self.workers.add_replica(config, step.reason)
                if added is not None:
                    taken.append(step)
            elif isinstance(step, Remove):
                async with self._placing:
                    if self.replicas.in_flight(config, step.worker_id) == 0:
                        await self.workers.remove_replica(step.worker_id, step.reason)
                        self.replicas.forget(config, step.worker_id)
                        taken.append(step)
        return taken

    # ---- reading the workers ------------------------------------------------------------------------
    def _slot(self, config: str) -> _Slot:
        slot = self._slots.get(config)
        if slot is None:
            slot = self._slots[config] = _Slot()
        return slot

    def _current_worker(self, config: str) -> WorkerView | None:
        for view in self.workers.views():
            if view.model == config and view.state in CURRENT:
                return view
        return None


_MODEL_STATE: dict[State, ModelState] = {
    State.READY: "ready",
    State.SLEEPING: "sleeping",
    State.DOWNLOADING: "downloading",
    State.STARTING: "starting",
    State.WAKING: "waking",
    State.CRASHED: "crashed",
    State.STOPPING: "stopping",
    State.FAILED: "failed",
}


def _latest(*times: float | None) -> float | None:
    known = [t for t in times if t is not None]
    return max(known) if known else None


def _retrieve(task: asyncio.Task[WorkerView]) -> None:
    # Every waiter may have gone (their clients left): the start's outcome must still be read.
    if not task.cancelled():
        task.exception()
