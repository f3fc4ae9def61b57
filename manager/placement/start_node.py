"""Which node of a cluster a start runs on, from the planner's check on each node. Pure.

The nodes are tried in the start's order: the node the front door made room on, then the one the
worker ran on before, then the manager's own box, then the least loaded. The first node where the
plan fits takes the start. Where none does, the first node whose only lack is host RAM that sleeping
workers there hold is named, for the caller to stop some of them and try again; else the start fits
nowhere, and each node's refusal is said. The checks are made by the caller (this box's planner, or
a node's agent) as they are asked for, so no node is asked once one fits.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from manager.placement.decisions import CannotFit, Place


@dataclass(frozen=True)
class Candidate:
    """A live node a start may use, with what orders it among the others."""

    name: str
    preferred: bool = False  # the front door made room there for this start
    previous: bool = False  # the worker ran there before
    local: bool = False  # the manager's own box
    load: int = 0  # workers active there


@dataclass(frozen=True)
class NodeCheck:
    """The planner's answer for a start on one node."""

    node: str
    refusal: str | None = None  # None: it fits
    held_by_sleepers: bool = False  # it would fit once sleeping workers there let their host RAM go


@dataclass(frozen=True)
class StopSleepersFirst:
    """The start fits nowhere as things are, but on ``node`` it would once sleepers there are stopped."""

    node: str
    reason: str
    per_node: tuple[tuple[str | None, str], ...]


def start_order(candidates: Iterable[Candidate]) -> list[str]:
    """The node names in the order a start tries them."""
    ordered = sorted(candidates, key=lambda c: (not c.preferred, not c.previous, not c.local, c.load, c.name))
    return [c.name for c in ordered]


def start_node(config: str, checks: Iterable[NodeCheck]) -> Place | StopSleepersFirst | CannotFit:
    """The node ``config`` starts on: the first check that fits (later ones are not asked for)."""
    refused: list[NodeCheck] = []
    for check in checks:
        if check.refusal is None:
            return Place(check.node, ())
        refused.append(check)
    if not refused:
        return CannotFit("no node of the Ray cluster is alive")
    per_node = tuple((c.node, c.refusal or "") for c in refused)
    reason = f"{config} fits on no node: " + _each(refused)
    held = next((c for c in refused if c.held_by_sleepers), None)
    if held is not None:
        return StopSleepersFirst(held.node, reason, per_node)
    return CannotFit(reason, per_node=per_node)


def _each(refused: Sequence[NodeCheck]) -> str:
    return "; ".join(f"{c.node}: {c.refusal}" for c in refused)
