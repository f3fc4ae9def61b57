"""What a worker's runner is given: the launch the supervisor prepares for each start, the services it
calls, and its state and rules as stored and configured."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
from sqlalchemy.engine import Engine as DbEngine

from manager.host.local import LocalHost, ProcessHost
from manager.hub.fetching import Fetcher
from manager.launch.command import LaunchCommand
from manager.launch.secrets import Redactor
from manager.schemas.worker import Worker
from manager.settings import Settings
from manager.supervisor.events import EventLog
from manager.supervisor.policy import Policy
from manager.supervisor.worker_events import Adopted
from manager.supervisor.worker_state import Engine, Life, State

if TYPE_CHECKING:
    from manager.supervisor.runner import WorkerRunner


@dataclass(frozen=True)
class Download:
    """A hub model a start must download before its engine can load it offline."""

    repo: str
    env: Mapping[str, str]  # the config's environment: the engine's cache and token
    timeout_s: float | None  # download_timeout_s; None: no limit


@dataclass
class Prepared:
    """What the supervisor prepared for one start: the command, where it runs and its limits."""

    served_name: str
    command: LaunchCommand
    start_timeout_s: float
    secrets: Redactor = field(default_factory=Redactor)  # the config's, hidden in its events and log lines
    engine_key: str | None = field(default=None, repr=False)  # the API key the engine will ask for
    host: ProcessHost = field(default_factory=LocalHost)  # the box it runs on
    run_dir: Path | None = None  # its run folder on that box (None: the worker's local one)
    log_dir: Path | None = None  # its log folder on that box, when that is another box
    port: int | None = None  # the port the command names, when not the one the start was asked for
    download: Download | None = None  # what must be downloaded before the command can run


# Builds the launch for a model config: (worker id, config name, port, gpus, force).
Prepare = Callable[[int, str, int, list[int], bool], Prepared]


@dataclass
class RunnerDeps:
    settings: Settings
    engine: DbEngine
    events: EventLog
    http: httpx.AsyncClient
    prepare: Prepare
    # The box a worker stored on node N runs on (None: this one, without a cluster).
    host_of: Callable[[str | None], ProcessHost] = lambda node: LocalHost()
    # What re-adopting a worker's live engine tells its state machine (message -> Adopted).
    adopted: Callable[[WorkerRunner, str], Adopted] | None = None
    # A lost node's engine that its worker let go of (stopped, or moved elsewhere): ended when it returns.
    abandon: Callable[[str, Engine], None] = lambda node, engine: None
    # After a start: (config name, engine log) -> the plan_mismatch event's message and data, or None.
    check_plan: Callable[[str, Path], tuple[str, dict] | None] | None = None
    # Downloads from the Hugging Face Hub (None: vLLM downloads during its start, as without the manager).
    fetcher: Fetcher | None = None
    # Awaited before an engine starts once its model is downloaded (config name): room for it is made
    # then. A ManagerError refuses the launch.
    make_room: Callable[[str], Awaitable[None]] | None = None


def policy_of(settings: Settings) -> Policy:
    return Policy(
        health_interval_s=settings.health_interval_s,
        health_failures_before_crash=settings.health_failures_before_crash,
        healthy_reset_s=settings.healthy_reset_s,
        restart_ceiling=settings.restart_ceiling,
        backoff_base_s=settings.backoff_base_s,
        backoff_cap_s=settings.backoff_cap_s,
        stop_grace_s=settings.stop_grace_s,
    )


def life_of(row: Worker) -> Life:
    engine = None
    if row.pid:
        engine = Engine(row.pid, row.pid_create_time, tuple(row.cmdline))
    return Life(
        state=State(row.state),
        model=row.model_name,
        port=row.port,
        engine=engine,
        # SQLite gives the stored time back without its zone; it was written in UTC.
        started_at=row.started_at.replace(tzinfo=UTC)
        if row.started_at and not row.started_at.tzinfo
        else row.started_at,
        desired=row.desired,
        restart_count=row.restart_count,
        last_error=row.last_error,
        waits_for_node=row.waits_for_node,
    )
