"""What a worker is in: its state, the sets of states that matter, and the record the state machine keeps.

``lifecycle.step`` alone moves a worker from one state to another; this file only names the states
and holds ``Life``, everything the machine knows about one worker.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum

from manager.supervisor.worker_effects import Launch


class State(StrEnum):
    STOPPED = "stopped"
    # Its model is being downloaded from the Hugging Face Hub; the engine starts once it is complete.
    DOWNLOADING = "downloading"
    STARTING = "starting"
    READY = "ready"
    STOPPING = "stopping"
    FAILED = "failed"  # did not become ready, or crashed past the restart ceiling
    CRASHED = "crashed"  # died while ready; a restart is scheduled (backing off)
    # vLLM sleep mode: the engine process lives on with its GPU memory released (level 1 keeps the
    # weights in host RAM, level 2 drops them); waking takes seconds instead of a cold start.
    SLEEPING = "sleeping"
    WAKING = "waking"
    # Its node dropped out of the Ray cluster: the engine may still run there, out of reach.
    LOST = "lost"


# A worker in these states holds (or is about to hold) its engine, its GPUs and its config.
ACTIVE = frozenset(
    {
        State.DOWNLOADING,
        State.STARTING,
        State.READY,
        State.STOPPING,
        State.CRASHED,
        State.SLEEPING,
        State.WAKING,
        State.LOST,
    }
)
# States in which the engine serves its endpoints and is watched for health.
SERVING = frozenset({State.READY, State.SLEEPING})


@dataclass(frozen=True)
class Engine:
    """The engine process a worker runs: pid + start time + argv identify it (a pid alone is reused)."""

    pid: int
    create_time: float | None
    cmdline: tuple[str, ...]


class StartKind(StrEnum):
    """Why the start under way happened: it decides what a failure of that start leads to."""

    START = "start"
    RESTART = "restart"
    SWITCH = "switch"
    CRASH_RESTART = "restart after crash"
    ROLLBACK = "roll back"
    MOVE = "move to another node"
    NODE_LOST = "start ended by a lost node"  # tried again at once; not a crash of its own


@dataclass(frozen=True)
class Life:
    """Everything the machine knows about one worker. The runner stores the persistent part."""

    state: State
    model: str  # the model config it runs (or ran last)
    port: int | None = None
    engine: Engine | None = None
    served_name: str | None = None
    started_at: datetime | None = None  # wall clock of the last launch
    desired: str = "stopped"  # "running" or "stopped": what the user asked for last
    restart_count: int = 0
    last_error: str | None = None
    detail: str | None = None  # what a start is doing now (the latest log line)
    start_kind: StartKind | None = None
    switch_from: str | None = None  # the config to roll back to if a switch's start fails
    deadline: float | None = None  # monotonic: when a start has taken too long
    ready_since: float | None = None
    next_restart_at: float | None = None
    health_failures: int = 0
    sleep_level: int | None = None  # the level it sleeps at, while sleeping or waking
    download: str | None = None  # the hub id being downloaded, while downloading
    download_since: float | None = None  # monotonic: when this download phase began (names its Fetched)
    after_download: Launch | None = None  # the start that waits for the download
    # Failed because the live nodes could not hold its start (a crash restart, a roll back, a start after
    # its download): started again when a node is back.
    waits_for_node: bool = False

    @property
    def active(self) -> bool:
        return self.state in ACTIVE
