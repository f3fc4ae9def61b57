"""The scheduler: serve a model now, join the start already under way, or make room and start it.

Per model config: a request is served at once when the config's worker is ready (with replicas, the
one ``replica_choice`` picks); when it is starting, the request joins that start (one start per config,
however many requests wait for it); when it is stopped or asleep, ``room`` makes room for it (the
workers ``manager.placement`` names are put to sleep or stopped), the supervisor starts (or wakes)
it, and every waiting request goes on when it is ready. Requests that wait (for a start, a swap, a
drain, or a place among the config's ``max_concurrent`` in flight) go in ``fair_queue``'s order:
interactive keys before batch ones, the keys taking turns; each waits at most the queue timeout for its
turn at a ready model (504), a key may have only so many waiting (429), and one whose client leaves
leaves the queue. A model that must be downloaded first is
started without evicting anyone (its download holds no GPU, and may take minutes): room is made when
the download is over and its engine is about to start (the supervisor asks, ``make_room_with``). A
start or wake made here for requests that have all gone (their clients left) is stopped after
``CANCEL_GRACE_S``, its GPU free for the next request; a start asked for elsewhere, and a download,
are never cancelled.

Each config's requests in flight and waiting, its last use and last swap are kept in ``slots``
(``snapshot`` for the dashboard); ``upkeep`` unloads idle models and scales replicas with the load.
Worker state is never changed here: every stop and start goes through the supervisor's public
commands, which hand them to the worker's runner and its state machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal

from manager.errors import ManagerError
from manager.frontdoor import loading
from manager.frontdoor.errors import (
    LoadCancelled,
    ModelDownloading,
    ModelUnavailable,
    QueueFull,
    QueueTimeout,
    StartTimeout,
)
from manager.frontdoor.metrics import FrontDoorMetrics
from manager.frontdoor.placements import Placement
from manager.frontdoor.replica_scale import Add, Remove
from manager.frontdoor.replicas import Replicas
from manager.frontdoor.room import Room
from manager.frontdoor.slots import Leaving, Loading, Slot, Slots, Swap, SwapKind
from manager.frontdoor.upkeep import Upkeep
from manager.frontdoor.workers import CURRENT, Workers
from manager.placement import MakeRoom, Place
from manager.schemas.usage import NO_KEY
from manager.supervisor.view import WorkerView
from manager.supervisor.worker_state import State

# How long a start or wake the front door made for requests runs on once none of them waits any more,
# before it is cancelled: a client that gave up and retries at once (a reconnecting client, a proxy's
# retry) finds it still under way rather than stopped and started again from nothing.
CANCEL_GRACE_S = 2.0


@dataclass(frozen=True)
class SchedulerOptions:
    max_queue: int = 64  # requests waiting for one model (its start, a swap, a drain, their turn) before 429
    max_queue_per_key: int = 32  # of those, from one inference key
    queue_timeout_s: float = 600.0  # how long a request waits for its turn at a ready model, then 504
    retry_after_s: int = 5
    drain_timeout_s: float = 60.0  # how long a swap waits for busy workers to finish, then 503
    poll_s: float = 0.2  # how often a start is checked for readiness
    cancel_grace_s: float = CANCEL_GRACE_S
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


# What the dashboard shows for a model config: its current worker's state, or stopped.
ModelState = Literal[
    "ready", "sleeping", "downloading", "starting", "waking", "crashed", "stopping", "failed", "stopped"
]


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
        # The most requests a config may have in flight over all its workers (its max_concurrent); None: no limit.
        max_concurrent: Callable[[str], int | None] = lambda config: None,
    ) -> None:
        self.workers = workers
        self.options = options or SchedulerOptions()
        self.metrics = metrics
        self._placements = placements
        self._clock = clock
        self._max_concurrent = max_concurrent
        self.slots = Slots(clock)
        self.replicas = Replicas(clock)
        self.room = Room(
            workers,
            placements,
            self.slots,
            self.options.drain_timeout_s,
            gpu_capacity,
            host_available,
            sleep_pool_held,
            clock,
        )
        self.upkeep = Upkeep(
            workers, placements, self.slots, self.replicas, self.room, self.options.idle_check_s, clock
        )
        workers.make_room_with(self.room.at_launch)
        workers.place_replicas_with(self.room.place_replica)

    # ---- requests ---------------------------------------------------------------------------
    async def acquire(
        self,
        config: str,
        affinity: str | None = None,
        avoid: tuple[int, ...] = (),
        key: int = NO_KEY,
        priority: str = "interactive",
    ) -> Lease:
        """A lease on a ready worker of ``config``, starting it (and making room) when needed. With
        replicas, the one ``replica_choice`` picks: ``affinity`` names the request's conversation, and
        ``avoid`` the workers that just failed to answer it. A request that cannot be served at once
        waits in the config's fair queue: by ``priority``, then taking turns with the other inference
        keys (``key``), and it goes only while the config has fewer than its max_concurrent in flight."""
        started = self._clock()
        slot = self.slots.of(config)
        limit = self._max_concurrent(config)
        if slot.leaving is None and not slot.waiting and _has_room(slot, limit):
            ready = self._pick(config, affinity, avoid)
            if ready is not None:
                return self._lease(config, slot, ready, started)
        self._refuse_when_full(config, slot, key)
        ticket = slot.waiting.join(key, priority)
        deadline: float | None = None  # set once it waits for its turn at a ready model
        try:
            while True:
                limit = self._max_concurrent(config)
                # A request that waited for this very start is served even if another model already
                # waits for this one to drain (it counts as in flight until it is served). A replica is
                # picked only for a request that is served now: picking counts a request on it.
                turn = slot.waiting.next(None if slot.leaving is None else slot.joined.__contains__)
                if turn is ticket and _has_room(slot, limit):
                    ready = self._pick(config, affinity, avoid)
                    if ready is not None:
                        slot.waiting.release(ticket)
                        return self._lease(config, slot, ready, started, queued=True)
                if slot.leaving is not None and ticket not in slot.joined:
                    await slot.leaving.done.wait()
                    continue
                if not self.workers.ready_workers(config):
                    if slot.start is None or slot.start.done():
                        slot.start = asyncio.create_task(self._bring_up(config), name=f"start {config}")
                        slot.start.add_done_callback(_retrieve)
                    slot.joined.add(ticket)
                    # Shielded: a waiter that gives up (its client left) must not cancel the start for the others.
                    with contextlib.suppress(LoadCancelled):  # joined as it was cancelled: it starts again
                        await asyncio.shield(slot.start)
                    continue
                # Its model is ready: it waits for the requests ahead of it, or for a place among max_concurrent.
                if deadline is None:
                    deadline = self._clock() + self.options.queue_timeout_s
                await self._until_changed(config, slot, deadline, limit)
        finally:
            slot.waiting.drop(ticket)  # (when it was not let through)
            slot.joined.discard(ticket)
            slot.notify()

    def _refuse_when_full(self, config: str, slot: Slot, key: int) -> None:
        """QueueFull (429) when the config's queue, or this key's share of it, is full."""
        if slot.queued >= self.options.max_queue:
            raise QueueFull(
                f"{slot.queued} requests are already waiting for {config!r} (the limit is "
                f"{self.options.max_queue}); retry in a few seconds",
                self.options.retry_after_s,
            )
        # Requests without a key (the admin token, or /v1 open) are one caller: the limit above is theirs.
        mine = slot.waiting.waiting(key) if key != NO_KEY else 0
        if mine >= self.options.max_queue_per_key:
            raise QueueFull(
                f"this key already has {mine} requests waiting for {config!r} (the limit per key is "
                f"{self.options.max_queue_per_key}); retry in a few seconds",
                self.options.retry_after_s,
            )

    async def _until_changed(self, config: str, slot: Slot, deadline: float, limit: int | None) -> None:
        """Until a request of ``config`` ends or stops waiting; QueueTimeout (504) past ``deadline``."""
        left = deadline - self._clock()
        try:
            if left <= 0:
                raise TimeoutError
            await asyncio.wait_for(slot.changed.wait(), timeout=left)
        except TimeoutError:
            busy = f"{slot.in_flight} requests in flight" + (f" (max_concurrent {limit})" if limit else "")
            raise QueueTimeout(
                f"{config!r} did not take this request within {self.options.queue_timeout_s:g} s "
                f"(VLLM_MANAGER_QUEUE_TIMEOUT_S): {busy}, {slot.queued - 1} more waiting; retry later"
            ) from None

    def _pick(self, config: str, affinity: str | None, avoid: tuple[int, ...]) -> WorkerView | None:
        ready = self.workers.ready_workers(config)
        if not ready:
            return None
        return self.replicas.pick(config, ready, affinity, avoid)

    def _lease(self, config: str, slot: Slot, view: WorkerView, started: float, queued: bool = False) -> Lease:
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
        self.replicas.released(lease.config, lease.worker_id)
        self.slots.released(lease.config)
        if self.metrics is not None:
            self.metrics.in_flight.labels(lease.config).dec()

    def queue_state(self) -> dict[str, dict[str, int]]:
        """Per model config: requests in flight and requests waiting (for pages and tests)."""
        return {name: {"in_flight": s.in_flight, "queued": s.queued} for name, s in self.slots.items()}

    def snapshot(self) -> list[ModelStatus]:
        """Every model config, by name: its state, its requests in flight and waiting, its last swap."""
        views = self.workers.views()
        now = self._clock()
        out = []
        for config in sorted(self._placements()):
            slot = self.slots.get(config) or Slot()
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
        draining: dict[str, Leaving] = {}  # models this start asked to drain: their new requests wait
        slot = self.slots.of(config)
        target: WorkerView | None = None
        try:
            # A stop asked for elsewhere (the API) is let finish: its worker is then started again.
            while any(v.model == config and v.state == State.STOPPING for v in self.workers.views()):
                if self._clock() - started > placement.start_timeout_s:
                    raise StartTimeout(f"{config} is still stopping after {placement.start_timeout_s:g} s")
                await asyncio.sleep(self.options.poll_s)
            target = await self._download_first(placement) if self.workers.downloads_first(config) else None
            while target is None:
                async with self.room.lock:
                    current = self._current_worker(config)
                    if current is not None and current.state not in (State.CRASHED, State.SLEEPING):
                        target = current  # started meanwhile (by the API, or an earlier start)
                        break
                    decision = self.room.decide(placement)
                    if isinstance(decision, Place | MakeRoom):
                        # A swap counts from here: the wait for drains or a residency is not part of its cost.
                        started = self._clock()
                        if isinstance(decision, MakeRoom):
                            await self.room.evict(decision, f"to make room for {config}")
                        if current is not None and current.state == State.SLEEPING:
                            slot.loading = Loading("wake", current.id, started)
                            target = await self._wake(current, started)
                        else:
                            slot.room_at_launch = False  # made now
                            target = await self.room.start(config, current)
                            slot.loading = Loading("cold", target.id, started)
                        break
                    self.room.drain(decision, draining)
                drain_deadline = await self.room.until_drained(decision, drain_deadline, config)
        except ManagerError as exc:  # a worker deleted meanwhile, a stop that failed
            raise ModelUnavailable(f"{config} could not be started: {exc.message}") from exc
        finally:
            self.room.end_drains(draining)
            if target is None:  # a wake that failed
                slot.loading = None
        try:
            return await self._until_ready(target, placement, started)
        finally:
            slot.loading = None

    async def _download_first(self, placement: Placement) -> WorkerView | None:
        """Start a config whose model must be downloaded first without evicting anyone: the download holds
        no GPU, and room is made once it is over (``Room.at_launch``). None when it is to be started as
        any other: it has a worker already, or the pre-start check refused it while workers that eviction
        would stop were running (their memory counted against it)."""
        config = placement.config
        slot = self.slots.of(config)
        async with self.room.lock:
            if self._current_worker(config) is not None:
                return None
            # One that can never get its GPUs (persistent models hold them) is not downloaded for nothing.
            decision = self.room.decide(placement)
            slot.room_at_launch = True
        try:
            view = await self.room.start(config, None)
        except ModelUnavailable:
            slot.room_at_launch = False
            if isinstance(decision, Place):
                raise  # nobody is in its way: the refusal is the model's own
            return None
        if view.state != State.DOWNLOADING:  # downloaded by someone else just now: its engine starts as it is
            slot.room_at_launch = False
        return view

    async def _wake(self, sleeper: WorkerView, started: float) -> WorkerView:
        try:
            view = await self.workers.command(sleeper.id, "wake")
        except ManagerError as exc:
            raise ModelUnavailable(f"{sleeper.model} could not be woken: {exc.message}") from exc
        self._swapped(sleeper.model, "wake", self._clock() - started)
        return view

    def _swapped(self, config: str, kind: SwapKind, seconds: float) -> None:
        self.slots.of(config).swapped(Swap(kind, seconds, self._clock()))
        if self.metrics is not None:
            self.metrics.swap.labels(kind).observe(seconds)

    async def _until_ready(self, target: WorkerView, placement: Placement, started: float) -> WorkerView:
        # The start timeout counts from the engine's launch: the model's download (its own timeout, kept
        # by the worker) is not part of it.
        deadline: float | None = None if target.state == State.DOWNLOADING else started + placement.start_timeout_s
        config = placement.config
        slot = self.slots.of(config)
        alone_since: float | None = None  # since when no request waits for a load made for requests
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
            if self._nobody_waits(slot, view):
                alone_since = self._clock() if alone_since is None else alone_since
                if self._clock() - alone_since >= self.options.cancel_grace_s:
                    await self._cancel(slot, view)
            else:
                alone_since = None
            if late:
                # The worker's own start deadline counts from its launch, a moment after this one: by
                # the time this sees it, the worker may already have been failed for the same reason.
                now = view.detail if view.state == State.STARTING else view.last_error
                raise StartTimeout(
                    f"{config} was not ready within its start_timeout_s ({placement.start_timeout_s:g} s) "
                    f"({now or 'no log line yet'}). Retry later, or raise start_timeout_s in its model config"
                )
            await asyncio.sleep(self.options.poll_s)

    def _nobody_waits(self, slot: Slot, view: WorkerView) -> bool:
        """The start or wake of ``view`` was made for requests (not asked by an admin, not a download),
        is still under way, and none of them waits for it any more."""
        load = slot.loading
        return (
            load is not None
            and load.worker_id == view.id
            and view.state in (State.STARTING, State.WAKING)
            and slot.queued == 0
            and slot.in_flight == 0
        )

    async def _cancel(self, slot: Slot, view: WorkerView) -> None:
        """Stop a load nobody waits for (through the supervisor, as any stop); LoadCancelled once it is
        stopped. Under the room lock: the next request's start decides once the GPU is free, and a
        request that came meanwhile keeps the load."""
        async with self.room.lock:
            view = self.workers.view(view.id)
            load = slot.loading
            if load is None or not self._nobody_waits(slot, view):
                return
            what = "start" if load.kind == "cold" else "wake"
            slot.loading = None
            why = f"{what} of {view.model} cancelled: no request waits for it any more"
            try:
                await self.room.stop(view, why, kind="cancelled")
            except ManagerError as exc:
                raise ModelUnavailable(f"{view.model}: its {what} could not be cancelled: {exc.message}") from exc
        raise LoadCancelled(why)

    def loading(self, config: str) -> str:
        """What a request waiting for ``config`` waits for, in a few words (``loading.line``)."""
        slot = self.slots.of(config)
        view = self._current_worker(config)
        return loading.line(config, view, slot.loading, slot.swap_s, self._clock())

    # ---- idle unload and replicas -------------------------------------------------------------------
    def start(self) -> None:
        self.upkeep.start()

    async def stop(self) -> None:
        await self.upkeep.stop()
        for _, slot in self.slots.items():
            if slot.start is not None and not slot.start.done():
                slot.start.cancel()

    async def unload_idle(self) -> list[str]:
        """Put to sleep or stop every ready model idle longer than its idle_timeout_s; returns them."""
        return await self.upkeep.unload_idle()

    async def scale_replicas(self) -> list[Add | Remove]:
        """One step of scaling for every model whose replicas scale with the load; returns the steps taken."""
        return await self.upkeep.scale_replicas()

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


def _has_room(slot: Slot, limit: int | None) -> bool:
    return limit is None or slot.in_flight < limit


def _retrieve(task: asyncio.Task[WorkerView]) -> None:
    # Every waiter may have gone (their clients left): the start's outcome must still be read.
    if not task.cancelled():
        task.exception()
