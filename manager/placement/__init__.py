"""Placement: can this model run here, and what must give way? The one answer, for every caller.

``snapshot`` holds the records a decision reads (nodes and their GPUs, running workers, sleepers),
``decide`` the pure decision across nodes (``one_node`` the check on one node, ``residency`` how long
a model just swapped in stays and when a model is idle), ``host_ram`` the
sleepers to stop when a start lacks host RAM, ``replica`` where one more replica of a running model
fits in free room, ``start_node`` which node of a cluster a start runs on, from the planner's check on
each. Callers build a snapshot from what they know and act on the answer; nothing here reads a
process, a GPU or the store.
"""

from manager.placement.decide import decide
from manager.placement.decisions import CannotFit, Decision, FreeHostRam, MakeRoom, Place, WaitForDrain
from manager.placement.host_ram import free_host_ram, sleep_level_of
from manager.placement.replica import place_replica
from manager.placement.residency import held_for_queue, idle, residency_left, residency_of
from manager.placement.snapshot import Need, Node, RunningWorker, SleepingWorker, Snapshot
from manager.placement.start_node import Candidate, NodeCheck, StopSleepersFirst, start_node, start_order

__all__ = [
    "Candidate",
    "CannotFit",
    "Decision",
    "FreeHostRam",
    "MakeRoom",
    "Need",
    "Node",
    "NodeCheck",
    "Place",
    "RunningWorker",
    "SleepingWorker",
    "Snapshot",
    "StopSleepersFirst",
    "WaitForDrain",
    "decide",
    "free_host_ram",
    "held_for_queue",
    "idle",
    "place_replica",
    "residency_left",
    "residency_of",
    "sleep_level_of",
    "start_node",
    "start_order",
]
