"""Placement's promises, over many generated snapshots: what it evicts, where, and how much."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from manager.placement import MakeRoom, Need, Node, Place, RunningWorker, Snapshot, WaitForDrain, decide

G = 1 << 30
NODES = ("a", "b", "c")
GPUS = (0, 1, 2, 3)


@st.composite
def snapshots(draw: st.DrawFn) -> Snapshot:
    names = draw(st.lists(st.sampled_from(NODES), min_size=1, max_size=3, unique=True))
    nodes = tuple(Node(name, {g: draw(st.integers(20, 80)) * G for g in GPUS}) for name in names)
    count = draw(st.integers(0, 12))
    workers = []
    for wid in range(1, count + 1):
        gpus = draw(st.lists(st.sampled_from(GPUS), min_size=1, max_size=2, unique=True))
        workers.append(
            RunningWorker(
                id=wid,
                config=f"model-{wid}",
                gpus=tuple(sorted(gpus)),
                gpu_bytes=draw(st.integers(1, 60)) * G,
                last_request_at=draw(st.none() | st.floats(0, 100)),
                in_flight=draw(st.sampled_from((0, 0, 0, 1, 3))),
                persistent=draw(st.booleans()),
                may_sleep=draw(st.booleans()),
                node=draw(st.sampled_from(names)),
            )
        )
    return Snapshot(nodes, tuple(workers))


@st.composite
def needs(draw: st.DrawFn) -> Need:
    gpus = draw(st.lists(st.sampled_from(GPUS), min_size=1, max_size=4, unique=True))
    allowed = draw(st.none() | st.lists(st.sampled_from(NODES), min_size=1, max_size=3, unique=True).map(tuple))
    return Need("new", tuple(sorted(gpus)), draw(st.integers(1, 80)) * G, allowed)


def evicted(decision: MakeRoom) -> set[int]:
    return set(decision.sleep) | set(decision.stop)


def short_gpus(snapshot: Snapshot, need: Need, place: Place, gone: set[int]) -> list[int]:
    """The GPUs of ``place`` whose size is known where the need does not fit once ``gone`` have left."""
    capacity = snapshot.node(place.node).gpu_bytes or {}
    short = []
    for g in (g for g in place.gpus if g in capacity):
        held = sum(
            w.gpu_bytes or 0 for w in snapshot.workers if w.node == place.node and g in w.gpus and w.id not in gone
        )
        if held + (need.gpu_bytes or 0) > capacity[g]:
            short.append(g)
    return short


@settings(max_examples=400, deadline=None)
@given(snapshots(), needs())
def test_never_evicts_a_persistent_worker_or_one_with_requests_in_flight(snapshot: Snapshot, need: Need) -> None:
    decision = decide(need, snapshot)
    if isinstance(decision, MakeRoom):
        by_id = {w.id: w for w in snapshot.workers}
        assert not any(by_id[i].persistent or by_id[i].in_flight for i in evicted(decision))
    if isinstance(decision, WaitForDrain):
        assert all(w.in_flight > 0 and not w.persistent for w in snapshot.workers if w.id in decision.workers)


@settings(max_examples=400, deadline=None)
@given(snapshots(), needs())
def test_never_places_on_a_gpu_whose_free_memory_the_plan_exceeds(snapshot: Snapshot, need: Need) -> None:
    decision = decide(need, snapshot)
    if isinstance(decision, Place):
        assert short_gpus(snapshot, need, decision, set()) == []
    if isinstance(decision, MakeRoom):
        assert short_gpus(snapshot, need, decision.then, evicted(decision)) == []


@settings(max_examples=400, deadline=None)
@given(snapshots(), needs())
def test_only_evicts_on_the_node_it_places_on_and_only_on_a_node_the_need_allows(
    snapshot: Snapshot, need: Need
) -> None:
    decision = decide(need, snapshot)
    place = decision.then if isinstance(decision, MakeRoom) else decision
    if isinstance(place, Place):
        assert need.nodes is None or place.node in need.nodes
    if isinstance(decision, MakeRoom):
        assert {w.node for w in snapshot.workers if w.id in evicted(decision)} == {decision.then.node}


@settings(max_examples=400, deadline=None)
@given(snapshots(), needs())
def test_evicts_no_worker_it_could_spare_and_no_more_bytes_than_another_node_would_need(
    snapshot: Snapshot, need: Need
) -> None:
    decision = decide(need, snapshot)
    if not isinstance(decision, MakeRoom):
        return
    gone = evicted(decision)
    # Each one it evicts is needed: leaving any one of them in place leaves a GPU short.
    for spared in gone:
        assert short_gpus(snapshot, need, decision.then, gone - {spared}) != []
    # A node where it fits as things are is always taken over one where workers must go.
    allowed = need.nodes if need.nodes is not None else tuple(n.name for n in snapshot.nodes)
    for name in allowed:
        assert short_gpus(snapshot, need, Place(name, need.gpus), set()) != []


@st.composite
def shared_snapshots(draw: st.DrawFn) -> tuple[Snapshot, Need]:
    """Nodes with GPUs of different sizes, and workers and a need given as shares of each GPU."""
    names = draw(st.lists(st.sampled_from(NODES), min_size=1, max_size=3, unique=True))
    nodes = tuple(Node(name, dict.fromkeys(GPUS, draw(st.sampled_from((24, 40, 80, 141))) * G)) for name in names)
    workers = tuple(
        RunningWorker(
            id=wid,
            config=f"model-{wid}",
            gpus=tuple(sorted(draw(st.lists(st.sampled_from(GPUS), min_size=1, max_size=2, unique=True)))),
            gpu_bytes=None,
            last_request_at=draw(st.floats(0, 100)),
            in_flight=draw(st.sampled_from((0, 0, 1))),
            persistent=draw(st.booleans()),
            node=draw(st.sampled_from(names)),
            gpu_share=draw(st.sampled_from((0.2, 0.3, 0.45, 0.6, 0.9))),
        )
        for wid in range(1, draw(st.integers(0, 10)) + 1)
    )
    gpus = tuple(sorted(draw(st.lists(st.sampled_from(GPUS), min_size=1, max_size=4, unique=True))))
    need = Need("new", gpus, None, gpu_share=draw(st.sampled_from((0.2, 0.5, 0.9))))
    return Snapshot(nodes, workers), need


@settings(max_examples=300, deadline=None)
@given(shared_snapshots())
def test_shares_are_counted_in_each_nodes_gpu_size_and_never_overfill_it(case: tuple[Snapshot, Need]) -> None:
    snapshot, need = case
    decision = decide(need, snapshot)
    if isinstance(decision, MakeRoom | Place):
        place = decision.then if isinstance(decision, MakeRoom) else decision
        gone = evicted(decision) if isinstance(decision, MakeRoom) else set()
        size = next(iter((snapshot.node(place.node).gpu_bytes or {}).values()))
        for g in place.gpus:
            here = [w for w in snapshot.workers if w.node == place.node and g in w.gpus and w.id not in gone]
            assert sum(int((w.gpu_share or 0) * size) for w in here) + int((need.gpu_share or 0) * size) <= size
