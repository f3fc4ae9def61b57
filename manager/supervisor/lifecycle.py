"""A worker's life as a pure state machine: ``step(life, event, policy) -> (life, effects)``.

This file alone decides a worker's state. The runner (``runner.py``) observes the process and the
engine's endpoints, turns what it sees and what users ask into events (``worker_events.py``), and
carries out the effects that come back (``worker_effects.py``: launch a process, stop its group,
record an event); results come back as events. Nothing here does I/O or reads a clock: every time
is in the event that needs it.
"""

from __future__ import annotations

from dataclasses import replace

from manager.errors import Conflict, ManagerError, WaitsForNodes
from manager.placement import sleep_level_of
from manager.supervisor.policy import Policy, backoff_delay
from manager.supervisor.worker_effects import (
    Effect,
    Fetch,
    Forget,
    KillGroup,
    Launch,
    PutToSleep,
    Record,
    Reject,
    StopFetching,
    StopGroup,
    WakeUp,
    record,
)
from manager.supervisor.worker_events import (
    Adopted,
    DeleteRequested,
    Event,
    Exited,
    Fetched,
    FoundGone,
    GroupStopped,
    Killed,
    Launched,
    LaunchRefused,
    NeedsDownload,
    NodeBack,
    NodeLost,
    Probed,
    RestartRequested,
    SleepRequested,
    Slept,
    SpanNodeLost,
    StartRequested,
    StopRequested,
    SwitchRequested,
    Tick,
    WakeRequested,
    Woke,
)
from manager.supervisor.worker_state import SERVING, Life, StartKind, State

Step = tuple[Life, list[Effect]]


def _moved(old: Life, new: Life, kind: str, message: str, **data: object) -> Record:
    return record(kind, message, state=new.state.value, previous=old.state.value, **data)


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
        case SpanNodeLost(node=node):
            return _span_node_lost(life, node)
        case NodeBack():
            if life.state == State.FAILED and life.waits_for_node and life.desired == "running":
                return _launch(life, StartKind.CRASH_RESTART, life.model, "a lost node is back", False)
            return life, []
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


def _launch(life: Life, kind: StartKind, model: str, reason: str, force: bool) -> Step:
    return replace(life, start_kind=kind, next_restart_at=None, waits_for_node=False), [Launch(model, reason, force)]


def _stop(life: Life, reason: str, alive: bool) -> Step:
    calm = replace(
        _download_over(life),
        next_restart_at=None,
        switch_from=None,
        start_kind=None,
        sleep_level=None,
        waits_for_node=False,
    )
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
        return _restart_refused(calm, error)
    if life.start_kind == StartKind.ROLLBACK:
        return _roll_back_refused(calm, error)
    if life.switch_from:
        return _roll_back(calm, f"start refused: {error.message}")
    if isinstance(error, WaitsForNodes):
        reason = f"start refused: {error.message}; it starts when a lost node is back"
        return _failed(calm, reason, waits_for_node=True)
    return _failed(calm, f"start refused: {error.message}")


def _download_over(life: Life) -> Life:
    return replace(life, download=None, download_since=None, after_download=None)


def _span_node_lost(life: Life, node: str) -> Step:
    """A start of a model spanning nodes, under way when a node was lost: ended, and tried again at
    once, as a crash restart whose placement sees the live nodes (where they cannot hold it, it waits
    for a node); a switch rolls back. Left alone, vLLM's Ray executor would wait for the lost GPUs
    until the start timed out. Not knowing which nodes Ray gave the start's ranks, any lost node ends
    it: on three nodes or more, a start that did not need the lost one starts again needlessly. A
    worker already serving needs nothing here: its executor fails by itself when a rank is gone."""
    if life.state != State.STARTING or life.engine is None:
        return life, []
    ended = life if life.switch_from else replace(life, start_kind=StartKind.NODE_LOST)
    return ended, [KillGroup(life.engine.pid, f"node {node} is lost while it was starting over several nodes")]


def _launch_refused(life: Life, error: ManagerError) -> Step:
    if life.start_kind == StartKind.MOVE:
        stay = replace(life, start_kind=None)
        return stay, [record("move_refused", f"{life.model} stays lost: {error.message}")]
    if life.start_kind == StartKind.CRASH_RESTART:
        return _restart_refused(replace(life, start_kind=None), error)
    if life.start_kind == StartKind.ROLLBACK:
        return _roll_back_refused(replace(life, start_kind=None), error)
    return replace(life, start_kind=None, switch_from=None), [Reject(error)]


def _roll_back_refused(life: Life, error: ManagerError) -> Step:
    """A switch's roll back refused: failed with both reasons; where the live nodes could not hold the
    config it rolls back to, that config starts when a lost node is back."""
    reason = f"{life.last_error}; the roll back was refused: {error.message}"
    if isinstance(error, WaitsForNodes):
        return _failed(life, f"{reason}; {life.model} starts again when a lost node is back", waits_for_node=True)
    return _failed(life, reason)


def _restart_refused(life: Life, error: ManagerError) -> Step:
    """A crash restart refused: failed; where the live nodes could not hold it, it waits for a node."""
    if isinstance(error, WaitsForNodes):
        reason = f"restart refused: {error.message}; it starts again when a lost node is back"
        return _failed(life, reason, waits_for_node=True)
    return _failed(life, f"restart refused: {error.message}")


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
    if life.start_kind == StartKind.NODE_LOST:  # not the engine's fault: no crash counted, no back-off
        return _launch(replace(life, last_error=reason), StartKind.CRASH_RESTART, life.model, reason, False)
    if life.start_kind == StartKind.CRASH_RESTART:
        return _crashed(life, f"restart did not become ready: {reason}", policy, now)
    return _failed(life, reason)


def _roll_back(life: Life, reason: str) -> Step:
    """A switch's start failed: start the config it switched from again."""
    assert life.switch_from is not None
    previous, failed_model = life.switch_from, life.model
    error = f"switch to {failed_model} failed: {reason}; rolled back to {previous}"
    note = record("switch_failed", f"switch to {failed_model} failed: {reason}", model=failed_model, previous=previous)
    # The worker's model is the one it rolls back to from here: a roll back that must wait for a node
    # starts that one when the node is back.
    rolling = replace(life, switch_from=None, last_error=error, model=previous)
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


def _failed(life: Life, reason: str, waits_for_node: bool = False) -> Step:
    new = replace(
        life,
        state=State.FAILED,
        engine=None,
        last_error=reason,
        start_kind=None,
        switch_from=None,
        waits_for_node=waits_for_node,
    )
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
