"""A worker's life as a pure state machine: ``step(life, event, policy) -> (life, effects)``.

This file alone decides a worker's state. The runner (``runner.py``) observes the process and the
engine's endpoints, turns what it sees and what users ask into events, and carries out the effects
that come back (launch a process, stop its group, record an event); results come back as events.
Nothing here does I/O or reads a clock: every time is in the event that needs it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import datetime
from enum import StrEnum

from manager.errors import Conflict, ManagerError
from manager.placement import sleep_level_of


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


def backoff_delay(restart_number: int, base_s: float = 10.0, cap_s: float = 300.0) -> float:
    """Delay before the n-th restart in a row: base x 2^(n-1), capped (10, 20, 40, ... 300 s)."""
    n = max(1, restart_number)
    return min(cap_s, base_s * 2 ** (n - 1))


@dataclass(frozen=True)
class Policy:
    """The supervision rules (from the settings)."""

    health_interval_s: float = 5.0
    health_failures_before_crash: int = 3
    healthy_reset_s: float = 600.0
    restart_ceiling: int = 5
    backoff_base_s: float = 10.0
    backoff_cap_s: float = 300.0
    stop_grace_s: float = 20.0


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

    @property
    def active(self) -> bool:
        return self.state in ACTIVE


# ---- events: what users asked for, and what the runner saw -------------------------------------


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


# ---- effects: what the runner must do ------------------------------------------------------------


@dataclass(frozen=True)
class Launch:
    """Prepare the config's command and start it; answers Launched or LaunchRefused, or NeedsDownload
    when its model must be downloaded first."""

    model: str
    reason: str
    force: bool = False
    downloaded: bool = False  # its download has just ended: launch now, whatever the cache says


@dataclass(frozen=True)
class Fetch:
    """Wait for the download of ``repo`` in the background (joining one under way); answers Fetched."""

    repo: str
    since: float


@dataclass(frozen=True)
class StopFetching:
    """Stop waiting for the download (the download itself goes on: others may wait for it too)."""


@dataclass(frozen=True)
class StopGroup:
    """SIGTERM, grace, SIGKILL to the engine's process group; answers GroupStopped."""

    pid: int


@dataclass(frozen=True)
class KillGroup:
    """End a failed engine's group (hung, or too slow to start); answers Killed with the reason."""

    pid: int
    reason: str


@dataclass(frozen=True)
class PutToSleep:
    """POST /sleep?level=N to the engine, then confirm with GET /is_sleeping; answers Slept."""

    level: int


@dataclass(frozen=True)
class WakeUp:
    """POST /wake_up (level 2: reload the weights first), confirm with /is_sleeping; answers Woke."""

    level: int


@dataclass(frozen=True)
class Record:
    kind: str
    message: str
    data: tuple[tuple[str, object], ...] = ()


@dataclass(frozen=True)
class Reject:
    """Answer the command that asked with this error."""

    error: ManagerError


@dataclass(frozen=True)
class Forget:
    """Delete the worker; its owner task ends."""


Effect = Launch | Fetch | StopFetching | StopGroup | KillGroup | PutToSleep | WakeUp | Record | Reject | Forget
Step = tuple[Life, list[Effect]]


def record(kind: str, message: str, **data: object) -> Record:
    return Record(kind, message, tuple(data.items()))


def _moved(old: Life, new: Life, kind: str, message: str, **data: object) -> Record:
    return record(kind, message, state=new.state.value, previous=old.state.value, **data)


# ---- the machine -------------------------------------------------------------------------------


def step(life: Life, event: Event, policy: Policy) -> Step:
    match event:
        case StartRequested(force=force):
            if life.state in (State.DOWNLOADING, State.STARTING, State.READY, State.WAKING):
                return life, []  # already running: two starts make one process
            if life.state == State.SLEEPING:
                return _wake(life)  # its engine is there: waking it is the start
            return _launch(replace(life, restart_count=0), StartKind.START, life.model, "start", force)
        case StopRequested(reason=reason, alive=alive):
            return _stop(life, reason, alive)
        case RestartRequested(alive=alive, force=force):
            stopped, effects = _stop(life, "restart requested", alive)
            launched, more = _launch(replace(stopped, restart_count=0), StartKind.RESTART, life.model, "restart", force)
            return launched, effects + more
        case SwitchRequested(model=model, alive=alive, force=force):
            return _switch(life, model, alive, force)
        case DeleteRequested(alive=alive):
            stopped, effects = _stop(life, "worker deleted", alive)
            return stopped, [*effects, Forget(), record("deleted", "worker deleted")]
        case Adopted():
            return _adopted(life, event)
        case FoundGone():
            if life.state == State.LOST and life.desired == "running":
                gone = replace(life, engine=None, sleep_level=None)
                return _launch(
                    gone, StartKind.CRASH_RESTART, life.model, "its engine was gone when its node came back", False
                )
            if life.state in (State.STOPPED, State.FAILED):  # a failed start keeps its reason
                return replace(life, engine=None), []
            if life.state == State.DOWNLOADING:  # it has no engine: its start begins again, and rejoins the download
                waiting = _download_over(life)
                return _launch(
                    waiting, StartKind.START, life.model, "its download was under way at a manager restart", False
                )
            new = replace(life, state=State.STOPPED, engine=None)
            return new, [_moved(life, new, "stopped", "its process was gone after a manager restart; marked stopped")]
        case NodeLost():
            return _node_lost(life, event)
        case Launched():
            return _launched(life, event)
        case LaunchRefused(error=error):
            if life.state == State.DOWNLOADING:
                return _refused_after_download(life, error)
            return _launch_refused(life, error)
        case NeedsDownload():
            return _needs_download(life, event)
        case Fetched():
            if life.state != State.DOWNLOADING or event.since != life.download_since:
                return life, []  # the end of a wait given up on (stopped, or started again since)
            return _fetched(life, event, policy)
        case GroupStopped():
            return _group_stopped(life, event, policy)
        case Probed():
            if life.state == State.STARTING:
                return _probed_starting(life, event)
            if life.state in SERVING:
                return _probed_ready(life, event, policy)
            return life, []
        case Exited(exit_text=exit_text, log_reason=reason, now=now):
            if life.state == State.STARTING:
                return _start_failed(life, f"{exit_text} before it was ready: {reason or 'no output'}", policy, now)
            if life.state in SERVING or life.state == State.WAKING:
                doing = "while serving" if life.state == State.READY else f"while {life.state.value}"
                return _crashed(life, f"{exit_text} {doing}" + (f": {reason}" if reason else ""), policy, now)
            return life, []
        case Killed(reason=reason, now=now):
            # Published only now, once the group is gone: "crashed" or "failed" never names a live engine.
            if life.state == State.STARTING:
                return _start_failed(life, reason, policy, now)
            if life.state in SERVING:
                return _crashed(life, reason, policy, now)
            if life.state == State.WAKING:
                failed, effects = _failed(replace(life, sleep_level=None), reason)
                return failed, [*effects, Reject(Conflict(f"{life.model}: {reason}"))]
            return life, []
        case SleepRequested(level=level):
            return _sleep(life, level)
        case WakeRequested():
            return _wake(life)
        case Slept():
            return _slept(life, event)
        case Woke():
            return _woke(life, event)
        case Tick(now=now):
            if life.state == State.CRASHED and life.next_restart_at is not None and now >= life.next_restart_at:
                waiting = replace(life, next_restart_at=None)
                return _launch(waiting, StartKind.CRASH_RESTART, life.model, "restart after crash", False)
            return life, []
    raise TypeError(f"not a worker event: {event!r}")


def tick_interval(life: Life, now: float, policy: Policy) -> float | None:
    """How long the runner may wait for a command before it must look at the engine again."""
    if life.state == State.STARTING:
        return 0.5
    if life.state in SERVING:
        return policy.health_interval_s
    if life.state == State.CRASHED and life.next_restart_at is not None:
        return max(0.05, min(1.0, life.next_restart_at - now))
    return None


def _launch(life: Life, kind: StartKind, model: str, reason: str, force: bool) -> Step:
    return replace(life, start_kind=kind, next_restart_at=None), [Launch(model, reason, force)]


def _stop(life: Life, reason: str, alive: bool) -> Step:
    calm = replace(_download_over(life), next_restart_at=None, switch_from=None, start_kind=None, sleep_level=None)
    effects: list[Effect] = []
    if life.state == State.DOWNLOADING:
        effects.append(StopFetching())
        reason = f"{reason}; the download of {life.download} goes on"
    if alive and life.engine is not None:
        new = replace(calm, state=State.STOPPING)
        return new, [*effects, _moved(life, new, "stopping", reason, pid=life.engine.pid), StopGroup(life.engine.pid)]
    new = replace(calm, state=State.STOPPED, engine=None, desired="stopped")
    if life.state == State.STOPPED:
        return new, []
    return new, [*effects, _moved(life, new, "stopped", reason)]


def _group_stopped(life: Life, event: GroupStopped, policy: Policy) -> Step:
    how = "gracefully" if event.graceful else f"with SIGKILL after {policy.stop_grace_s:g} s"
    message = f"stopped {how} in {event.seconds:.1f} s"
    if event.leftover:
        message += f"; processes still alive: {list(event.leftover)}"
    for note in event.notes:
        message += f"; {note}"
    new = replace(life, state=State.STOPPED, engine=None, desired="stopped")
    data = {"graceful": event.graceful, "leftover": list(event.leftover), "killed": list(event.killed)}
    return new, [_moved(life, new, "stopped", message, **data)]


def _switch(life: Life, model: str, alive: bool, force: bool) -> Step:
    previous = life.model
    if model == previous and life.state in (State.DOWNLOADING, State.STARTING, State.READY):
        return life, []
    stopped, effects = _stop(life, f"switching from {previous} to {model}", alive)
    switching = replace(stopped, switch_from=previous, restart_count=0)
    note = record("switching", f"switching from {previous} to {model}", previous=previous, model=model)
    launched, more = _launch(switching, StartKind.SWITCH, model, f"switch from {previous}", force)
    return launched, [*effects, note, *more]


def _launched(life: Life, event: Launched) -> Step:
    # A crash restart and a roll back keep the error that led to them; a user's start clears it.
    keep_error = life.start_kind in (StartKind.CRASH_RESTART, StartKind.ROLLBACK)
    new = replace(
        _download_over(life),
        state=State.STARTING,
        model=event.model,
        served_name=event.served_name,
        port=event.port or life.port,
        engine=event.engine,
        started_at=event.started_at,
        desired="running",
        last_error=life.last_error if keep_error else None,
        detail="process started",
        deadline=event.now + event.start_timeout_s,
        health_failures=0,
        sleep_level=None,
    )
    effects: list[Effect] = []
    if event.removed_stale:
        count = len(event.removed_stale)
        effects.append(
            record(
                "cleanup", f"removed {count} stale KV-offload file(s) from /dev/shm", files=list(event.removed_stale)
            )
        )
    if new.port != life.port:
        effects.append(
            record(
                "port_moved",
                f"port {life.port} is held by another program: the worker listens on port {new.port} now",
                previous_port=life.port,
                port=new.port,
            )
        )
    message = f"{event.reason}: {event.model} on port {new.port}"
    effects.append(_moved(life, new, "starting", message, pid=event.engine.pid, argv=list(event.argv)))
    return new, effects


def _node_lost(life: Life, event: NodeLost) -> Step:
    # A download runs on the manager's box, for an engine that does not exist yet: nothing is out of reach.
    if life.state in (State.STOPPED, State.FAILED, State.LOST, State.DOWNLOADING):
        return life, []
    if life.state == State.STOPPING:  # the stop under way settles it; a worker being stopped never moves
        return life, []
    # Its engine stays recorded: if the node comes back with it still running, it is re-adopted.
    asleep = life.sleep_level if life.state in (State.SLEEPING, State.WAKING) else None
    new = replace(life, state=State.LOST, next_restart_at=None, switch_from=None, start_kind=None, sleep_level=asleep)
    effects: list[Effect] = [_moved(life, new, "lost", f"node {event.node} is lost: {life.model} is out of reach")]
    if event.can_move and life.desired == "running":
        launched, more = _launch(
            new, StartKind.MOVE, life.model, f"node {event.node} lost: restarting elsewhere", False
        )
        return launched, effects + more
    return new, effects


def _needs_download(life: Life, event: NeedsDownload) -> Step:
    launch = event.launch
    keep_error = life.start_kind in (StartKind.CRASH_RESTART, StartKind.ROLLBACK)
    new = replace(
        life,
        state=State.DOWNLOADING,
        model=launch.model,
        engine=None,
        desired="running",
        last_error=life.last_error if keep_error else None,
        detail=f"downloading {event.repo}",
        download=event.repo,
        download_since=event.now,
        after_download=replace(launch, downloaded=True),
        next_restart_at=None,
        health_failures=0,
        sleep_level=None,
    )
    message = f"{launch.reason}: downloading {event.repo} from the Hugging Face Hub before {launch.model} starts"
    moved = _moved(life, new, "download", message, model=launch.model, repo=event.repo)
    return new, [moved, Fetch(event.repo, event.now)]


def _fetched(life: Life, event: Fetched, policy: Policy) -> Step:
    since = event.now if life.download_since is None else life.download_since
    repo, took = life.download, event.now - since
    if event.ok:
        launch = life.after_download or Launch(life.model, "start after the download", downloaded=True)
        # Downloading still, until the launch answers: the config stays held, and a second Fetched is stale.
        waiting = replace(life, download_since=None, detail=f"downloaded {repo}: starting the engine")
        done = record(
            "download", f"downloaded {repo} in {took:.0f} s", model=life.model, repo=repo, seconds=round(took, 1)
        )
        return waiting, [done, launch]
    ended = record(
        "download", f"gave up on the download of {repo} after {took:.0f} s", model=life.model, repo=repo, ok=False
    )
    failed, effects = _start_failed(_download_over(life), event.detail, policy, event.now)
    return failed, [ended, *effects]


def _refused_after_download(life: Life, error: ManagerError) -> Step:
    """A start refused once its download was over (or begun again after a manager restart): nobody
    waits for an answer now, so the worker does not stay downloading: it fails with the reason."""
    calm = _download_over(life)
    if life.start_kind == StartKind.CRASH_RESTART:
        return _failed(calm, f"restart refused: {error.message}")
    if life.start_kind == StartKind.ROLLBACK:
        return _failed(calm, f"{life.last_error}; the roll back was refused: {error.message}")
    if life.switch_from:
        return _roll_back(calm, f"start refused: {error.message}")
    return _failed(calm, f"start refused: {error.message}")


def _download_over(life: Life) -> Life:
    return replace(life, download=None, download_since=None, after_download=None)


def _launch_refused(life: Life, error: ManagerError) -> Step:
    if life.start_kind == StartKind.MOVE:
        stay = replace(life, start_kind=None)
        return stay, [record("move_refused", f"{life.model} stays lost: {error.message}")]
    if life.start_kind == StartKind.CRASH_RESTART:
        return _failed(replace(life, start_kind=None), f"restart refused: {error.message}")
    if life.start_kind == StartKind.ROLLBACK:
        return _failed(replace(life, start_kind=None), f"{life.last_error}; the roll back was refused: {error.message}")
    return replace(life, start_kind=None, switch_from=None), [Reject(error)]


def _adopted(life: Life, event: Adopted) -> Step:
    if event.sleeping_level is not None:
        # It was put to sleep before the manager stopped; asleep it stays until a request wakes it.
        new = replace(
            life,
            state=State.SLEEPING,
            served_name=event.served_name,
            desired="running",
            start_kind=None,
            sleep_level=event.sleeping_level,
        )
        return new, [record("adopted", event.message)]
    # A big model may still be loading: give it what is left of its own start timeout (at least a minute).
    left = max(60.0, event.start_timeout_s - event.elapsed_s)
    new = replace(
        life,
        state=State.STARTING,
        served_name=event.served_name,
        deadline=event.now + left,
        desired="running",
        start_kind=None,
    )
    return new, [record("adopted", event.message)]


def _probed_starting(life: Life, event: Probed) -> Step:
    if event.serves:
        new = replace(life, state=State.READY, ready_since=event.now, detail=None, start_kind=None, switch_from=None)
        effects: list[Effect] = [_moved(life, new, "ready", f"{life.model} is serving on port {life.port}")]
        if life.switch_from:
            effects.append(
                record(
                    "switched",
                    f"switched from {life.switch_from} to {life.model}",
                    previous=life.switch_from,
                    model=life.model,
                )
            )
        return new, effects
    waiting = replace(life, detail=event.latest_log or event.detail)
    if life.deadline is not None and event.now > life.deadline and life.engine is not None:
        reason = f"not ready within the start timeout; last log line: {event.latest_log or '-'}"
        return waiting, [KillGroup(life.engine.pid, reason)]
    return waiting, []


def _probed_ready(life: Life, event: Probed, policy: Policy) -> Step:
    if event.healthy:
        life = replace(life, health_failures=0)
    else:
        failures = life.health_failures + 1
        limit = policy.health_failures_before_crash
        life = replace(life, health_failures=failures)
        if failures >= limit and life.engine is not None:
            return life, [KillGroup(life.engine.pid, f"/health failed {limit} times in a row ({event.detail})")]
    if life.restart_count and life.ready_since is not None and event.now - life.ready_since >= policy.healthy_reset_s:
        return replace(life, restart_count=0), [record("healthy", "healthy long enough: restart counter reset")]
    return life, []


def _start_failed(life: Life, reason: str, policy: Policy, now: float) -> Step:
    """A start that did not become ready: roll a switch back, count a crash restart, else failed."""
    life = replace(life, engine=None)
    if life.switch_from:
        return _roll_back(life, reason)
    if life.start_kind == StartKind.CRASH_RESTART:
        return _crashed(life, f"restart did not become ready: {reason}", policy, now)
    return _failed(life, reason)


def _roll_back(life: Life, reason: str) -> Step:
    """A switch's start failed: start the config it switched from again."""
    assert life.switch_from is not None
    previous, failed_model = life.switch_from, life.model
    error = f"switch to {failed_model} failed: {reason}; rolled back to {previous}"
    note = record("switch_failed", f"switch to {failed_model} failed: {reason}", model=failed_model, previous=previous)
    rolling = replace(life, switch_from=None, last_error=error)
    launched, effects = _launch(
        rolling, StartKind.ROLLBACK, previous, f"roll back after failed switch to {failed_model}", False
    )
    return launched, [note, *effects]


def _crashed(life: Life, reason: str, policy: Policy, now: float) -> Step:
    count = life.restart_count + 1
    life = replace(life, engine=None, restart_count=count, start_kind=None)
    if count > policy.restart_ceiling:
        return _failed(life, f"{reason}; gave up after {policy.restart_ceiling} restarts")
    delay = backoff_delay(count, policy.backoff_base_s, policy.backoff_cap_s)
    new = replace(life, state=State.CRASHED, last_error=reason, next_restart_at=now + delay)
    return new, [_moved(life, new, "crashed", f"{reason}; restart {count} in {delay:g} s", delay_s=delay)]


def _failed(life: Life, reason: str) -> Step:
    new = replace(life, state=State.FAILED, engine=None, last_error=reason, start_kind=None, switch_from=None)
    return new, [_moved(life, new, "failed", reason)]


def _sleep(life: Life, level: int) -> Step:
    if life.state == State.SLEEPING:
        return life, []
    if life.state != State.READY or life.engine is None:
        return life, [Reject(Conflict(f"the worker is {life.state.value}: only a ready worker can be put to sleep"))]
    # Marked asleep before the engine is asked: no request may be sent to it from now on.
    return replace(life, state=State.SLEEPING, sleep_level=level), [PutToSleep(level)]


def _slept(life: Life, event: Slept) -> Step:
    if life.state != State.SLEEPING:
        return life, []
    level = life.sleep_level
    if event.ok:
        message = f"{life.model} asleep (level {level}) in {event.seconds:.1f} s"
        return life, [record("slept", message, model=life.model, level=level, seconds=round(event.seconds, 3))]
    awake = replace(life, state=State.READY, sleep_level=None)
    reason = f"{life.model} could not be put to sleep: {event.detail}"
    return awake, [record("sleep_failed", reason, model=life.model), Reject(Conflict(reason))]


def _wake(life: Life) -> Step:
    if life.state in (State.READY, State.WAKING):
        return life, []
    if life.state != State.SLEEPING:
        return life, [Reject(Conflict(f"the worker is {life.state.value}, not asleep: nothing to wake"))]
    return replace(life, state=State.WAKING), [WakeUp(sleep_level_of(life.sleep_level, None))]


def _woke(life: Life, event: Woke) -> Step:
    if life.state != State.WAKING:
        return life, []
    if event.ok:
        new = replace(life, state=State.READY, sleep_level=None, ready_since=event.now, health_failures=0)
        message = f"woke {life.model} in {event.seconds:.1f} s"
        return new, [_moved(life, new, "woke", message, model=life.model, seconds=round(event.seconds, 3))]
    # An engine that cannot wake is of no use asleep either: end it, so a start can take its place
    # (failed once the group is gone: see Killed).
    assert life.engine is not None
    return life, [KillGroup(life.engine.pid, f"waking failed: {event.detail}")]
