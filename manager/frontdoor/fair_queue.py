"""The order in which the requests waiting for one model are let through: by priority ("interactive"
before "batch"), then round-robin over the inference keys of a priority, first come first served
within one key.

Round-robin: the keys of a priority that have requests waiting stand in a ring. The next request let
through is the oldest of the key at the front; that key then goes to the back if it still has some
waiting, and a key whose first request arrives joins at the back. So once a key has a request waiting,
each key ahead of it gets at most one request through before it does: a key that sends twenty times
as many requests as another gets no more turns, only a longer line of its own. A request that gives
up (its client left, it waited too long) leaves without its key losing its place.

Pure: no clock, no asyncio. The scheduler decides when one may go (``manager.frontdoor.scheduler``).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

PRIORITIES = ("interactive", "batch")  # first let through first
_RANK = {name: rank for rank, name in enumerate(PRIORITIES)}


@dataclass(eq=False)
class Ticket:
    """One waiting request: the key it came with and its priority."""

    key: int
    priority: str = "interactive"

    @property
    def rank(self) -> int:
        # A priority this version does not know goes after the known ones rather than ahead of them.
        return _RANK.get(self.priority, len(PRIORITIES))


class FairQueue:
    def __init__(self) -> None:
        # By rank: each key's waiting tickets, the keys in the ring's order (the front first).
        self._rings: dict[int, OrderedDict[int, deque[Ticket]]] = {}
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def waiting(self, key: int) -> int:
        """How many requests of ``key`` wait (over every priority)."""
        return sum(len(ring[key]) for ring in self._rings.values() if key in ring)

    def join(self, key: int, priority: str = "interactive") -> Ticket:
        ticket = Ticket(key, priority)
        ring = self._rings.setdefault(ticket.rank, OrderedDict())
        ring.setdefault(key, deque()).append(ticket)  # a key new to the ring joins at its back
        self._count += 1
        return ticket

    def order(self) -> Iterator[Ticket]:
        """Every waiting ticket, in the order they would be let through if none joined or left."""
        for rank in sorted(self._rings):
            lines = list(self._rings[rank].values())
            turn = 0
            while lines:
                lines = [line for line in lines if len(line) > turn]
                for line in lines:
                    yield line[turn]
                turn += 1

    def next(self, may_go: Callable[[Ticket], bool] | None = None) -> Ticket | None:
        """The ticket to let through next (of those ``may_go`` accepts); None when none waits."""
        if may_go is None and self._rings:
            return next(iter(self._rings[min(self._rings)].values()))[0]
        return next((t for t in self.order() if may_go is None or may_go(t)), None)

    def release(self, ticket: Ticket) -> None:
        """``ticket`` is let through: its key goes to the back of the ring."""
        ring = self._remove(ticket)
        if ticket.key in ring:
            ring.move_to_end(ticket.key)

    def drop(self, ticket: Ticket) -> None:
        """``ticket`` gives up waiting: its key keeps its place. A ticket not waiting is ignored."""
        self._remove(ticket)

    def _remove(self, ticket: Ticket) -> OrderedDict[int, deque[Ticket]]:
        ring = self._rings.get(ticket.rank, OrderedDict())
        line = ring.get(ticket.key)
        if line is None or ticket not in line:
            return ring
        line.remove(ticket)
        self._count -= 1
        if not line:
            del ring[ticket.key]
            if not ring:
                del self._rings[ticket.rank]
        return ring
