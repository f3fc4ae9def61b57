"""Room for a model config on the GPUs: which workers go first, and how.

``manager.placement.decide`` says from each worker's node, GPUs, requests in flight and last use where a
config starts and which workers to put to sleep or stop first, or which busy ones to wait for; here
they are drained (their new requests wait), put to sleep (when their config allows it and host RAM has
room for what sleeping keeps there) or stopped. A worker swapped in moments ago that is still in use
is not drained: it keeps serving until its residency ends or it goes idle (``placement.residency``),
and past it while more requests wait for it than for the model asking for its room (at most twice its
residency), so two busy models that share a GPU take turns in batches rather than a swap per request. A start the
pre-start check refuses because sleeping workers hold the host RAM it needs stops some of them on that
node (``placement.free_host_ram``) and is tried again. Also where another replica of a running model fits (``placement.place_replica``).

One decision to evict and start is made at a time (``lock``); every stop, sleep and start goes
through the supervisor's public commands.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping

from manager.errors import Conflict, ManagerError
from manager.frontdoor.errors import FrontDoorError, ModelUnavailable
from manager.frontdoor.placements import Placement
from manager.frontdoor.slots import Leaving, Slots
from manager.frontdoor.workers import HOLDING, RESTARTABLE, Workers
from manager.launch.preflight import HostRamHeldBySleepers
from manager.placement import (
    CannotFit,
    MakeRoom,
    Node,
    Place,
    RunningWorker,
    SleepingWorker,
    Snapshot,
    WaitForDrain,
    decide,
    free_host_ram,
    held_for_queue,
    place_replica,
    residency_left,
    residency_of,
)
from manager.supervisor.view import WorkerView
from manager.supervisor.worker_state import State

log = logging.getLogger("vllm_manager.frontdoor")


class Room:
    def __init__(
        self,
        workers: Workers,
        placements: Callable[[], Mapping[str, Placement]],
        slots: Slots,
        drain_timeout_s: float,
        # Each node's GPUs and their total bytes, by node (None: this box), in the order starts prefer
        # them; a node's GPUs None where they are not known. None: this box, GPUs not known.
        gpu_capacity: Callable[[], Mapping[str | None, Mapping[int, int] | None] | None],
        # Host RAM available on a node (None: this box, without a cluster); None: not known.
        host_available: Callable[[str | None], int | None],
        sleep_pool_held: Callable[[int], int],
        clock: Callable[[], float],
    ) -> None:
        self.workers = workers
        self.lock = asyncio.Lock()  # one decision to evict and start at a time
        self._placements = placements
        self._slots = slots
        self._drain_timeout_s = drain_timeout_s
        self._gpu_capacity = gpu_capacity
        self._host_available = host_available
        self._sleep_pool_held = sleep_pool_held
        self._clock = clock

    # ---- deciding ---------------------------------------------------------------------------------
    def decide(self, placement: Placement) -> Place | MakeRoom | WaitForDrain:
        """Where ``placement`` starts and what must go first (the node it is tried on first is the one with
        the room); ModelUnavailable when it cannot start at all."""
        decision = decide(placement.need(self._waiting_for(placement.config)), self._snapshot(placement.config))
        if isinstance(decision, CannotFit):
            raise ModelUnavailable(f"{placement.config} cannot be started: {decision.reason}")
        if isinstance(decision, Place | MakeRoom):
            place = decision.then if isinstance(decision, MakeRoom) else decision
            self.workers.prefer_node(placement.config, place.node)  # where the room is
        return decision

    def place_replica(self, config: str) -> Place | CannotFit:
        """Where another replica of ``config`` goes: free room only, beside every worker (its own too)."""
        placement = self._placements().get(config)
        if placement is None:
            return CannotFit(f"model config {config!r} no longer exists")
        snapshot = self._snapshot(config, own_too=True)
        return place_replica(placement.need(), snapshot, pinned=placement.gpus_pinned)

    def may_sleep(self, placement: Placement | None, worker_id: int, node: str | None) -> bool:
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

    def _waiting_for(self, config: str) -> int:
        """The requests waiting for ``config`` (for its start, as it is not running)."""
        slot = self._slots.get(config)
        return slot.queued if slot is not None else 0

    def _snapshot(self, config: str, own_too: bool = False) -> Snapshot:
        running = self._running(config, own_too)
        capacity = self._gpu_capacity()
        nodes: dict[str | None, Mapping[int, int] | None] = dict(capacity) if capacity is not None else {None: None}
        for worker in running:
            nodes.setdefault(worker.node, None)
        return Snapshot(tuple(Node(name, gpus) for name, gpus in nodes.items()), tuple(running), self._clock())

    def _running(self, config: str | None = None, own_too: bool = False) -> list[RunningWorker]:
        """The workers holding a GPU, as the placement rules see them; ``config``'s own left out unless
        ``own_too`` (None: every one)."""
        placements = self._placements()
        now = self._clock()
        running = []
        for view in self.workers.views():
            if view.state not in HOLDING or (view.model == config and not own_too):
                continue
            placement = placements.get(view.model)
            slot = self._slots.of(view.model)
            swap = slot.last_swap
            resident_since = swap.ended_at if swap else None
            if view.state in (State.STARTING, State.WAKING) and slot.start is not None and not slot.start.done():
                # Being swapped in for requests right now: its residency begins once it is ready.
                resident_since = now
            may_sleep = self.may_sleep(placement, view.id, view.node)
            running.append(
                RunningWorker(
                    id=view.id,
                    config=view.model,
                    gpus=tuple(view.gpus) or (placement.gpus if placement else (0,)),
                    gpu_bytes=placement.gpu_bytes if placement else None,
                    gpu_share=placement.gpu_share if placement else None,
                    last_request_at=slot.last_request_at,
                    # Requests waiting for its start count as in flight: evicting it would strand them.
                    in_flight=slot.in_flight + len(slot.joined),
                    waiting=max(0, slot.queued - len(slot.joined)),
                    persistent=placement.persistent if placement else False,
                    may_sleep=may_sleep,
                    node=view.node,
                    resident_since=resident_since,
                    min_residency_s=residency_of(
                        placement.min_residency_s if placement else 0.0, swap.seconds if swap else None
                    ),
                    back_in_s=slot.swap_s.get("wake" if may_sleep else "cold"),
                )
            )
        return running

    # ---- making room ------------------------------------------------------------------------------
    async def at_launch(self, config: str) -> None:
        """Before the engine of ``config`` starts once its model is downloaded: the eviction its start for
        requests left until now (the supervisor awaits this). A start made elsewhere evicts nobody, as
        before. Raises Conflict when room cannot be made: the worker fails with the reason."""
        slot = self._slots.get(config)
        placement = self._placements().get(config)
        if slot is None or not slot.room_at_launch or placement is None:
            return
        slot.room_at_launch = False
        deadline = self._clock() + self._drain_timeout_s
        draining: dict[str, Leaving] = {}
        try:
            while True:
                async with self.lock:
                    decision = self.decide(placement)
                    if isinstance(decision, Place | MakeRoom):
                        if isinstance(decision, MakeRoom):
                            await self.evict(decision, f"to make room for {config}")
                        return
                    self.drain(decision, draining)
                deadline = await self.until_drained(decision, deadline, config)
        except FrontDoorError as exc:
            raise Conflict(exc.message) from exc
        finally:
            self.end_drains(draining)

    def drain(self, decision: WaitForDrain, draining: dict[str, Leaving]) -> None:
        """New requests for the models that must drain wait (until ``end_drains(draining)``); those kept
        for their residency go on serving."""
        if decision.resident_s > 0:
            return
        by_id = {v.id: v.model for v in self.workers.views()}
        for name in [by_id[i] for i in decision.workers if i in by_id]:
            leaving = self._slots.mark_leaving(name)
            if leaving is not None:
                draining[name] = leaving

    def end_drains(self, draining: dict[str, Leaving]) -> None:
        for name, leaving in draining.items():
            self._slots.end_leaving(name, leaving)

    async def until_drained(self, decision: WaitForDrain, deadline: float, config: str) -> float:
        """Wait for the workers to drain (ModelUnavailable past ``deadline``), or for their residency to
        end (``config``: the model that needs their room); returns the deadline of the drain that may
        follow (a drain after a residency gets its own)."""
        if decision.resident_s > 0:
            await self._until_resident_ends(decision, config)
            return max(deadline, self._clock() + self._drain_timeout_s)
        if not await self._drained(decision.workers, deadline):
            raise ModelUnavailable(
                f"{decision.reason}; they did not finish within {self._drain_timeout_s:g} s. "
                "Retry later, or give the models different GPUs"
            )
        return deadline

    async def _until_resident_ends(self, decision: WaitForDrain, config: str) -> None:
        """Until none of the workers is kept by its residency (it ended, or the worker went idle), nor by
        more requests waiting for it than for ``config``. The wait is told, and told again when it goes on
        for a queue that the first telling did not name."""
        told = False
        told_queue = False
        while True:
            now = self._clock()
            asking = self._waiting_for(config)  # re-read: requests for it come and go while it waits
            running = {w.id: w for w in self._running()}
            held = [(running[i], residency_left(running[i], now, asking)) for i in decision.workers if i in running]
            left = max((s for _, s in held), default=0.0)
            if left <= 0:
                return
            kept = [w for w, s in held if s > 0]
            queues = [w for w in kept if held_for_queue(w, asking)]
            if not told or (queues and not told_queue):
                why = decision.reason if not told else _held_for_queues(config, queues, asking)
                told, told_queue = True, told_queue or bool(queues)
                self.workers.events.record(
                    "swap_held",
                    f"{why}: the swap waits up to {left:.1f} s",
                    kept[0].id,
                    model=kept[0].config,
                    seconds_left=round(left, 1),
                )
            # A request's end may leave the worker idle a moment later: look again at least every second.
            await self._slots.next_release(min(left, 1.0))

    async def _drained(self, worker_ids: tuple[int, ...], deadline: float) -> bool:
        """Wait until these workers have no request in flight; False when the deadline passes first."""
        while True:
            running = {w.id: w for w in self._running()}
            if all(running[i].in_flight == 0 for i in worker_ids if i in running):
                return True
            left = deadline - self._clock()
            if left <= 0:
                return False
            await self._slots.next_release(min(left, 1.0))

    async def evict(self, decision: MakeRoom, why: str) -> None:
        views = [self.workers.view(i) for i in decision.sleep + decision.stop]
        # All of them first: none may take a new request while another one is being stopped.
        marks = [(v.model, self._slots.mark_leaving(v.model)) for v in views]
        placements = self._placements()
        try:
            for view in views:
                placement = placements.get(view.model)
                if view.id in decision.sleep and placement is not None and placement.sleep_level is not None:
                    await self.unload(view, placement.sleep_level, f" {why}", kind="evicted")
                else:
                    await self.stop(view, f"stopped {view.model} {why}", kind="evicted")
        finally:
            for model, leaving in marks:
                if leaving is not None:
                    self._slots.end_leaving(model, leaving)

    async def stop(self, view: WorkerView, message: str, kind: str, **data: object) -> None:
        """Stop one worker through the supervisor; its model's new requests wait until it is down."""
        leaving = self._slots.mark_leaving(view.model)
        try:
            await self.workers.command(view.id, "stop")
            self.workers.events.record(kind, message, view.id, model=view.model, **data)
        finally:
            self._slots.of(view.model).ready_seen = None
            if leaving is not None:
                self._slots.end_leaving(view.model, leaving)

    async def unload(self, view: WorkerView, sleep_level: int | None, why: str, kind: str, **data: object) -> None:
        """Put the worker to sleep (when ``sleep_level``), or stop it; a sleep the engine refuses is a stop."""
        if sleep_level is None:
            await self.stop(view, f"stopped {view.model}{why}", kind=kind, **data)
            return
        leaving = self._slots.mark_leaving(view.model)
        try:
            await self.workers.command(view.id, "sleep", level=sleep_level)
            self.workers.events.record(kind, f"put {view.model} to sleep{why}", view.id, model=view.model, **data)
        except ManagerError as exc:
            log.warning("%s could not sleep (%s): stopping it instead", view.model, exc.message)
            await self.stop(view, f"stopped {view.model}{why} (sleep failed: {exc.message})", kind=kind, **data)
        finally:
            self._slots.of(view.model).ready_seen = None
            if leaving is not None:
                self._slots.end_leaving(view.model, leaving)

    # ---- starting ---------------------------------------------------------------------------------
    async def start(self, config: str, crashed: WorkerView | None) -> WorkerView:
        """Start the config's stopped worker again (the newest), or create one; when sleeping workers
        hold the host RAM the start needs, stop the fewest of them and try once more."""
        try:
            return await self._start_once(config, crashed)
        except HostRamHeldBySleepers as held:
            decision = free_host_ram(self._sleeping(held), held.short_bytes, config, held.node)
            if isinstance(decision, CannotFit):
                raise ModelUnavailable(f"{config} could not be started: {decision.reason}") from held
            for view in [self.workers.view(i) for i in decision.stop]:
                await self.stop(view, f"stopped {view.model} (asleep) to free host RAM for {config}", kind="evicted")
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
            out.append(
                SleepingWorker(
                    id=view.id,
                    config=view.model,
                    host_bytes=sleeper.host_bytes,
                    last_request_at=self._slots.of(view.model).last_request_at,
                    persistent=placement.persistent if placement else False,
                    node=view.node,
                )
            )
        return out


def _held_for_queues(config: str, queues: list[RunningWorker], asking: int) -> str:
    waits = ", ".join(f"{w.waiting} requests wait on {w.config}" for w in queues)
    names = ", ".join(w.config for w in queues)
    return f"{config} waits past the residency of {names} (at most twice it): {waits}, {asking} on {config}"
