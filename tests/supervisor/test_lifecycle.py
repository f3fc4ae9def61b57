"""The worker's state machine on its own: no process, no database, no FastAPI.

Each test feeds events to ``lifecycle.step`` as the runner would (including the results of the
effects it asked for) and checks the states, the effects and the events a user would see.
"""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime

import pytest

from manager.errors import Invalid, WaitsForNodes
from manager.supervisor import lifecycle
from manager.supervisor.policy import Policy, tick_interval
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
from manager.supervisor.worker_state import Engine, Life, State

POLICY = Policy(
    health_interval_s=2.0,
    health_failures_before_crash=3,
    healthy_reset_s=600.0,
    restart_ceiling=2,
    backoff_base_s=10.0,
    backoff_cap_s=300.0,
    stop_grace_s=20.0,
)
WHEN = datetime(2026, 11, 23, 9, 0, tzinfo=UTC)

# How a start that waits for a lost node is refused (manager.launch.refusals.check_gpus_known).
SHORT = "a needs 2 GPUs and the Ray cluster's live nodes have 1 (head: 1), with node b lost"


def stopped(model: str = "a") -> Life:
    return Life(state=State.STOPPED, model=model, port=18000)


def step(life: Life, event: Event) -> tuple[Life, list[Effect]]:
    return lifecycle.step(life, event, POLICY)


def launched(effect: Effect, pid: int = 100, now: float = 0.0, timeout: float = 60.0) -> Launched:
    """What the runner answers after carrying out a Launch."""
    assert isinstance(effect, Launch)
    return Launched(
        reason=effect.reason,
        model=effect.model,
        served_name=effect.model,
        engine=Engine(pid, 1.0, ("python", "-m", "vllm", effect.model)),
        argv=("python", "-m", "vllm", effect.model),
        started_at=WHEN,
        start_timeout_s=timeout,
        now=now,
    )


def probed(now: float, healthy: bool = True, serves: bool = True, log: str | None = None) -> Probed:
    return Probed(healthy, serves, "ready" if serves else "/health: ConnectError", log, now)


def records(effects: list[Effect]) -> list[tuple[str, str]]:
    return [(e.kind, e.message) for e in effects if isinstance(e, Record)]


def kinds(effects: list[Effect]) -> list[str]:
    return [type(e).__name__ for e in effects]


def running(model: str = "a", pid: int = 100, now: float = 0.0) -> Life:
    """A worker that was started and is ready."""
    life, effects = step(stopped(model), StartRequested())
    life, _ = step(life, launched(effects[0], pid=pid, now=now))
    life, _ = step(life, probed(now + 1))
    assert life.state == State.READY
    return life


def restarting() -> tuple[Life, list[Effect]]:
    """A ready worker whose engine exited at 10 s, at its crash restart (20 s): the Launch asked for."""
    life, _ = step(running(now=0.0), Exited("exited", None, 10.0))
    return step(life, Tick(20.0))


def test_a_launch_on_another_port_moves_the_worker_there_and_says_why():
    life, effects = step(stopped(), StartRequested())
    moved = dataclasses.replace(launched(effects[0]), port=18007)
    life, effects = step(life, moved)
    assert life.state == State.STARTING and life.port == 18007
    assert ("port_moved", "port 18000 is held by another program: the worker listens on port 18007 now") in records(
        effects
    )
    assert "on port 18007" in records(effects)[-1][1]
    # The same port: nothing to say.
    life, effects = step(stopped(), StartRequested())
    life, effects = step(life, dataclasses.replace(launched(effects[0]), port=18000))
    assert life.port == 18000 and "port_moved" not in [kind for kind, _ in records(effects)]


def test_start_launches_then_ready_when_the_engine_serves():
    life, effects = step(stopped(), StartRequested())
    assert effects == [Launch("a", "start", False)]
    assert life.state == State.STOPPED  # nothing runs until the launch says so

    life, effects = step(life, launched(effects[0], pid=321, now=10.0))
    assert life.state == State.STARTING and life.engine and life.engine.pid == 321
    assert life.desired == "running" and life.started_at == WHEN
    assert records(effects) == [("starting", "start: a on port 18000")]

    life, effects = step(life, probed(11.0, healthy=False, serves=False, log="Loading weights"))
    assert life.state == State.STARTING and life.detail == "Loading weights" and effects == []

    life, effects = step(life, probed(12.0))
    assert life.state == State.READY and life.detail is None and life.ready_since == 12.0
    assert records(effects) == [("ready", "a is serving on port 18000")]


def test_a_second_start_makes_no_second_process():
    life = running()
    assert step(life, StartRequested()) == (life, [])
    starting, effects = step(stopped(), StartRequested())
    starting, _ = step(starting, launched(effects[0]))
    assert step(starting, StartRequested()) == (starting, [])


def test_engine_exit_before_ready_is_failed_with_vllms_reason():
    life, effects = step(stopped(), StartRequested())
    life, _ = step(life, launched(effects[0]))
    life, effects = step(life, Exited("exited with code 1", "ValueError: max_model_len too large", 5.0))
    assert life.state == State.FAILED and life.engine is None
    assert life.last_error == "exited with code 1 before it was ready: ValueError: max_model_len too large"
    assert records(effects) == [("failed", life.last_error)]


def test_start_timeout_kills_the_group_and_fails():
    life, effects = step(stopped(), StartRequested())
    life, _ = step(life, launched(effects[0], pid=55, now=0.0, timeout=60.0))
    life, effects = step(life, probed(59.0, healthy=False, serves=False, log="still loading"))
    assert life.state == State.STARTING and effects == []
    life, effects = step(life, probed(61.0, healthy=False, serves=False, log="still loading"))
    reason = "not ready within the start timeout; last log line: still loading"
    assert effects == [KillGroup(55, reason)]
    assert life.state == State.STARTING  # failed only once the group is gone
    life, effects = step(life, Killed(reason, 75.0))
    assert life.state == State.FAILED and life.engine is None
    assert life.last_error == reason and records(effects) == [("failed", reason)]


def test_crash_backs_off_restarts_and_gives_up_past_the_ceiling():
    life = running(now=0.0)
    life, effects = step(life, Exited("exited with code -9", None, 100.0))
    assert life.state == State.CRASHED and life.restart_count == 1 and life.engine is None
    assert life.next_restart_at == 110.0  # 10 s after the first crash
    assert records(effects) == [("crashed", "exited with code -9 while serving; restart 1 in 10 s")]
    assert tick_interval(life, 105.0, POLICY) == 1.0

    assert step(life, Tick(109.0)) == (life, [])  # not yet
    life, effects = step(life, Tick(110.0))
    assert effects == [Launch("a", "restart after crash", False)]
    life, effects = step(life, launched(effects[0], pid=101, now=110.0))
    assert records(effects)[0][0] == "starting"
    assert life.last_error == "exited with code -9 while serving"  # kept while it restarts
    life, _ = step(life, probed(111.0))
    assert life.state == State.READY and life.restart_count == 1

    life, _ = step(life, Exited("exited with code -9", None, 200.0))
    assert life.restart_count == 2 and life.next_restart_at == 220.0  # doubled
    life, effects = step(life, Tick(220.0))
    life, _ = step(life, launched(effects[0], pid=102, now=220.0))
    life, _ = step(life, probed(221.0))
    life, effects = step(life, Exited("exited with code -9", None, 300.0))
    assert life.state == State.FAILED and life.restart_count == 3
    assert life.last_error == "exited with code -9 while serving; gave up after 2 restarts"
    assert tick_interval(life, 300.0, POLICY) is None


def test_health_failures_in_a_row_are_a_crash_and_one_success_resets_them():
    life = running(pid=77, now=0.0)
    life, _ = step(life, probed(2.0, healthy=False, serves=False))
    life, _ = step(life, probed(4.0, healthy=False, serves=False))
    assert life.health_failures == 2
    life, _ = step(life, probed(6.0))
    assert life.health_failures == 0 and life.state == State.READY
    for t in (8.0, 10.0):
        life, _ = step(life, probed(t, healthy=False, serves=False))
    life, effects = step(life, probed(12.0, healthy=False, serves=False))
    reason = "/health failed 3 times in a row (/health: ConnectError)"
    assert effects == [KillGroup(77, reason)]
    assert life.state == State.READY  # crashed only once the hung group is gone
    life, effects = step(life, Killed(reason, 34.0))
    assert life.state == State.CRASHED and life.engine is None and life.next_restart_at == 44.0
    assert life.last_error == reason and records(effects) == [("crashed", f"{reason}; restart 1 in 10 s")]


def test_restart_counter_resets_after_a_healthy_while():
    life, effects = restarting()
    life, _ = step(life, launched(effects[0], now=20.0))
    life, _ = step(life, probed(21.0))
    life, effects = step(life, probed(500.0))
    assert life.restart_count == 1 and effects == []
    life, effects = step(life, probed(621.0))
    assert life.restart_count == 0
    assert records(effects) == [("healthy", "healthy long enough: restart counter reset")]


def test_a_crash_restart_that_fails_to_start_counts_as_another_crash():
    life, effects = restarting()
    life, _ = step(life, launched(effects[0], now=20.0))
    life, _ = step(life, Exited("exited with code 1", "OSError: disk", 25.0))
    assert life.state == State.CRASHED and life.restart_count == 2
    assert life.last_error == "restart did not become ready: exited with code 1 before it was ready: OSError: disk"


def test_a_crash_restart_refused_by_the_planner_is_failed():
    life, _ = restarting()
    life, effects = step(life, LaunchRefused(Invalid("does not fit: 4.76 GiB of KV, 4.38 GiB left")))
    assert life.state == State.FAILED
    assert life.last_error == "restart refused: does not fit: 4.76 GiB of KV, 4.38 GiB left"
    assert not any(isinstance(e, Reject) for e in effects)


def test_a_crash_restart_the_live_nodes_cannot_hold_starts_again_when_a_node_is_back():
    """A model spanning two nodes, one of them lost: its restart is refused at once, and it starts
    again by itself when a node comes back."""
    life, _ = restarting()
    life, _ = step(life, LaunchRefused(WaitsForNodes(SHORT)))
    assert life.state == State.FAILED and life.waits_for_node
    assert life.last_error == (f"restart refused: {SHORT}; it starts again when a lost node is back")
    life, effects = step(life, NodeBack())
    assert [type(e) for e in effects] == [Launch] and effects[0].reason == "a lost node is back"
    assert not life.waits_for_node
    # Still too few: failed again, and waiting again.
    life, _ = step(life, LaunchRefused(WaitsForNodes("a needs 2 GPUs")))
    assert life.state == State.FAILED and life.waits_for_node


def test_a_crash_restart_refused_after_its_download_for_want_of_a_node_waits_for_one_too():
    life, effects = restarting()
    life, _ = step(life, NeedsDownload(effects[0], "org/model", 21.0))
    assert life.state == State.DOWNLOADING
    life, _ = step(life, LaunchRefused(WaitsForNodes("node 'b' is lost: wait until it is back")))
    assert life.state == State.FAILED and life.waits_for_node


def test_a_user_start_refused_after_its_download_for_want_of_a_node_starts_when_one_is_back():
    """Nobody waits for the answer once a download is over: a start the live nodes cannot hold then
    fails, and starts by itself when a node is back, as a crash restart would."""
    life, effects = step(stopped(), StartRequested())
    life, _ = step(life, NeedsDownload(effects[0], "org/model", 21.0))
    life, _ = step(life, Fetched(True, "", life.download_since or 0.0, 40.0))
    life, _ = step(life, LaunchRefused(WaitsForNodes(SHORT)))
    assert life.state == State.FAILED and life.waits_for_node
    assert life.last_error == (f"start refused: {SHORT}; it starts when a lost node is back")
    life, effects = step(life, NodeBack())
    assert effects == [Launch("a", "a lost node is back", False)]


def rolling_back() -> tuple[Life, list]:
    """Worker a switched to b, whose engine exited before it was ready: rolling back to a."""
    life = running("a", pid=1)
    life, effects = step(life, SwitchRequested("b", alive=True))
    life, _ = step(life, GroupStopped(True, 1.0, (), ()))
    life, _ = step(life, launched(effects[3], pid=2))
    return step(life, Exited("exited", None, 9.0))


def test_a_switch_roll_back_the_live_nodes_cannot_hold_starts_the_previous_config_when_a_node_is_back():
    life, effects = rolling_back()
    assert effects[-1] == Launch("a", "roll back after failed switch to b", False)
    life, _ = step(life, LaunchRefused(WaitsForNodes(SHORT)))
    assert life.state == State.FAILED and life.waits_for_node and life.model == "a"
    assert life.last_error.endswith(f"the roll back was refused: {SHORT}; a starts again when a lost node is back")
    life, effects = step(life, NodeBack())
    assert effects == [Launch("a", "a lost node is back", False)]  # the config it rolled back to, not b
    life, _ = step(life, launched(effects[0], pid=3, now=50.0))
    assert life.model == "a" and life.state == State.STARTING


def test_a_node_back_starts_no_worker_that_failed_otherwise_or_was_stopped_since():
    life, _ = restarting()
    failed, _ = step(life, LaunchRefused(Invalid("does not fit: 4.76 GiB of KV, 4.38 GiB left")))
    assert failed.state == State.FAILED and not failed.waits_for_node
    assert step(failed, NodeBack()) == (failed, [])
    waiting, _ = step(life, LaunchRefused(WaitsForNodes("node 'b' is lost: wait until it is back")))
    stopped_since, _ = step(waiting, StopRequested("stop requested", alive=False))
    assert stopped_since.state == State.STOPPED
    assert step(stopped_since, NodeBack())[1] == []


def test_a_start_over_several_nodes_under_way_when_a_node_is_lost_is_ended_and_waits_for_the_node():
    """Seen on two GPUs: the TP-2 engine's restart began before Ray called the node lost, and then sat
    waiting in Ray for the lost GPU until its start timeout. Now the node's loss ends that start, and
    the start tried again at once finds the live nodes too few, and waits."""
    life, effects = restarting()
    life, _ = step(life, launched(effects[0], pid=300, now=20.0))
    assert life.state == State.STARTING and life.restart_count == 1
    lost = "node gpu-b is lost while it was starting over several nodes"
    life, effects = step(life, SpanNodeLost("gpu-b"))
    assert effects == [KillGroup(300, lost)]
    life, effects = step(life, Killed(lost, 25.0))
    # Tried again at once, and not counted as a crash: a flapping node never uses up the restarts.
    assert effects == [Launch("a", lost, False)] and life.restart_count == 1
    life, _ = step(life, LaunchRefused(WaitsForNodes(SHORT)))
    assert life.state == State.FAILED and life.waits_for_node
    life, effects = step(life, NodeBack())
    assert [type(e) for e in effects] == [Launch]


def test_a_user_started_start_over_several_nodes_is_tried_again_too_and_a_ready_one_is_left_alone():
    life, effects = step(stopped(), StartRequested())
    life, _ = step(life, launched(effects[0], pid=301))
    life, effects = step(life, SpanNodeLost("gpu-b"))
    assert [type(e) for e in effects] == [KillGroup]
    life, effects = step(life, Killed("node gpu-b is lost while it was starting over several nodes", 5.0))
    assert [type(e) for e in effects] == [Launch]  # tried again, not failed for good
    life, _ = step(life, launched(effects[0], pid=302, now=6.0))
    assert life.state == State.STARTING and life.engine is not None and life.engine.pid == 302
    # A worker already serving: vLLM's executor fails by itself when a rank is gone.
    ready = running()
    assert step(ready, SpanNodeLost("gpu-b")) == (ready, [])
    assert step(stopped(), SpanNodeLost("gpu-b")) == (stopped(), [])


def test_a_switch_to_a_model_over_several_nodes_rolls_back_when_a_node_is_lost_during_its_start():
    life, effects = step(running("a", pid=1), SwitchRequested("tp2", alive=True))
    launch = next(e for e in effects if isinstance(e, Launch))
    life, _ = step(life, GroupStopped(True, 1.0, (), ()))
    life, _ = step(life, launched(launch, pid=400, now=2.0))
    assert life.state == State.STARTING and life.switch_from == "a"
    life, effects = step(life, SpanNodeLost("gpu-b"))
    life, effects = step(life, Killed("node gpu-b is lost while it was starting over several nodes", 3.0))
    assert [e.model for e in effects if isinstance(e, Launch)] == ["a"]  # rolled back to the model it left
    assert "switch_failed" in [kind for kind, _ in records(effects)]


def test_a_start_the_user_asked_for_and_that_is_refused_answers_the_user():
    life, _ = step(stopped(), StartRequested())
    error = Invalid("cannot run the engine interpreter '/nope'")
    life, effects = step(life, LaunchRefused(error))
    assert life.state == State.STOPPED and effects == [Reject(error)]


def test_stop_while_starting_stops_the_group():
    life, effects = step(stopped(), StartRequested())
    life, _ = step(life, launched(effects[0], pid=42))
    life, effects = step(life, StopRequested("stop requested", alive=True))
    assert life.state == State.STOPPING
    assert kinds(effects) == ["Record", "StopGroup"] and effects[1] == StopGroup(42)
    life, effects = step(life, GroupStopped(False, 21.3, (42, 43), ()))
    assert life.state == State.STOPPED and life.engine is None and life.desired == "stopped"
    assert records(effects) == [("stopped", "stopped with SIGKILL after 20 s in 21.3 s")]


def test_stop_of_a_crashed_worker_cancels_its_restart():
    life = running()
    life, _ = step(life, Exited("exited", None, 10.0))
    life, effects = step(life, StopRequested("stop requested", alive=False))
    assert life.state == State.STOPPED and life.next_restart_at is None
    assert records(effects) == [("stopped", "stop requested")]
    assert step(life, Tick(1e9)) == (life, [])


def test_a_stopped_worker_stopped_again_records_nothing():
    assert step(stopped(), StopRequested("stop requested", alive=False))[1] == []


def test_stop_reports_leftovers_and_gpu_notes():
    life = running(pid=9)
    life, _ = step(life, StopRequested("stop requested", alive=True))
    _, effects = step(life, GroupStopped(True, 2.0, (), (77,), ("ended pid 9 still holding GPU 0",)))
    assert records(effects) == [
        ("stopped", "stopped gracefully in 2.0 s; processes still alive: [77]; ended pid 9 still holding GPU 0")
    ]


def test_restart_stops_then_starts_with_the_counter_reset():
    life = running(pid=5)
    life = Life(**{**life.__dict__, "restart_count": 3})
    life, effects = step(life, RestartRequested(alive=True))
    assert kinds(effects) == ["Record", "StopGroup", "Launch"] and life.restart_count == 0
    life, _ = step(life, GroupStopped(True, 1.0, (), ()))
    assert life.state == State.STOPPED
    life, effects = step(life, launched(effects[2], pid=6))
    assert life.state == State.STARTING and records(effects) == [("starting", "restart: a on port 18000")]


def test_switch_stops_starts_the_new_config_and_says_switched():
    life = running("a", pid=1)
    life, effects = step(life, SwitchRequested("b", alive=True))
    assert kinds(effects) == ["Record", "StopGroup", "Record", "Launch"]
    assert effects[3] == Launch("b", "switch from a", False)
    life, _ = step(life, GroupStopped(True, 1.0, (), ()))
    life, _ = step(life, launched(effects[3], pid=2))
    assert life.model == "b" and life.state == State.STARTING
    life, effects = step(life, probed(5.0))
    assert life.state == State.READY and life.switch_from is None
    assert records(effects) == [("ready", "b is serving on port 18000"), ("switched", "switched from a to b")]


def test_switch_to_the_config_already_running_does_nothing():
    life = running("a")
    assert step(life, SwitchRequested("a", alive=True)) == (life, [])


def test_a_failed_switch_rolls_back_to_the_previous_config():
    life = running("a", pid=1)
    life, effects = step(life, SwitchRequested("b", alive=True))
    life, _ = step(life, GroupStopped(True, 1.0, (), ()))
    life, _ = step(life, launched(effects[3], pid=2))
    life, effects = step(life, Exited("exited with code 1", "ValueError: bad b", 9.0))
    assert records(effects) == [
        ("switch_failed", "switch to b failed: exited with code 1 before it was ready: ValueError: bad b")
    ]
    assert effects[-1] == Launch("a", "roll back after failed switch to b", False)
    life, _ = step(life, launched(effects[-1], pid=3))
    assert life.model == "a" and life.state == State.STARTING
    life, _ = step(life, probed(12.0))
    assert life.state == State.READY
    assert life.last_error == (
        "switch to b failed: exited with code 1 before it was ready: ValueError: bad b; rolled back to a"
    )


def test_a_refused_roll_back_leaves_the_worker_failed_with_both_reasons():
    life, _ = rolling_back()
    life, effects = step(life, LaunchRefused(Invalid("model config 'a' was changed and no longer fits")))
    assert life.state == State.FAILED
    assert life.last_error.endswith(
        "rolled back to a; the roll back was refused: model config 'a' was changed and no longer fits"
    )


def test_delete_stops_then_forgets():
    life = running(pid=8)
    life, effects = step(life, DeleteRequested(alive=True))
    assert kinds(effects) == ["Record", "StopGroup", "Forget", "Record"]
    assert records(effects)[-1] == ("deleted", "worker deleted")


def test_adoption_after_a_manager_restart_watches_the_engine_with_what_is_left_of_its_timeout():
    stored = Life(state=State.READY, model="a", port=18000, engine=Engine(4, 1.0, ("python",)))
    life, effects = step(stored, Adopted("re-adopted pid 4 after a manager restart", "a", 900.0, 100.0, 50.0))
    assert life.state == State.STARTING and life.engine == stored.engine and life.deadline == 850.0
    assert records(effects) == [("adopted", "re-adopted pid 4 after a manager restart")]
    late, _ = step(stored, Adopted("re-adopted", "a", 900.0, 5000.0, 50.0))
    assert late.deadline == 110.0  # at least a minute, even when its timeout has passed
    life, _ = step(life, probed(60.0))
    assert life.state == State.READY  # one engine, not a second one started


def test_a_worker_whose_engine_is_gone_after_a_manager_restart_is_stopped():
    stored = Life(state=State.READY, model="a", port=18000, engine=Engine(4, 1.0, ("python",)))
    life, effects = step(stored, FoundGone())
    assert life.state == State.STOPPED and life.engine is None
    assert records(effects) == [("stopped", "its process was gone after a manager restart; marked stopped")]


def test_a_failed_worker_stays_failed_with_its_reason_after_a_manager_restart():
    stored = Life(state=State.FAILED, model="a", port=18000, last_error="ValueError: no room")
    life, effects = step(stored, FoundGone())
    assert life.state == State.FAILED and life.last_error == "ValueError: no room" and effects == []


@pytest.mark.parametrize("state", list(State))
def test_every_state_answers_every_event_without_error(state: State) -> None:
    life = Life(state=state, model="a", port=1, engine=Engine(1, 1.0, ()))
    events: list[Event] = [
        StartRequested(),
        StopRequested("stop", alive=True),
        RestartRequested(alive=False),
        SwitchRequested("b", alive=True),
        DeleteRequested(alive=False),
        FoundGone(),
        Probed(True, True, "ready", None, 1.0),
        Exited("exited", None, 1.0),
        Killed("hung", 1.0),
        Tick(1.0),
        GroupStopped(True, 1.0, (), ()),
        SleepRequested(1),
        WakeRequested(),
        Slept(True, 1.0, ""),
        Woke(False, 1.0, "no", 1.0),
        NeedsDownload(Launch("a", "start"), "org/a", 1.0),
        Fetched(True, "", 1.0, 2.0),
        Fetched(False, "gated", 1.0, 2.0),
    ]
    effect_types = (
        Launch | Fetch | StopFetching | StopGroup | KillGroup | PutToSleep | WakeUp | Record | Reject | Forget
    )
    for event in events:
        new, effects = step(life, event)
        assert isinstance(new.state, State)
        assert all(isinstance(e, effect_types) for e in effects)


# ---- sleep mode ---------------------------------------------------------------------------------


def asleep(level: int = 1) -> Life:
    life, effects = step(running(), SleepRequested(level))
    assert effects == [PutToSleep(level)]
    life, effects = step(life, Slept(True, 31.1, ""))
    assert life.state == State.SLEEPING
    return life


def test_a_ready_worker_is_put_to_sleep_and_marked_asleep_before_the_engine_is_asked():
    life, effects = step(running(), SleepRequested(1))
    # No request may reach the engine while it moves its weights out: asleep from the moment it is asked.
    assert life.state == State.SLEEPING and life.sleep_level == 1 and effects == [PutToSleep(1)]
    life, effects = step(life, Slept(True, 31.1, ""))
    assert life.state == State.SLEEPING and life.engine is not None
    assert records(effects) == [("slept", "a asleep (level 1) in 31.1 s")]
    assert step(life, SleepRequested(1)) == (life, [])  # asleep already
    assert tick_interval(life, 0.0, POLICY) == POLICY.health_interval_s  # still watched


def test_a_sleep_the_engine_refuses_leaves_it_ready_and_answers_the_caller():
    life, _ = step(running(), SleepRequested(1))
    life, effects = step(life, Slept(False, 0.1, "POST /sleep answered 404: ..."))
    assert life.state == State.READY and life.sleep_level is None
    assert records(effects) == [("sleep_failed", "a could not be put to sleep: POST /sleep answered 404: ...")]
    assert isinstance(effects[-1], Reject)


def test_only_a_ready_worker_can_sleep():
    starting, effects = step(stopped(), StartRequested())
    starting, _ = step(starting, launched(effects[0]))
    for life in (starting, stopped()):
        new, effects = step(life, SleepRequested(1))
        assert new == life and isinstance(effects[0], Reject) and "only a ready worker" in effects[0].error.message


def test_waking_a_sleeper_says_how_long_it_took():
    life, effects = step(asleep(level=2), WakeRequested())
    assert life.state == State.WAKING and effects == [WakeUp(2)]
    assert step(life, WakeRequested()) == (life, [])  # waking already
    life, effects = step(life, Woke(True, 1.65, "", now=500.0))
    assert life.state == State.READY and life.ready_since == 500.0 and life.sleep_level is None
    assert records(effects) == [("woke", "woke a in 1.6 s")]
    assert step(life, WakeRequested()) == (life, [])  # awake already


def test_an_engine_that_cannot_wake_is_ended_and_failed():
    life, _ = step(asleep(), WakeRequested())
    life, effects = step(life, Woke(False, 2.0, "POST /wake_up answered 500: CUDA out of memory", now=9.0))
    reason = "waking failed: POST /wake_up answered 500: CUDA out of memory"
    assert effects == [KillGroup(100, reason)]
    assert life.state == State.WAKING  # failed only once the group is gone
    life, effects = step(life, Killed(reason, 20.0))
    assert life.state == State.FAILED and life.engine is None
    assert life.last_error == reason
    assert isinstance(effects[-1], Reject)


def test_a_start_of_a_sleeping_worker_wakes_it_rather_than_starting_a_second_engine():
    life, effects = step(asleep(), StartRequested())
    assert life.state == State.WAKING and effects == [WakeUp(1)]


def test_a_sleeping_worker_is_stopped_crashes_and_fails_health_like_a_ready_one():
    life, effects = step(asleep(), StopRequested("stop requested", alive=True))
    assert life.state == State.STOPPING and life.sleep_level is None and StopGroup(100) in effects
    crashed, effects = step(asleep(), Exited("exited with code 1", None, 10.0))
    assert crashed.state == State.CRASHED and crashed.last_error == "exited with code 1 while sleeping"
    life = asleep()
    for t in (1.0, 2.0, 3.0):
        life, effects = step(life, probed(t, healthy=False, serves=False))
    assert effects == [KillGroup(100, "/health failed 3 times in a row (/health: ConnectError)")]
    life, effects = step(life, Killed("/health failed 3 times in a row (/health: ConnectError)", 20.0))
    assert life.state == State.CRASHED


def test_a_worker_asleep_when_the_manager_stopped_is_adopted_asleep():
    stored = Life(state=State.SLEEPING, model="a", port=18000, engine=Engine(4, 1.0, ("python",)))
    life, effects = step(stored, Adopted("re-adopted pid 4", "a", 900.0, 100.0, 50.0, sleeping_level=2))
    assert life.state == State.SLEEPING and life.sleep_level == 2
    assert records(effects) == [("adopted", "re-adopted pid 4")]


# ---- a worker's node drops out of the Ray cluster ---------------------------------------------


def test_a_worker_on_a_lost_node_that_may_move_is_restarted_elsewhere_and_its_engine_let_go():
    life = running(pid=100)
    lost, effects = step(life, NodeLost("box2", can_move=True))
    assert lost.state == State.LOST and lost.engine is not None and lost.engine.pid == 100
    assert [e.kind for e in effects if isinstance(e, Record)] == ["lost"]
    launch = next(e for e in effects if isinstance(e, Launch))
    assert "box2 lost" in launch.reason
    moved, _ = step(lost, launched(launch, pid=200, now=5.0))
    assert moved.state == State.STARTING and moved.engine is not None and moved.engine.pid == 200


def test_a_worker_pinned_to_a_lost_node_waits_and_is_re_adopted_when_its_engine_is_still_there():
    lost, effects = step(running(pid=100), NodeLost("box2", can_move=False))
    assert lost.state == State.LOST and not any(isinstance(e, Launch) for e in effects)
    # Nothing is probed or restarted while it is lost.
    assert step(lost, Tick(1e6)) == (lost, [])
    assert tick_interval(lost, 0.0, POLICY) is None
    back, effects = step(lost, Adopted("re-adopted on box2", "a", 60.0, 30.0, now=10.0))
    assert back.state == State.STARTING and back.engine == lost.engine
    assert [e.kind for e in effects if isinstance(e, Record)] == ["adopted"]


def test_a_lost_worker_whose_engine_is_gone_when_its_node_returns_is_started_again():
    lost, _ = step(running(pid=100), NodeLost("box2", can_move=False))
    life, effects = step(lost, FoundGone())
    assert life.engine is None and [type(e) for e in effects] == [Launch]


def test_a_lost_worker_stopped_by_its_user_lets_its_engine_go_and_stays_stopped():
    lost, _ = step(running(pid=100), NodeLost("box2", can_move=False))
    life, _ = step(lost, StopRequested("stop requested", alive=False))
    assert life.state == State.STOPPED and life.engine is None and life.desired == "stopped"
    assert step(life, NodeLost("box2", can_move=True)) == (life, [])


def test_a_move_that_no_node_fits_keeps_the_worker_lost_with_the_reason():
    lost, effects = step(running(pid=100), NodeLost("box2", can_move=True))
    life, effects = step(lost, LaunchRefused(Invalid("a fits on no node: head: 3 GiB short")))
    assert life.state == State.LOST and life.engine == lost.engine
    assert "3 GiB short" in effects[0].message


def test_a_sleeping_worker_on_a_node_that_returns_is_asleep_again():
    life = running(pid=100)
    asleep, _ = step(life, SleepRequested(1))
    lost, _ = step(asleep, NodeLost("box2", can_move=False))
    assert lost.sleep_level == 1
    back, _ = step(lost, Adopted("back", "a", 60.0, 30.0, now=10.0, sleeping_level=lost.sleep_level))
    assert back.state == State.SLEEPING


def test_a_worker_being_stopped_when_its_node_is_lost_is_never_moved():
    stopping, _ = step(running(pid=100), StopRequested("stop requested", alive=True))
    assert stopping.state == State.STOPPING
    assert step(stopping, NodeLost("box2", can_move=True)) == (stopping, [])
    # The stop that could not reach the node settles it as stopped, with why.
    life, effects = step(stopping, GroupStopped(False, 0.0, (), (), ("node box2 did not answer",)))
    assert life.state == State.STOPPED and life.desired == "stopped"
    assert "node box2 did not answer" in effects[0].message
