"""Where one more replica of a running model goes: free room only, never by stopping a worker."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from manager.placement import CannotFit, Need, Node, Place, RunningWorker, Snapshot, place_replica

G = 1 << 30
TWO = {0: 80 * G, 1: 80 * G}


def sibling(wid: int, gpus=(0,), share: float = 0.5, node: str | None = None) -> RunningWorker:
    return RunningWorker(wid, "chat", tuple(gpus), None, None, node=node, gpu_share=share)


def test_a_gpu_with_a_sibling_replica_takes_another_only_into_its_free_room():
    snapshot = Snapshot((Node(None, {0: 80 * G}),), (sibling(1, share=0.5),))
    assert place_replica(Need("chat", (0,), None, gpu_share=0.4), snapshot, pinned=True) == Place(None, (0,))
    refused = place_replica(Need("chat", (0,), None, gpu_share=0.6), snapshot, pinned=True)
    assert isinstance(refused, CannotFit)
    assert "GPU 0 has 40.0 GiB free of the 48.0 GiB it takes" in refused.reason
    assert refused.blockers == ()  # nobody is named to stop


def test_an_unpinned_replica_goes_to_the_gpu_with_more_free_bytes():
    snapshot = Snapshot((Node(None, TWO),), (sibling(1, gpus=(0,), share=0.5),))
    assert place_replica(Need("chat", (0,), None, gpu_share=0.6), snapshot) == Place(None, (1,))
    assert place_replica(Need("chat", (0,), None, gpu_share=0.4), snapshot) == Place(None, (1,))


def test_a_pinned_replica_stays_on_its_gpus_and_is_refused_naming_the_gpu():
    snapshot = Snapshot((Node(None, TWO),), (sibling(1, gpus=(0,), share=0.5),))
    assert place_replica(Need("chat", (0,), None, gpu_share=0.4), snapshot, pinned=True) == Place(None, (0,))
    refused = place_replica(Need("chat", (0,), None, gpu_share=0.6), snapshot, pinned=True)
    assert isinstance(refused, CannotFit) and "GPU 0 " in refused.reason and "GPU 1" not in refused.reason


def test_on_gpus_of_different_sizes_a_share_is_placed_where_it_fits_once_there():
    # 90% of the 80 GiB GPU is 72 GiB, more than the 39 GiB free there; 90% of the 24 GiB one fits.
    other = RunningWorker(2, "other", (1,), 41 * G, None)
    snapshot = Snapshot((Node(None, {0: 24 * G, 1: 80 * G}),), (other,))
    assert place_replica(Need("chat", (0,), None, gpu_share=0.9), snapshot) == Place(None, (0,))
    refused = place_replica(Need("chat", (1,), None, gpu_share=0.9), snapshot, pinned=True)
    assert isinstance(refused, CannotFit) and "GPU 1 has 39.0 GiB free of the 72.0 GiB it takes" in refused.reason


def test_a_replica_needs_room_beside_other_models_too():
    other = RunningWorker(2, "other", (1,), 70 * G, None)
    snapshot = Snapshot((Node(None, TWO),), (sibling(1, gpus=(0,), share=0.5), other))
    assert place_replica(Need("chat", (0,), None, gpu_share=0.4), snapshot) == Place(None, (0,))
    refused = place_replica(Need("chat", (0,), None, gpu_share=0.6), snapshot)
    assert isinstance(refused, CannotFit) and "without stopping a worker" in refused.reason


def test_each_node_counts_only_its_own_workers_though_their_gpu_ids_match():
    nodes = (Node("a", {0: 80 * G}), Node("b", {0: 80 * G}))
    snapshot = Snapshot(nodes, (sibling(1, share=0.5, node="a"), sibling(2, share=0.2, node="b")))
    need = Need("chat", (0,), None, gpu_share=0.6)
    assert place_replica(need, snapshot, pinned=True) == Place("b", (0,))
    assert place_replica(Need("chat", (0,), None, ("a",), 0.4), snapshot, pinned=True) == Place("a", (0,))
    refused = place_replica(Need("chat", (0,), None, ("a",), 0.6), snapshot, pinned=True)
    assert isinstance(refused, CannotFit) and refused.per_node[0][0] == "a"


def test_a_node_whose_gpu_sizes_are_not_known_places_as_asked():
    snapshot = Snapshot((Node(None, None),), (sibling(1, share=0.9), sibling(2, share=0.9)))
    assert place_replica(Need("chat", (0,), None, gpu_share=0.9), snapshot, pinned=True) == Place(None, (0,))


NODES = ("a", "b")
GPUS = (0, 1, 2, 3)


@st.composite
def cases(draw: st.DrawFn) -> tuple[Need, Snapshot, bool]:
    names = draw(st.lists(st.sampled_from(NODES), min_size=1, max_size=2, unique=True))
    nodes = tuple(Node(name, {g: draw(st.integers(16, 80)) * G for g in GPUS}) for name in names)
    workers = []
    for wid in range(1, draw(st.integers(0, 8)) + 1):
        share = draw(st.none() | st.floats(0.05, 0.95))
        workers.append(
            RunningWorker(
                id=wid,
                config=draw(st.sampled_from(("chat", "other"))),
                gpus=tuple(sorted(draw(st.lists(st.sampled_from(GPUS), min_size=1, max_size=2, unique=True)))),
                gpu_bytes=None if share is not None else draw(st.integers(1, 40)) * G,
                last_request_at=None,
                in_flight=draw(st.integers(0, 3)),
                node=draw(st.sampled_from(names)),
                gpu_share=share,
            )
        )
    gpus = tuple(sorted(draw(st.lists(st.sampled_from(GPUS), min_size=1, max_size=2, unique=True))))
    share = draw(st.none() | st.floats(0.05, 0.95))
    gpu_bytes = None if share is not None else draw(st.integers(1, 60)) * G
    need = Need("chat", gpus, gpu_bytes, draw(st.none() | st.just((names[-1],))), share)
    return need, Snapshot(nodes, tuple(workers)), draw(st.booleans())


def takes(gpu_bytes: int | None, share: float | None, gpus: tuple[int, ...], capacity: dict[int, int]) -> int:
    """What a worker holds on each of its GPUs: its bytes, or its share of the smallest of them."""
    if gpu_bytes is not None:
        return gpu_bytes
    assert share is not None
    return int(share * min(capacity[g] for g in gpus))


@settings(max_examples=400, deadline=None)
@given(cases())
def test_a_replica_is_never_put_where_it_overfills_a_gpu_and_never_stops_a_worker(case) -> None:
    need, snapshot, pinned = case
    decision = place_replica(need, snapshot, pinned)
    assert isinstance(decision, Place | CannotFit)
    if isinstance(decision, CannotFit):
        assert decision.blockers == ()
        return
    capacity = dict(snapshot.node(decision.node).gpu_bytes or {})
    if pinned:
        assert decision.gpus == need.gpus
    new = takes(need.gpu_bytes, need.gpu_share, decision.gpus, capacity)
    for g in decision.gpus:
        held = sum(
            takes(w.gpu_bytes, w.gpu_share, w.gpus, capacity)
            for w in snapshot.workers
            if w.node == decision.node and g in w.gpus
        )
        assert held + new <= capacity[g], (g, held, new, capacity[g])


def test_replicas_spread_over_nodes_the_node_with_fewer_of_them_first():
    need = Need("chat", (0,), None, None, 0.2)
    nodes = (Node("head"), Node("box2"))
    first = RunningWorker(1, "chat", (0,), None, None, node="head", gpu_share=0.2)
    assert place_replica(need, Snapshot(nodes, (first,))) == Place("box2", (0,))
    other = RunningWorker(2, "other", (0,), None, None, node="box2", gpu_share=0.2)
    assert place_replica(need, Snapshot(nodes, (first, other))) == Place("box2", (0,))  # other models don't count
    second = RunningWorker(3, "chat", (0,), None, None, node="box2", gpu_share=0.2)
    assert place_replica(need, Snapshot(nodes, (first, second))) == Place("head", (0,))
