"""What the front door does every few seconds without a request: unload each ready model idle longer
than its ``idle_timeout_s`` (to sleep when its config allows it and host RAM has room for what sleeping
keeps there, else stopped; idle counts from its last answer, or from when it was first seen ready),
and take one step of scaling for each model whose replicas follow the load (``replica_scale`` decides
the step, from the counts ``Replicas`` keeps).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

from manager.errors import ManagerError
from manager.frontdoor.placements import Placement
from manager.frontdoor.replica_scale import Add, Remove, scale_step
from manager.frontdoor.replicas import Replicas
from manager.frontdoor.room import Room
from manager.frontdoor.slots import Slot, Slots
from manager.frontdoor.workers import CURRENT, Workers
from manager.periodic import Periodic
from manager.supervisor.view import WorkerView
from manager.supervisor.worker_state import State

log = logging.getLogger("vllm_manager.frontdoor")


class Upkeep:
    def __init__(
        self,
        workers: Workers,
        placements: Callable[[], Mapping[str, Placement]],
        slots: Slots,
        replicas: Replicas,
        room: Room,
        every_s: float,
        clock: Callable[[], float],
    ) -> None:
        self.workers = workers
        self._placements = placements
        self._slots = slots
        self._replicas = replicas
        self._room = room
        self._clock = clock
        self._rounds = Periodic("idle unload and replica scaling", every_s, self._round, log)

    def start(self) -> None:
        self._rounds.start()

    async def stop(self) -> None:
        await self._rounds.stop()

    async def _round(self) -> None:
        await self.unload_idle()
        await self.scale_replicas()

    async def unload_idle(self) -> list[str]:
        """Put to sleep or stop every ready model idle longer than its idle_timeout_s; returns them."""
        placements = self._placements()
        stopped = []
        for view in self.workers.views():
            slot = self._slots.of(view.model)
            if view.state != State.READY:
                slot.ready_seen = None
                continue
            now = self._clock()
            if slot.ready_seen is None:
                slot.ready_seen = now  # the idle time of a worker counts from when it was seen ready
            placement = placements.get(view.model)
            if placement is None or placement.idle_timeout_s is None:
                continue
            async with self._room.lock:
                if not self._is_idle(view, slot):
                    continue
                idle = now - (slot.last_request_at or now)
                if idle < placement.idle_timeout_s:
                    continue
                level = placement.sleep_level if self._room.may_sleep(placement, view.id, view.node) else None
                kind = "idle_slept" if level is not None else "idle_stopped"
                await self._room.unload(view, level, f": idle {idle:.0f} s", kind=kind, idle_s=round(idle, 1))
                stopped.append(view.model)
        return stopped

    def _is_idle(self, view: WorkerView, slot: Slot) -> bool:
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

    async def scale_replicas(self) -> list[Add | Remove]:
        """One step of scaling for every model whose replicas scale with the load; returns the steps taken."""
        taken: list[Add | Remove] = []
        views = self.workers.views()
        for config, placement in self._placements().items():
            if placement.scaling is None:
                continue
            current = [v for v in views if v.model == config and v.state in CURRENT]
            states = self._replicas.states(config, current)
            saturated = self._replicas.saturated_since(config, placement.at_once)
            step = scale_step(states, placement.scaling, saturated, self._clock())
            if isinstance(step, Add):
                async with self._room.lock:  # the room it takes is not promised to a start meanwhile
                    added = await self.workers.add_replica(config, step.reason)
                if added is not None:
                    taken.append(step)
            elif isinstance(step, Remove):
                async with self._room.lock:
                    if self._replicas.in_flight(config, step.worker_id) == 0:
                        await self.workers.remove_replica(step.worker_id, step.reason)
                        self._replicas.forget(config, step.worker_id)
                        taken.append(step)
        return taken
