"""The scheduler against a stand-in supervisor: one start per model, swaps, drains, refusals, idle unload."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

import pytest
from prometheus_client import generate_latest

from manager.errors import Invalid
from manager.frontdoor.errors import ModelDownloading, ModelUnavailable, QueueFull, StartTimeout
from manager.frontdoor.metrics import FrontDoorMetrics
from manager.frontdoor.placements import Placement
from manager.frontdoor.scheduler import Lease, Scheduler, SchedulerOptions
from manager.hub.fetching import Progress
from manager.launch.preflight import HostRamHeldBySleepers, Sleeper
from manager.supervisor.worker_state import State
from tests.frontdoor.fake_workers import Behaviour, FakeWorkers

T = TypeVar("T")
FAST = SchedulerOptions(max_queue=64, retry_after_s=3, drain_timeout_s=2.0, poll_s=0.005, idle_check_s=60)


def placements(**extra: dict) -> dict[str, Placement]:
    """a and b share GPU 0 (only one may run); c has GPU 1 to itself."""
    table = {
        "a": Placement("a", (0,), None, start_timeout_s=5),
        "b": Placement("b", (0,), None, start_timeout_s=5),
        "c": Placement("c", (1,), None, start_timeout_s=5),
    }
    for name, changes in extra.items():
        table[name] = Placement(**{**table[name].__dict__, **changes})
    return table


def run(body: Callable[[], Awaitable[T]]) -> T:
    return asyncio.run(asyncio.wait_for(body(), timeout=20))


def make(workers: FakeWorkers, options: SchedulerOptions = FAST, clock=None, **extra: dict) -> Scheduler:
    table = placements(**extra)
    kwargs = {"clock": clock} if clock else {}
    return Scheduler(workers, lambda: table, options=options, metrics=FrontDoorMetrics(), **kwargs)


async def eventually(check: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not check():
        assert asyncio.get_running_loop().time() < deadline, "condition never became true"
        await asyncio.sleep(0.005)


def test_a_ready_worker_is_used_at_once():
    async def body():
        workers = FakeWorkers()
        wid = workers.add_ready("a")
        scheduler = make(workers)
        lease = await scheduler.acquire("a")
        assert (lease.worker_id, lease.port, lease.served_name) == (wid, 18000 + wid, "a")
        assert scheduler.queue_state()["a"] == {"in_flight": 1, "queued": 0}
        lease.release()
        lease.release()  # twice is once
        assert scheduler.queue_state()["a"] == {"in_flight": 0, "queued": 0}
        assert workers.starts() == 0

    run(body)


def test_five_requests_for_a_stopped_model_make_one_start():
    async def body():
        workers = FakeWorkers({"a": Behaviour(start_s=0.2)})
        scheduler = make(workers)
        leases = await asyncio.gather(*(scheduler.acquire("a") for _ in range(5)))
        assert workers.starts("a") == 1
        assert {lease.worker_id for lease in leases} == {1}
        assert scheduler.queue_state()["a"] == {"in_flight": 5, "queued": 0}
        assert all(lease.waited_s >= 0.2 for lease in leases)

    run(body)


def test_a_stopped_worker_of_the_model_is_started_again_rather_than_a_new_one():
    async def body():
        workers = FakeWorkers()
        scheduler = make(workers)
        (await scheduler.acquire("a")).release()
        await workers.command(1, "stop")
        lease = await scheduler.acquire("a")
        assert lease.worker_id == 1 and workers.commands.count(("create", "a")) == 1
        assert workers.commands[-1] == ("start", 1)

    run(body)


def test_a_model_on_a_taken_gpu_swaps_the_other_out():
    async def body():
        workers = FakeWorkers()
        a = workers.add_ready("a")
        c = workers.add_ready("c", gpus=(1,))
        scheduler = make(workers)
        lease = await scheduler.acquire("b")
        assert workers.state(a) == State.STOPPED and workers.state(c) == State.READY
        assert workers.views()[lease.worker_id - 1].model == "b"
        assert ("evicted", "stopped a to make room for b", a) in workers.events.recorded
        swapped = [m for k, m, w in workers.events.recorded if k == "swapped_in" and w == lease.worker_id]
        assert len(swapped) == 1 and swapped[0].startswith("started b in ")

    run(body)


def test_requests_during_a_swap_join_it():
    async def body():
        workers = FakeWorkers({"b": Behaviour(start_s=0.2)})
        workers.add_ready("a")
        scheduler = make(workers)
        leases = await asyncio.gather(*(scheduler.acquire("b") for _ in range(5)))
        assert workers.starts("b") == 1 and workers.stops() == ["a"]
        assert len({lease.worker_id for lease in leases}) == 1

    run(body)


def test_a_busy_model_finishes_its_requests_before_it_is_swapped_out():
    async def body():
        workers = FakeWorkers()
        a = workers.add_ready("a")
        scheduler = make(workers)
        busy = await scheduler.acquire("a")
        wants_b = asyncio.create_task(scheduler.acquire("b"))
        await asyncio.sleep(0.1)
        assert not wants_b.done() and workers.state(a) == State.READY
        # Meanwhile a new request for a waits too: otherwise a busy model would never drain.
        wants_a = asyncio.create_task(scheduler.acquire("a"))
        await asyncio.sleep(0.05)
        assert not wants_a.done()
        busy.release()
        b_lease = await wants_b
        assert workers.state(a) == State.STOPPED and b_lease.config == "b"
        # a's request gets its turn once b has answered: b is swapped out again.
        await asyncio.sleep(0.05)
        assert not wants_a.done()
        b_lease.release()
        a_lease = await wants_a
        assert a_lease.config == "a" and workers.stops() == ["a", "b"]

    run(body)


def test_a_model_that_does_not_drain_in_time_gets_a_503_naming_it():
    async def body():
        workers = FakeWorkers()
        a = workers.add_ready("a")
        scheduler = make(workers, SchedulerOptions(drain_timeout_s=0.2, poll_s=0.005))
        busy = await scheduler.acquire("a")
        with pytest.raises(ModelUnavailable) as err:
            await scheduler.acquire("b")
        assert err.value.status == 503
        assert "a (1 in flight)" in err.value.message and "0.2 s" in err.value.message
        assert workers.state(a) == State.READY
        # a serves new requests again right away.
        (await scheduler.acquire("a")).release()
        busy.release()

    run(body)


def test_a_persistent_model_is_never_swapped_out():
    async def body():
        workers = FakeWorkers()
        a = workers.add_ready("a")
        scheduler = make(workers, a={"persistent": True})
        with pytest.raises(ModelUnavailable) as err:
            await scheduler.acquire("b")
        assert "persistent" in err.value.message and "a (worker 1)" in err.value.message
        assert workers.state(a) == State.READY and workers.starts() == 0

    run(body)


def test_a_failed_start_answers_every_waiter_with_vllms_reason_and_the_next_request_tries_again():
    async def body():
        reason = "exited with code 1 before it was ready: ValueError: max_model_len 100000 is too large"
        workers = FakeWorkers({"a": Behaviour(start_s=0.05, error=reason)})
        scheduler = make(workers)
        results = await asyncio.gather(*(scheduler.acquire("a") for _ in range(3)), return_exceptions=True)
        assert all(isinstance(r, ModelUnavailable) and reason in r.message for r in results)
        assert workers.starts("a") == 1
        workers.behaviours["a"] = Behaviour()
        (await scheduler.acquire("a")).release()
        assert workers.starts("a") == 2

    run(body)


def test_the_planners_refusal_is_a_503_with_its_message():
    async def body():
        workers = FakeWorkers({"a": Behaviour(refused="does not fit: needs 90 GiB, the GPU has 80 GiB")})
        with pytest.raises(ModelUnavailable, match="a could not be started: does not fit: needs 90 GiB"):
            await make(workers).acquire("a")

    run(body)


def test_a_start_slower_than_its_timeout_is_a_504():
    async def body():
        workers = FakeWorkers({"a": Behaviour(never_ready=True)})
        scheduler = make(workers, a={"start_timeout_s": 0.2})
        with pytest.raises(StartTimeout) as err:
            await scheduler.acquire("a")
        assert err.value.status == 504 and "start_timeout_s (0.2 s)" in err.value.message

    run(body)


def test_a_full_queue_is_a_429_with_retry_after():
    async def body():
        workers = FakeWorkers({"a": Behaviour(start_s=0.2)})
        scheduler = make(workers, SchedulerOptions(max_queue=2, retry_after_s=7, poll_s=0.005))
        waiting = [asyncio.create_task(scheduler.acquire("a")) for _ in range(2)]
        await asyncio.sleep(0.02)
        with pytest.raises(QueueFull) as err:
            await scheduler.acquire("a")
        assert err.value.status == 429 and err.value.headers == {"Retry-After": "7"}
        assert "2 requests are already waiting for 'a'" in err.value.message
        await asyncio.gather(*waiting)
        # Once ready, requests are no longer queued by the manager (vLLM queues them itself).
        more = await asyncio.gather(*(scheduler.acquire("a") for _ in range(5)))
        assert len(more) == 5

    run(body)


def test_a_waiter_that_gives_up_does_not_cancel_the_start_for_the_others():
    async def body():
        workers = FakeWorkers({"a": Behaviour(start_s=0.2)})
        scheduler = make(workers)
        leaving = asyncio.create_task(scheduler.acquire("a"))
        staying = asyncio.create_task(scheduler.acquire("a"))
        await asyncio.sleep(0.05)
        leaving.cancel()
        lease = await staying
        assert lease.config == "a" and workers.starts("a") == 1
        assert scheduler.queue_state()["a"] == {"in_flight": 1, "queued": 0}

    run(body)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_an_idle_model_is_stopped_after_its_timeout_and_never_while_busy():
    async def body():
        clock = Clock()
        workers = FakeWorkers()
        a = workers.add_ready("a")
        c = workers.add_ready("c", gpus=(1,))  # no idle timeout: stays
        scheduler = make(workers, clock=clock, a={"idle_timeout_s": 600})
        assert await scheduler.unload_idle() == []  # first seen ready now
        lease = await scheduler.acquire("a")
        clock.now += 700
        assert await scheduler.unload_idle() == []  # a request is in flight
        lease.release()  # idle time counts from the last response
        clock.now += 599
        assert await scheduler.unload_idle() == []
        clock.now += 2
        assert await scheduler.unload_idle() == ["a"]
        assert workers.state(a) == State.STOPPED and workers.state(c) == State.READY
        assert ("idle_stopped", "stopped a: idle 601 s", a) in workers.events.recorded
        # The next request starts it again.
        lease = await scheduler.acquire("a")
        assert lease.worker_id == a and workers.state(a) == State.READY

    run(body)


def test_idle_time_of_a_worker_started_elsewhere_counts_from_when_it_was_seen_ready():
    async def body():
        clock = Clock()
        workers = FakeWorkers()
        a = workers.add_ready("a")
        scheduler = make(workers, clock=clock, a={"idle_timeout_s": 10})
        await scheduler.unload_idle()
        clock.now += 9
        assert await scheduler.unload_idle() == []
        clock.now += 2
        assert await scheduler.unload_idle() == ["a"] and workers.state(a) == State.STOPPED

    run(body)


def test_the_idle_loop_runs_in_the_background():
    async def body():
        workers = FakeWorkers()
        a = workers.add_ready("a")
        options = SchedulerOptions(idle_check_s=0.01, poll_s=0.005)
        scheduler = make(workers, options, a={"idle_timeout_s": 0.05})
        scheduler.start()
        try:
            await eventually(lambda: workers.state(a) == State.STOPPED)
        finally:
            await scheduler.stop()

    run(body)


def test_metrics_count_in_flight_and_cold_starts():
    async def body():
        workers = FakeWorkers()
        scheduler = make(workers)
        lease: Lease = await scheduler.acquire("a")
        assert scheduler.metrics is not None
        text = generate_latest(scheduler.metrics.registry).decode()
        assert 'vllm_manager_proxy_in_flight{model="a"} 1.0' in text
        assert 'vllm_manager_proxy_swap_seconds_count{kind="cold"} 1.0' in text
        assert "vllm_manager_proxy_queue_wait_seconds_count 1.0" in text
        lease.release()
        assert 'vllm_manager_proxy_in_flight{model="a"} 0.0' in generate_latest(scheduler.metrics.registry).decode()

    run(body)


def test_a_request_during_a_stop_asked_elsewhere_starts_the_model_again_once_stopped():
    async def body():
        workers = FakeWorkers(stop_s=0.2)
        a = workers.add_ready("a")
        scheduler = make(workers)
        stopping = asyncio.create_task(workers.command(a, "stop"))  # as the API would
        await asyncio.sleep(0.01)
        lease = await scheduler.acquire("a")
        await stopping
        assert lease.worker_id == a and workers.state(a) == State.READY
        assert workers.commands == [("stop", a), ("start", a)]

    run(body)


def test_a_start_the_worker_itself_gave_up_on_at_its_timeout_is_still_a_504():
    async def body():
        reason = "not ready within the start timeout; last log line: loading weights"
        workers = FakeWorkers({"a": Behaviour(start_s=0.25, error=reason)})
        scheduler = make(workers, SchedulerOptions(poll_s=0.3), a={"start_timeout_s": 0.2})
        with pytest.raises(StartTimeout) as err:
            await scheduler.acquire("a")
        assert "loading weights" in err.value.message

    run(body)


# ---- sleep mode -----------------------------------------------------------------------------------

G = 1 << 30


def with_sleep(workers: FakeWorkers, host_gib: float | None = 64, **extra: dict) -> Scheduler:
    table = placements(**extra)
    host = None if host_gib is None else int(host_gib * G)
    return Scheduler(workers, lambda: table, options=FAST, metrics=FrontDoorMetrics(), host_available=lambda node: host)


def test_a_model_with_sleep_mode_is_put_to_sleep_to_make_room_and_woken_for_its_next_request():
    async def body():
        workers = FakeWorkers()
        a = workers.add_ready("a")
        scheduler = with_sleep(workers, a={"sleep_level": 1, "sleep_host_bytes": 16 * G})
        (await scheduler.acquire("b")).release()
        assert workers.state(a) == State.SLEEPING and workers.sleep_levels == [1]
        assert ("evicted", "put a to sleep to make room for b", a) in workers.events.recorded
        lease = await scheduler.acquire("a")
        # Woken, not started: the same engine, and b (no sleep mode) stopped for it.
        assert lease.worker_id == a and workers.state(a) == State.READY
        assert ("wake", a) in workers.commands and workers.starts("a") == 0
        assert workers.stops() == ["b"]
        assert scheduler.metrics is not None
        text = generate_latest(scheduler.metrics.registry).decode()
        assert 'vllm_manager_proxy_swap_seconds_count{kind="wake"} 1.0' in text

    run(body)


def test_level_one_sleep_needs_host_ram_for_the_weights_else_the_model_is_stopped():
    async def body():
        workers = FakeWorkers()
        a = workers.add_ready("a")
        scheduler = with_sleep(workers, host_gib=8, a={"sleep_level": 1, "sleep_host_bytes": 16 * G})
        (await scheduler.acquire("b")).release()
        assert workers.state(a) == State.STOPPED and workers.sleep_levels == []
        # Unknown weights (or unknown RAM) are no room either.
        workers2 = FakeWorkers()
        a2 = workers2.add_ready("a")
        (await with_sleep(workers2, a={"sleep_level": 1}).acquire("b")).release()
        assert workers2.state(a2) == State.STOPPED

    run(body)


def test_level_two_sleep_keeps_nothing_in_host_ram():
    async def body():
        workers = FakeWorkers()
        a = workers.add_ready("a")
        (await with_sleep(workers, host_gib=None, a={"sleep_level": 2}).acquire("b")).release()
        assert workers.state(a) == State.SLEEPING and workers.sleep_levels == [2]

    run(body)


def test_a_sleep_the_engine_refuses_becomes_a_stop():
    async def body():
        workers = FakeWorkers({"a": Behaviour(sleep_error="POST /sleep answered 404")})
        a = workers.add_ready("a")
        scheduler = with_sleep(workers, a={"sleep_level": 2})
        (await scheduler.acquire("b")).release()
        assert workers.state(a) == State.STOPPED
        kinds = [(k, m) for k, m, _ in workers.events.recorded]
        assert ("evicted", "stopped a to make room for b (sleep failed: a could not be put to sleep: "
                "POST /sleep answered 404)") in kinds  # fmt: skip

    run(body)


def test_a_model_that_cannot_wake_is_a_503_and_the_next_request_starts_it_afresh():
    async def body():
        workers = FakeWorkers({"a": Behaviour(wake_error="CUDA out of memory")})
        a = workers.add_ready("a")
        scheduler = with_sleep(workers, a={"sleep_level": 2})
        (await scheduler.acquire("b")).release()
        with pytest.raises(ModelUnavailable, match="a could not be woken: a: waking failed: CUDA out of memory"):
            await scheduler.acquire("a")
        assert workers.state(a) == State.FAILED
        workers.behaviours["a"] = Behaviour()
        lease = await scheduler.acquire("a")
        assert lease.worker_id == a and workers.commands[-1] == ("start", a)

    run(body)


def test_an_idle_model_with_sleep_mode_is_put_to_sleep():
    async def body():
        clock = Clock()
        workers = FakeWorkers()
        a = workers.add_ready("a")
        scheduler = Scheduler(
            workers,
            lambda: placements(a={"sleep_level": 1, "sleep_host_bytes": G, "idle_timeout_s": 60}),
            options=FAST,
            host_available=lambda node: 4 * G,
            clock=clock,
        )
        await scheduler.unload_idle()
        clock.now += 61
        assert await scheduler.unload_idle() == ["a"]
        assert workers.state(a) == State.SLEEPING
        assert ("idle_slept", "put a to sleep: idle 61 s", a) in workers.events.recorded
        clock.now += 1000
        assert await scheduler.unload_idle() == []  # asleep is unloaded enough

    run(body)


def test_a_sleeping_model_does_not_block_another_on_its_gpu():
    async def body():
        workers = FakeWorkers()
        a = workers.add_ready("a")
        scheduler = with_sleep(workers, a={"sleep_level": 2})
        (await scheduler.acquire("b")).release()
        await workers.command(2, "stop")
        (await scheduler.acquire("b")).release()
        assert workers.state(a) == State.SLEEPING and workers.sleep_levels == [2]

    run(body)


def test_a_request_while_the_model_is_woken_elsewhere_waits_for_that_wake():
    async def body():
        workers = FakeWorkers({"a": Behaviour(wake_s=0.2)})
        a = workers.add_ready("a")
        scheduler = with_sleep(workers, a={"sleep_level": 2})
        await workers.command(a, "sleep", level=2)
        waking = asyncio.create_task(workers.command(a, "wake"))  # as the API would
        await asyncio.sleep(0.01)
        lease = await scheduler.acquire("a")
        await waking
        assert lease.worker_id == a and workers.commands.count(("wake", a)) == 1

    run(body)


def ram_for_one_sleeper(model: str, views: list) -> None:
    """A pre-start check on a host with room for one 16 GiB sleeper beside a start."""
    sleepers = tuple(Sleeper(v.id, v.model, 1, 16 * G) for v in views if v.state == State.SLEEPING)
    held = sum(s.host_bytes or 0 for s in sleepers)
    if held > 16 * G:
        raise HostRamHeldBySleepers(f"{model}: sleepers hold the RAM", short_bytes=held - 16 * G, sleepers=sleepers)


def test_a_start_short_of_host_ram_stops_the_least_recently_used_sleeper_and_goes_ahead():
    async def body():
        workers = FakeWorkers(preflight=ram_for_one_sleeper)
        a, c = workers.add_ready("a", gpus=(1,)), workers.add_ready("c", gpus=(2,))
        scheduler = make(workers)
        (await scheduler.acquire("a")).release()
        (await scheduler.acquire("c")).release()  # c answered last: a is the older sleeper
        await workers.command(a, "sleep", level=1)
        await workers.command(c, "sleep", level=1)
        lease = await scheduler.acquire("b")
        assert workers.state(lease.worker_id) == State.READY
        assert workers.state(a) == State.STOPPED and workers.state(c) == State.SLEEPING
        assert ("evicted", "stopped a (asleep) to free host RAM for b", a) in workers.events.recorded

    run(body)


def test_a_persistent_sleeper_holding_the_ram_is_a_503_that_says_so():
    async def body():
        workers = FakeWorkers(preflight=ram_for_one_sleeper)
        a, c = workers.add_ready("a", gpus=(1,)), workers.add_ready("c", gpus=(2,))
        scheduler = make(workers, a={"persistent": True}, c={"persistent": True})
        await workers.command(a, "sleep", level=1)
        await workers.command(c, "sleep", level=1)
        with pytest.raises(ModelUnavailable) as refused:
            await scheduler.acquire("b")
        assert "b needs 16.0 GiB more host RAM: stopping every sleeping model frees only 0.0 GiB" in str(refused.value)
        assert workers.state(a) == State.SLEEPING and workers.state(c) == State.SLEEPING

    run(body)


def test_the_snapshot_shows_each_models_state_requests_and_last_swap():
    async def body():
        workers = FakeWorkers({"c": Behaviour(start_s=0.3)})
        scheduler = with_sleep(workers, a={"sleep_level": 2})
        assert [(m.config, m.state, m.in_flight, m.queued, m.last_swap) for m in scheduler.snapshot()] == [
            ("a", "stopped", 0, 0, None),
            ("b", "stopped", 0, 0, None),
            ("c", "stopped", 0, 0, None),
        ]
        lease = await scheduler.acquire("a")
        starting = asyncio.create_task(scheduler.acquire("c"))
        await eventually(lambda: any(w.model == "c" for w in workers.views()))
        a, b, c = scheduler.snapshot()
        assert (a.state, a.worker_id, a.in_flight, a.queued) == ("ready", lease.worker_id, 1, 0)
        assert a.last_swap is not None and a.last_swap.kind == "cold" and a.last_swap.seconds >= 0.05
        assert a.last_swap_ago_s is not None and 0 <= a.last_swap_ago_s < 5
        assert (c.state, c.in_flight, c.queued, c.last_swap) == ("starting", 0, 1, None)
        assert (b.state, b.worker_id) == ("stopped", None)
        lease.release()
        (await starting).release()

        (await scheduler.acquire("b")).release()  # a is put to sleep for it
        (await scheduler.acquire("a")).release()  # and woken
        a, b, _ = scheduler.snapshot()
        assert a.state == "ready" and a.in_flight == 0
        assert a.last_swap is not None and a.last_swap.kind == "wake"
        assert b.state == "stopped" and b.last_swap is not None and b.last_swap.kind == "cold"

    run(body)


def test_a_pooled_worker_sleeps_on_the_ram_its_pool_already_holds_and_otherwise_needs_room():
    async def body(held_gib: float, host_gib: float) -> State:
        workers = FakeWorkers()
        a = workers.add_ready("a")
        table = placements(a={"sleep_level": 1, "sleep_host_bytes": 16 * G, "sleep_pooled": True})
        scheduler = Scheduler(
            workers,
            lambda: table,
            options=FAST,
            metrics=FrontDoorMetrics(),
            host_available=lambda node: int(host_gib * G),
            sleep_pool_held=lambda worker_id: int(held_gib * G) if worker_id == a else 0,
        )
        (await scheduler.acquire("b")).release()
        return workers.state(a)

    assert run(lambda: body(held_gib=16, host_gib=1)) == State.SLEEPING  # its pool holds the weights already
    assert run(lambda: body(held_gib=0, host_gib=1)) == State.STOPPED  # no pool taken, no room: stopped
    assert run(lambda: body(held_gib=10, host_gib=8)) == State.SLEEPING  # 6 GiB more needed, 8 free


# ---- models being downloaded ------------------------------------------------------------------------


def test_a_request_for_a_model_being_downloaded_is_a_503_with_its_progress_and_retry_after():
    async def body():
        progress = Progress("org/a", 34, 100, rate_bps=1.0)  # 66 s left
        workers = FakeWorkers({"a": Behaviour(download_s=0.3, progress=progress)})
        scheduler = make(workers)
        for _ in range(2):  # the request that began the download, and one while it runs
            with pytest.raises(ModelDownloading) as err:
                await scheduler.acquire("a")
            assert err.value.status == 503 and err.value.code == "model_downloading"
            assert err.value.message == "downloading a: 34 %, about 66 s left"
            assert err.value.headers == {"Retry-After": "60"}  # at most a minute
        assert workers.starts("a") == 1 and workers.state(1) == State.DOWNLOADING
        assert [m.state for m in scheduler.snapshot() if m.config == "a"] == ["downloading"]
        # Once it is downloaded and started, requests are served.
        await eventually(lambda: workers.state(1) == State.READY)
        lease = await scheduler.acquire("a")
        assert lease.worker_id == 1 and workers.starts("a") == 1

    run(body)


@pytest.mark.parametrize(
    ("progress", "message", "retry_after"),
    [
        (Progress("org/a", 99, 100, rate_bps=10.0), "downloading a: 99 %, about 1 s left", "1"),
        (Progress("org/a", 5, 100), "downloading a: 5 %", "10"),  # no rate yet: time left unknown
        (None, "downloading a", "10"),
    ],
)
def test_retry_after_is_the_time_the_download_has_left_or_ten_seconds_when_unknown(progress, message, retry_after):
    async def body():
        workers = FakeWorkers({"a": Behaviour(download_s=5, progress=progress)})
        with pytest.raises(ModelDownloading) as err:
            await make(workers).acquire("a")
        assert err.value.message == message and err.value.headers == {"Retry-After": retry_after}

    run(body)


def test_a_model_that_waits_for_its_download_is_served_after_it_and_its_start_timeout_counts_from_the_launch():
    async def body():
        workers = FakeWorkers({"a": Behaviour(download_s=0.4, start_s=0.1, progress=Progress("org/a", 1, 100))})
        # The download takes longer than the start timeout: only the engine's start is timed.
        scheduler = make(workers, a={"wait_for_download": True, "start_timeout_s": 0.3})
        leases = await asyncio.gather(*(scheduler.acquire("a") for _ in range(3)))
        assert {lease.worker_id for lease in leases} == {1} and workers.starts("a") == 1
        assert all(lease.waited_s >= 0.5 for lease in leases)

    run(body)


def test_a_waiting_request_gets_the_reason_when_the_download_fails():
    async def body():
        reason = "the download took longer than download_timeout_s (60 s)"
        workers = FakeWorkers({"a": Behaviour(download_s=0.05, download_error=reason)})
        scheduler = make(workers, a={"wait_for_download": True})
        with pytest.raises(ModelUnavailable, match=r"a failed to start: the download took longer than"):
            await scheduler.acquire("a")

    run(body)


def test_a_start_after_the_download_that_is_too_slow_is_still_a_504():
    async def body():
        workers = FakeWorkers({"a": Behaviour(download_s=0.05, never_ready=True)})
        scheduler = make(workers, a={"wait_for_download": True, "start_timeout_s": 0.2})
        with pytest.raises(StartTimeout):
            await scheduler.acquire("a")

    run(body)


def test_a_downloading_model_holds_no_gpu_so_another_is_started_beside_it_without_evicting_it():
    async def body():
        workers = FakeWorkers({"a": Behaviour(download_s=5)})
        scheduler = make(workers)
        with pytest.raises(ModelDownloading):
            await scheduler.acquire("a")
        lease = await scheduler.acquire("b")  # b shares GPU 0 with a
        assert workers.stops() == [] and workers.state(1) == State.DOWNLOADING
        assert workers.views()[lease.worker_id - 1].model == "b"

    run(body)


def test_a_model_that_must_be_downloaded_evicts_nobody_until_its_download_is_over():
    async def body():
        workers = FakeWorkers({"a": Behaviour(download_s=0.3)})
        b = workers.add_ready("b")  # on GPU 0, which a needs
        scheduler = make(workers)
        with pytest.raises(ModelDownloading):
            await scheduler.acquire("a")
        # b goes on serving for as long as a downloads.
        assert workers.stops() == [] and workers.state(b) == State.READY
        (await scheduler.acquire("b")).release()
        # Once it is downloaded, and before its engine starts, b makes room for it.
        a = next(v.id for v in workers.views() if v.model == "a")
        await eventually(lambda: workers.state(a) == State.READY)
        assert workers.stops() == ["b"] and workers.state(b) == State.STOPPED
        assert ("evicted", "stopped b to make room for a", b) in workers.events.recorded
        assert (await scheduler.acquire("a")).worker_id == a

    run(body)


def test_a_busy_model_finishes_its_requests_before_a_downloaded_one_takes_its_gpu():
    async def body():
        workers = FakeWorkers({"a": Behaviour(download_s=0.1)})
        b = workers.add_ready("b")
        scheduler = make(workers, a={"wait_for_download": True})
        busy = await scheduler.acquire("b")
        waiting = asyncio.create_task(scheduler.acquire("a"))
        await eventually(lambda: "a" in workers.downloaded)  # the download did not wait for b
        await asyncio.sleep(0.2)
        assert workers.state(b) == State.READY and not waiting.done()
        busy.release()
        lease = await waiting
        assert lease.config == "a" and workers.state(b) == State.STOPPED

    run(body)


def test_a_downloaded_model_whose_gpu_a_persistent_model_took_meanwhile_fails_with_the_reason():
    async def body():
        workers = FakeWorkers({"a": Behaviour(download_s=0.2)})
        scheduler = make(workers, b={"persistent": True})
        with pytest.raises(ModelDownloading):
            await scheduler.acquire("a")
        (await scheduler.acquire("b")).release()  # started beside the download: it holds no GPU
        a = next(v.id for v in workers.views() if v.model == "a")
        await eventually(lambda: workers.state(a) == State.FAILED)
        assert (workers.view(a).last_error or "").startswith("start refused: a cannot be started: ")
        assert workers.stops() == [] and workers.ready_workers("b") != []

    run(body)


def test_a_download_the_pre_start_check_refuses_while_others_run_evicts_them_first():
    def short_of_ram_beside_b(model: str, views: list) -> None:
        if model == "a" and any(v.model == "b" and v.state == State.READY for v in views):
            raise Invalid("a needs the host RAM b holds")

    async def body():
        workers = FakeWorkers({"a": Behaviour(download_s=5)}, preflight=short_of_ram_beside_b)
        b = workers.add_ready("b")
        scheduler = make(workers)
        with pytest.raises(ModelDownloading):
            await scheduler.acquire("a")
        # Refused with b there, then started (and downloading) once b made room, as a model on disk is.
        assert workers.stops() == ["b"] and workers.state(b) == State.STOPPED

    run(body)
