"""What ``decide`` answers: place now, make room first, wait for requests to drain, or cannot fit."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Place:
    """Start the model on this node's GPUs, as things are."""

    node: str | None
    gpus: tuple[int, ...]


@dataclass(frozen=True)
class MakeRoom:
    """Put these to sleep and stop these (all on ``then``'s node), then start as ``then`` says."""

    sleep: tuple[int, ...]
    stop: tuple[int, ...]
    then: Place


@dataclass(frozen=True)
class WaitForDrain:
    """These must be evicted but are serving requests: wait until they are idle, then ask again. With
    ``resident_s``, they were swapped in moments ago and are in use: they keep serving (nothing drains)
    for up to that many seconds more, or until they go idle, and then the decision is asked again."""

    workers: tuple[int, ...]
    reason: str
    node: str | None = None
    resident_s: float = 0.0


@dataclass(frozen=True)
class CannotFit:
    reason: str
    blockers: tuple[int, ...] = ()  # the workers that hold the room and may not be evicted
    per_node: tuple[tuple[str | None, str], ...] = ()  # each node tried, and why it was refused


@dataclass(frozen=True)
class FreeHostRam:
    """Stop these sleepers (on ``node``) to give a start the host RAM it lacks."""

    stop: tuple[int, ...]
    node: str | None = None


Decision = Place | MakeRoom | WaitForDrain | CannotFit
