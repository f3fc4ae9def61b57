"""The scheduler with several replicas of a model: requests spread over them, and their count follows the load."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import TypeVar

from manager.frontdoor.metrics import FrontDoorMetrics
from manager.frontdoor.placements import Placement
from manager.frontdoor.replica_scale import Add, Remove, Scaling
from manager.frontdoor.scheduler import Scheduler, SchedulerOptions
from manager.supervisor.worker_state import State
from tests.frontdoor.fake_workers import Behaviour, FakeWorkers

T = TypeVar("T")
FAST = SchedulerOptions(max_queue=64, retry_after_s=3, drain_timeout_s=2.0, poll_s=0.005, idle_check_s=60)
SCALING = Scaling(least=1, most=2, up_after_s=10, down_after_s=60)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def run(body: Callable[[], Awaitable[T]]) -> T:
    return asyncio.run(asyncio.wait_for(body(), timeout=20))


def make(workers: FakeWorkers, clock: Clock, scaling: Scaling | None = SCALING, **more: Placement) -> Scheduler:
    table = {"chat": Placement("chat", (0,), None, start_timeout_s=5, at_once=2, scaling=scaling), **more}
    return Scheduler(workers, lambda: table, options=FAST, metrics=FrontDoorMetrics(), clock=clock)


async def eventually(check: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not check():
        assert asyncio.get_running_loop().time() < deadline, "condition never became true"
        await asyncio.sleep(0.005)


def test_concurrent_requests_spread_evenly_over_two_ready_replicas():
    async def body():
        workers = FakeWorkers()
        one, two = workers.add_ready("chat", gpus=(0,)), workers.add_ready("chat", gpus=(1,))
        scheduler = make(workers, Clock(), scaling=None)
        leases = await asyncio.gather(*(scheduler.acquire("chat") for _ in range(10)))
        assert Counter(lease.worker_id for lease in leases) == {one: 5, two: 5}
        assert workers.starts() == 0

    run(body)


def test_a_replica_is_added_once_every_queue_has_been_full_for_up_after_s_and_removed_when_idle():
    async def body():
        clock = Clock()
        workers = FakeWorkers({"chat": Behaviour(start_s=0.02)})
        first = workers.add_ready("chat")
        scheduler = make(workers, clock)
        leases = [await scheduler.acquire("chat") for _ in range(3)]  # 3 in flight where 2 run at once
        assert await scheduler.scale_replicas() == []
        assert scheduler.replicas.saturated_since("chat", 2) is None  # a moment's burst is no queue yet
        clock.now += 5  # the moving mean is past 2 now
        assert await scheduler.scale_replicas() == []
        assert scheduler.replicas.saturated_since("chat", 2) == clock.now
        clock.now += 9
        assert await scheduler.scale_replicas() == []
        assert ("add_replica", "chat") not in workers.commands
        clock.now += 1
        taken = await scheduler.scale_replicas()
        assert len(taken) == 1 and isinstance(taken[0], Add)
        assert workers.commands.count(("add_replica", "chat")) == 1
        second = max(v.id for v in workers.views())
        assert await scheduler.scale_replicas() == []  # nothing more while the new one starts
        await eventually(lambda: workers.state(second) == State.READY)

        for lease in leases:
            lease.release()
        assert await scheduler.scale_replicas() == []  # both idle from now
        clock.now += 59
        assert await scheduler.scale_replicas() == []
        clock.now += 1
        taken = await scheduler.scale_replicas()
        assert taken == [Remove(second, "no request for 60 s")]
        assert ("remove_replica", second) in workers.commands
        clock.now += 600
        assert await scheduler.scale_replicas() == []  # the last one stays
        assert [v.id for v in workers.views()] == [first] and workers.state(first) == State.READY

    run(body)


def test_a_busy_replica_is_not_removed_however_long_the_other_is_idle():
    async def body():
        clock = Clock()
        workers = FakeWorkers()
        workers.add_ready("chat", gpus=(0,))
        workers.add_ready("chat", gpus=(1,))
        scheduler = make(workers, clock)
        await scheduler.scale_replicas()
        held = await scheduler.acquire("chat")
        clock.now += 600
        assert await scheduler.scale_replicas() == [Remove(3 - held.worker_id, "no request for 600 s")]
        assert ("remove_replica", held.worker_id) not in workers.commands

    run(body)


def test_a_model_whose_replicas_do_not_scale_is_never_scaled():
    async def body():
        clock = Clock()
        workers = FakeWorkers()
        workers.add_ready("chat")
        scheduler = make(workers, clock, scaling=None)
        leases = [await scheduler.acquire("chat") for _ in range(6)]
        clock.now += 3600
        assert await scheduler.scale_replicas() == []
        for lease in leases:
            lease.release()
        workers.add_ready("chat", gpus=(1,))
        await scheduler.scale_replicas()
        clock.now += 3600
        assert await scheduler.scale_replicas() == []
        assert not [c for c in workers.commands if c[0] in ("add_replica", "remove_replica")]

    run(body)


def test_a_request_that_waited_out_a_swap_leaves_no_request_counted_on_its_replica():
    async def body():
        workers = FakeWorkers()
        first = workers.add_ready("chat")
        other = Placement("other", (0,), None, start_timeout_s=5)  # the same GPU: one of the two runs
        scheduler = make(workers, Clock(), scaling=None, other=other)
        busy = await scheduler.acquire("chat")
        wants_other = asyncio.create_task(scheduler.acquire("other"))
        await asyncio.sleep(0.05)
        wants_chat = asyncio.create_task(scheduler.acquire("chat"))  # waits: chat is draining for other
        await asyncio.sleep(0.05)
        busy.release()
        (await wants_other).release()
        (await wants_chat).release()
        assert workers.state(first) == State.READY
        assert scheduler.replicas.in_flight("chat", first) == 0
        # So with a second replica, two requests at once go one to each, rather than both to the new one.
        second = workers.add_ready("chat", gpus=(1,))
        both = [await scheduler.acquire("chat"), await scheduler.acquire("chat")]
        assert {lease.worker_id for lease in both} == {first, second}

    run(body)
