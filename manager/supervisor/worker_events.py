"""What the state machine is told: what users asked for, and what the runner saw the engine do.

The runner turns commands and observations into these events and feeds them to ``lifecycle.step``;
the results of the effects it carries out come back as events too. Every time a decision needs is
carried in its event: the machine reads no clock. (Not the event log: that is ``events.py``.)
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from manager.errors import ManagerError
from manager.supervisor.worker_effects import Launch
from manager.supervisor.worker_state import Engine


@dataclass(frozen=True)
class StartRequested:
    force: bool = False


@dataclass(frozen=True)
class StopRequested:
    reason: str
    alive: bool  # is the engine process still there


@dataclass(frozen=True)
class RestartRequested:
    alive: bool
    force: bool = False


@dataclass(frozen=True)
class SwitchRequested:
    """Switch to another config. The runner has checked that the new config can be launched."""

    model: str
    alive: bool
    force: bool = False


@dataclass(frozen=True)
class DeleteRequested:
    alive: bool


@dataclass(frozen=True)
class Adopted:
    """A live engine found by the manager (its own after a restart, or a hand-started one)."""

    message: str
    served_name: str | None
    start_timeout_s: float
    elapsed_s: float  # since the engine was started
    now: float
    sleeping_level: int | None = None  # the worker was asleep at this level when the manager stopped


@dataclass(frozen=True)
class FoundGone:
    """After a manager restart, or when its lost node came back, the engine this worker had is gone."""


@dataclass(frozen=True)
class NodeLost:
    """The worker's node dropped out of the Ray cluster (Ray says so, or its agent stopped answering)."""

    node: str
    can_move: bool  # the config names no node: another node that fits may take the worker


@dataclass(frozen=True)
class SpanNodeLost:
    """A node of the Ray cluster dropped out while this worker, whose model spans nodes through vLLM's
    Ray executor, was starting: the start may be waiting in Ray for that node's GPUs."""

    node: str


@dataclass(frozen=True)
class NodeBack:
    """A node of the Ray cluster is alive again: a worker that failed for want of it may start again."""


@dataclass(frozen=True)
class Launched:
    reason: str
    model: str
    served_name: str
    engine: Engine
    argv: tuple[str, ...]
    started_at: datetime
    start_timeout_s: float
    now: float
    removed_stale: tuple[str, ...] = ()  # stale KV-offload files removed before the launch
    port: int | None = None  # the port it listens on, when another program held the worker's own


@dataclass(frozen=True)
class LaunchRefused:
    error: ManagerError


@dataclass(frozen=True)
class NeedsDownload:
    """Answers a Launch whose model (a hub id) is not complete in the engine's cache: nothing was
    started; the download comes first."""

    launch: Launch
    repo: str
    now: float


@dataclass(frozen=True)
class Fetched:
    """The wait for a download ended (answers Fetch): complete, or not, and why."""

    ok: bool
    detail: str  # why not, when not ok
    since: float  # the download phase it ends (Fetch.since)
    now: float


@dataclass(frozen=True)
class GroupStopped:
    graceful: bool
    seconds: float
    killed: tuple[int, ...]
    leftover: tuple[int, ...]
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class Probed:
    healthy: bool  # /health answered 200
    serves: bool  # /v1/models lists the served name
    detail: str
    latest_log: str | None
    now: float


@dataclass(frozen=True)
class Exited:
    """The engine process is gone (its group has been reaped)."""

    exit_text: str  # "exited with code 1"
    log_reason: str | None  # the root cause from its log, if any
    now: float


@dataclass(frozen=True)
class Killed:
    """The group of an engine the machine gave up on has been ended (answers KillGroup)."""

    reason: str
    now: float


@dataclass(frozen=True)
class Tick:
    now: float


@dataclass(frozen=True)
class SleepRequested:
    level: int


@dataclass(frozen=True)
class WakeRequested:
    pass


@dataclass(frozen=True)
class Slept:
    """What the engine answered to POST /sleep (and GET /is_sleeping after it)."""

    ok: bool
    seconds: float
    detail: str  # why not, when not ok


@dataclass(frozen=True)
class Woke:
    """What the engine answered to POST /wake_up (and GET /is_sleeping after it)."""

    ok: bool
    seconds: float
    detail: str
    now: float


Event = (
    StartRequested
    | StopRequested
    | RestartRequested
    | SwitchRequested
    | DeleteRequested
    | Adopted
    | FoundGone
    | NodeLost
    | NodeBack
    | SpanNodeLost
    | Launched
    | LaunchRefused
    | NeedsDownload
    | Fetched
    | GroupStopped
    | Probed
    | Exited
    | Killed
    | Tick
    | SleepRequested
    | WakeRequested
    | Slept
    | Woke
)
