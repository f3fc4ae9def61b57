"""The front door's count for each model config: requests in flight, the requests waiting (in their
fair order, ``fair_queue``), when it last answered or was first seen ready, its last swap, the one
start under way, and whether it is leaving (being stopped, or drained before a stop: its new requests
wait until that is done).

One ``Slots`` holds every config's slot; the scheduler, the room-making and the idle unload read and
change them there. A request's end is told to whoever waits for a busy worker to drain, and to the
requests waiting for a place among a config's ``max_concurrent``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, ItemsView
from dataclasses import dataclass, field
from typing import Literal

from manager.frontdoor.fair_queue import FairQueue, Ticket
from manager.supervisor.view import WorkerView

SwapKind = Literal["cold", "wake"]


@dataclass(frozen=True)
class Swap:
    """A model brought in for requests: started cold (a process start) or woken from sleep."""

    kind: SwapKind
    seconds: float  # from deciding to serve it to its worker being ready
    ended_at: float  # on the scheduler's clock


@dataclass(frozen=True)
class Loading:
    """A start or wake the front door made itself for the requests waiting for it (never one an admin
    asked for): the one load it may cancel when they have all gone."""

    kind: SwapKind
    worker_id: int
    since: float  # when serving it was decided, on the scheduler's clock (as a Swap's seconds count)


@dataclass
class Leaving:
    """A model being stopped (or drained before a stop): its new requests wait until this is done."""

    done: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass
class Slot:
    """The bookkeeping for one model config."""

    in_flight: int = 0  # requests forwarded to its workers, not yet answered in full
    # Requests waiting for it (a start, a swap, a drain, their turn), in the order they are let through.
    waiting: FairQueue = field(default_factory=FairQueue)
    # Of those, the ones waiting for its start: they count as in flight.
    joined: set[Ticket] = field(default_factory=set)
    # Set (and replaced) whenever one of its requests ends or stops waiting: the next one may go.
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    last_done: float | None = None  # when its last response ended
    ready_seen: float | None = None  # when the scheduler first saw its current worker ready
    start: asyncio.Task[WorkerView] | None = None  # the one start under way, joined by every waiter
    leaving: Leaving | None = None
    last_swap: Swap | None = None
    swap_s: dict[SwapKind, float] = field(default_factory=dict)  # the last measured swap of each kind
    loading: Loading | None = None  # the start or wake under way that the front door made for requests
    # Started for requests while its model downloads, without evicting anyone: room for it is made
    # when its engine is about to start.
    room_at_launch: bool = False

    @property
    def queued(self) -> int:
        return len(self.waiting)

    def notify(self) -> None:
        """Wake the requests waiting for their turn: a place among max_concurrent, or the one ahead, is free."""
        self.changed.set()
        self.changed = asyncio.Event()

    def swapped(self, swap: Swap) -> None:
        self.last_swap = swap
        self.swap_s[swap.kind] = swap.seconds

    @property
    def last_request_at(self) -> float | None:
        """When it last answered, or was first seen ready if later: what its idle time counts from."""
        known = [t for t in (self.last_done, self.ready_seen) if t is not None]
        return max(known) if known else None


class Slots:
    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._of: dict[str, Slot] = {}
        self._released = asyncio.Event()  # set (and replaced) whenever a request ends

    def of(self, config: str) -> Slot:
        slot = self._of.get(config)
        if slot is None:
            slot = self._of[config] = Slot()
        return slot

    def get(self, config: str) -> Slot | None:
        """The config's slot, None where no request or worker of it was seen yet (none is made)."""
        return self._of.get(config)

    def items(self) -> ItemsView[str, Slot]:
        return self._of.items()

    def released(self, config: str) -> None:
        """One request for ``config`` has ended."""
        slot = self.of(config)
        slot.in_flight -= 1
        slot.last_done = self._clock()
        slot.notify()
        self._released.set()
        self._released = asyncio.Event()

    async def next_release(self, timeout: float) -> None:
        """Wait until a request ends, for at most ``timeout`` seconds."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._released.wait(), timeout=timeout)

    def mark_leaving(self, config: str) -> Leaving | None:
        """Make new requests for ``config`` wait; None when someone else already did (they end it)."""
        slot = self.of(config)
        if slot.leaving is not None:
            return None
        slot.leaving = Leaving()
        return slot.leaving

    def end_leaving(self, config: str, leaving: Leaving) -> None:
        slot = self.of(config)
        if slot.leaving is leaving:
            slot.leaving = None
        leaving.done.set()
