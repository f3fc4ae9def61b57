"""Which expert sits in which GPU cache slot of one layer: a plain-Python LRU table.

Kept apart from the tensors so eviction can be tested on its own and so the runtime only asks one
question per layer and batch: "here are the experts I need, where are they and what must be loaded?"
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class SlotPlan:
    """Where each needed expert lives after ``assign`` and which copies make that true."""

    slot_of: dict[int, int]  # needed expert -> slot
    loads: list[tuple[int, int]] = field(default_factory=list)  # (expert, slot) to copy in
    hits: list[int] = field(default_factory=list)  # needed experts already resident


class ExpertSlotTable:
    """LRU mapping of a layer's experts onto ``num_slots`` GPU slots."""

    def __init__(self, num_experts: int, num_slots: int) -> None:
        if not 1 <= num_slots <= num_experts:
            raise ValueError(f"num_slots must be in 1..{num_experts}, got {num_slots}")
        self.num_experts = num_experts
        self.num_slots = num_slots
        # expert -> slot, oldest use first: the front is the next victim.
        self._resident: OrderedDict[int, int] = OrderedDict()
        self._free = list(range(num_slots - 1, -1, -1))

    def resident(self) -> dict[int, int]:
        return dict(self._resident)

    def lru_pairs(self) -> list[tuple[int, int]]:
        """(expert, slot) pairs, least recently used first: the state to hand to another table."""
        return list(self._resident.items())

    def load_lru(self, pairs: list[tuple[int, int]]) -> None:
        """Take over a state given as (expert, slot) pairs, least recently used first."""
        self._resident = OrderedDict(pairs)
        used = set(self._resident.values())
        if len(used) != len(pairs) or not used <= set(range(self.num_slots)):
            raise ValueError(f"slot table state must use distinct slots below {self.num_slots}")
        self._free = [s for s in range(self.num_slots - 1, -1, -1) if s not in used]

    def assign(self, needed: Sequence[int]) -> SlotPlan:
        """Give every needed expert a slot, evicting the least recently used others.

        ``needed`` must hold distinct expert ids, at most ``num_slots`` of them: the runtime splits
        larger sets into rounds. Needed experts never evict each other.
        """
        if len(needed) > self.num_slots:
            raise ValueError(f"{len(needed)} experts needed but the layer has {self.num_slots} slots")
        if len(set(needed)) != len(needed):
            raise ValueError(f"needed experts must be distinct, got {list(needed)}")
        plan = SlotPlan(slot_of={})
        misses = []
        for e in needed:
            if not 0 <= e < self.num_experts:
                raise ValueError(f"expert id {e} out of range 0..{self.num_experts - 1}")
            slot = self._resident.get(e)
            if slot is None:
                misses.append(e)
            else:
                self._resident.move_to_end(e)
                plan.slot_of[e] = slot
                plan.hits.append(e)
        # Hits were moved to the back, so the front now holds only experts this batch does not need.
        for e in misses:
            if self._free:
                slot = self._free.pop()
            else:
                _, slot = self._resident.popitem(last=False)
            self._resident[e] = slot
            plan.slot_of[e] = slot
            plan.loads.append((e, slot))
        return plan

    def fill(self, experts: Sequence[int]) -> SlotPlan:
        """Warm the table (e.g. with the most popular experts) without counting anything."""
        return self.assign(list(experts)[: self.num_slots])
