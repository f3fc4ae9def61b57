"""When a model's replicas grow or shrink with its load."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from manager.frontdoor.replica_scale import Add, Remove, ReplicaState, Scaling, scale_step

SCALING = Scaling(least=1, most=3, up_after_s=10, down_after_s=300)
NOW = 10_000.0


def busy(worker_id: int, in_flight: int = 5) -> ReplicaState:
    return ReplicaState(worker_id, True, in_flight, None)


def idle(worker_id: int, for_s: float) -> ReplicaState:
    return ReplicaState(worker_id, True, 0, NOW - for_s)


def starting(worker_id: int) -> ReplicaState:
    return ReplicaState(worker_id, False, 0, None)


def test_nothing_changes_while_a_replica_is_still_starting():
    assert scale_step([busy(1), starting(2)], SCALING, NOW - 60, NOW) is None
    assert scale_step([idle(1, 900), idle(2, 900), starting(3)], SCALING, None, NOW) is None
    below_least = Scaling(least=3, most=4, up_after_s=10, down_after_s=300)
    assert scale_step([busy(1), starting(2)], below_least, None, NOW) is None


def test_a_replica_is_added_once_requests_have_queued_for_up_after_s_and_not_before():
    assert scale_step([busy(1)], SCALING, NOW - 9.5, NOW) is None
    assert isinstance(scale_step([busy(1)], SCALING, NOW - 10, NOW), Add)
    assert isinstance(scale_step([busy(1), busy(2)], SCALING, NOW - 30, NOW), Add)
    assert scale_step([busy(1)], SCALING, None, NOW) is None  # never saturated


def test_no_replica_is_added_beyond_max_replicas():
    assert scale_step([busy(1), busy(2), busy(3)], SCALING, NOW - 600, NOW) is None


def test_the_newest_replica_idle_for_down_after_s_is_removed_above_min_replicas():
    step = scale_step([idle(1, 900), idle(2, 400), idle(3, 301)], SCALING, None, NOW)
    assert isinstance(step, Remove) and step.worker_id == 3
    step = scale_step([idle(1, 900), idle(2, 400), busy(3)], SCALING, None, NOW)
    assert isinstance(step, Remove) and step.worker_id == 2
    assert scale_step([busy(1), idle(2, 299)], SCALING, None, NOW) is None  # not idle long enough
    assert scale_step([busy(1), busy(2, in_flight=1)], SCALING, None, NOW) is None


def test_never_below_min_replicas():
    assert scale_step([idle(1, 10_000)], SCALING, None, NOW) is None
    two = Scaling(least=2, most=4, up_after_s=10, down_after_s=300)
    assert scale_step([idle(1, 10_000), idle(2, 10_000)], two, None, NOW) is None


def test_a_replica_is_added_while_fewer_than_min_replicas_run():
    three = Scaling(least=3, most=4, up_after_s=10, down_after_s=300)
    step = scale_step([idle(1, 10_000), idle(2, 10_000)], three, None, NOW)
    assert isinstance(step, Add) and "min_replicas 3" in step.reason


def test_a_model_with_no_replica_running_is_left_alone():
    three = Scaling(least=3, most=4, up_after_s=10, down_after_s=300)
    assert scale_step([], three, NOW - 600, NOW) is None


@st.composite
def situations(draw: st.DrawFn) -> tuple[list[ReplicaState], Scaling, float | None]:
    least = draw(st.integers(1, 6))
    most = draw(st.integers(least, 8))
    count = draw(st.integers(least, most))
    replicas = [
        ReplicaState(
            worker_id=wid,
            ready=draw(st.booleans() | st.just(True)),
            in_flight=(in_flight := draw(st.sampled_from((0, 0, 1, 4)))),
            idle_since=None if in_flight else draw(st.none() | st.floats(0, NOW)),
        )
        for wid in draw(st.lists(st.integers(1, 50), min_size=count, max_size=count, unique=True))
    ]
    scaling = Scaling(least, most, draw(st.floats(1, 3600)), draw(st.floats(1, 3600)))
    return replicas, scaling, draw(st.none() | st.floats(0, NOW))


@settings(max_examples=400, deadline=None)
@given(situations())
def test_a_step_keeps_the_count_within_its_bounds_and_never_removes_a_busy_replica(situation) -> None:
    replicas, scaling, saturated_since = situation
    step = scale_step(replicas, scaling, saturated_since, NOW)
    count = len(replicas) + (1 if isinstance(step, Add) else -1 if isinstance(step, Remove) else 0)
    assert scaling.least <= count <= scaling.most
    if isinstance(step, Remove):
        removed = next(r for r in replicas if r.worker_id == step.worker_id)
        assert removed.in_flight == 0 and removed.ready


def test_the_replica_removed_is_the_newest_idle_one_even_if_an_older_one_was_idle_longer():
    # Added for a burst that ended before it was ready: it goes, the older keeps its prefix cache.
    step = scale_step([idle(1, 900), idle(2, 1)], SCALING, None, NOW)
    assert isinstance(step, Remove) and step.worker_id == 2
