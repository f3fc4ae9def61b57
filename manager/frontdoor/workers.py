"""The supervisor as the front door's scheduler sees it: the public commands it asks for (every stop,
sleep, wake and start goes through them, and the worker's state machine), and which worker states
count as holding GPUs, as a config's current worker, or as one to start again.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Protocol

from manager.placement import CannotFit, Place
from manager.supervisor.view import WorkerView
from manager.supervisor.worker_state import State

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
