"""The scheduler's queue against a stand-in supervisor: max_concurrent, priorities, turns between keys,
the caps on waiting requests, the queue timeout, and requests that give up."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from manager.frontdoor.errors import QueueFull, QueueTimeout
from manager.frontdoor.metrics import FrontDoorMetrics
from manager.frontdoor.scheduler import Lease, Scheduler, SchedulerOptions
from manager.schemas.usage import NO_KEY
from tests.frontdoor.fake_workers import Behaviour, FakeWorkers
from tests.frontdoor.test_scheduler import FAST, eventually, placements, run

A, B = 1, 2  # two inference keys


def make(workers: FakeWorkers, limit: int | None = 1, options: SchedulerOptions = FAST) -> Scheduler:
    table = placements()
    return Scheduler(
        workers, lambda: table, options=options, metrics=FrontDoorMetrics(), max_concurrent=lambda config: limit
    )


async def queue(scheduler: Scheduler, *asks: tuple[int, str]) -> list[asyncio.Task[Lease]]:
    """Requests for "a", one per (key, priority), joining the queue in this order."""
    tasks = []
    for key, priority in asks:
        tasks.append(asyncio.create_task(scheduler.acquire("a", key=key, priority=priority)))
        await asyncio.sleep(0)  # it takes its place before the next one asks
    await asyncio.sleep(0.02)
    return tasks


async def let_through(tasks: list[asyncio.Task[Lease]]) -> list[int]:
    """With one place free at a time: the order (by index) in which the queued requests get it, each
    ending its request before the next may go."""
    order: list[int] = []
    pending = set(tasks)
    while pending:
        done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        assert len(done) == 1, "more requests went than max_concurrent allows"
        task = done.pop()
        order.append(tasks.index(task))
        task.result().release()
    return order


def test_max_concurrent_holds_a_request_until_one_in_flight_ends():
    async def body():
        workers = FakeWorkers()
        workers.add_ready("a")
        scheduler = make(workers, limit=1)
        first = await scheduler.acquire("a")
        second = asyncio.create_task(scheduler.acquire("a"))
        await asyncio.sleep(0.05)
        assert not second.done()
        assert scheduler.queue_state()["a"] == {"in_flight": 1, "queued": 1}
        first.release()
        lease = await asyncio.wait_for(second, 1)
        assert lease.queued and scheduler.queue_state()["a"] == {"in_flight": 1, "queued": 0}

    run(body)


def test_max_concurrent_counts_the_requests_of_every_replica():
    async def body():
        workers = FakeWorkers()
        workers.add_ready("a", gpus=(0,))
        workers.add_ready("a", gpus=(1,))
        scheduler = make(workers, limit=2)
        first, second = await scheduler.acquire("a"), await scheduler.acquire("a")
        assert {first.worker_id, second.worker_id} == {1, 2}  # one on each replica
        third = asyncio.create_task(scheduler.acquire("a"))
        await asyncio.sleep(0.05)
        assert not third.done()  # each replica could take more, but the model has its two
        second.release()
        assert (await asyncio.wait_for(third, 1)).worker_id == second.worker_id

    run(body)


def test_without_max_concurrent_nothing_waits_at_a_ready_model():
    async def body():
        workers = FakeWorkers()
        workers.add_ready("a")
        scheduler = make(workers, limit=None)
        leases = [await scheduler.acquire("a") for _ in range(100)]
        assert not any(lease.queued for lease in leases)

    run(body)


def test_interactive_requests_go_before_batch_ones():
    async def body():
        workers = FakeWorkers()
        workers.add_ready("a")
        scheduler = make(workers, limit=1)
        held = await scheduler.acquire("a")
        tasks = await queue(scheduler, (A, "batch"), (A, "batch"), (B, "interactive"))
        held.release()
        assert await let_through(tasks) == [2, 0, 1]

    run(body)


def test_keys_take_turns_so_a_small_key_is_not_stuck_behind_a_big_one():
    async def body():
        workers = FakeWorkers()
        workers.add_ready("a")
        scheduler = make(workers, limit=1)
        held = await scheduler.acquire("a", key=A)
        tasks = await queue(scheduler, *[(A, "interactive")] * 10, *[(B, "interactive")] * 2)
        held.release()
        order = await let_through(tasks)
        assert {10, 11} <= set(order[:4]), order  # B's two among the first four, not after A's ten
        assert [i for i in order if i < 10] == list(range(10))  # A's in the order they came

    run(body)


def test_requests_that_join_a_start_go_in_turns_once_it_is_ready():
    async def body():
        workers = FakeWorkers({"a": Behaviour(start_s=0.1)})
        scheduler = make(workers, limit=1)
        tasks = await queue(scheduler, (A, "interactive"), (A, "interactive"), (A, "interactive"), (B, "interactive"))
        assert workers.starts("a") == 1
        assert await let_through(tasks) == [0, 3, 1, 2]

    run(body)


def test_a_key_with_too_many_requests_waiting_gets_429_and_the_others_still_queue():
    async def body():
        workers = FakeWorkers()
        workers.add_ready("a")
        scheduler = make(workers, limit=1, options=replace(FAST, max_queue_per_key=2, retry_after_s=4))
        held = await scheduler.acquire("a", key=A)
        tasks = await queue(scheduler, (A, "interactive"), (A, "interactive"))
        with pytest.raises(QueueFull) as err:
            await scheduler.acquire("a", key=A)
        assert err.value.status == 429 and err.value.headers == {"Retry-After": "4"}
        assert err.value.body()["error"]["type"] == "rate_limit_error"
        assert "this key already has 2 requests waiting for 'a' (the limit per key is 2)" in err.value.message
        # Another key, and requests without a key (the per-model limit is theirs), still get in line.
        tasks += await queue(scheduler, (B, "interactive"), (NO_KEY, "interactive"), (NO_KEY, "interactive"))
        assert scheduler.queue_state()["a"]["queued"] == 5
        held.release()
        assert sorted(await let_through(tasks)) == [0, 1, 2, 3, 4]

    run(body)


def test_a_request_that_waits_past_the_queue_timeout_gets_504_and_leaves_the_queue():
    async def body():
        workers = FakeWorkers()
        workers.add_ready("a")
        scheduler = make(workers, limit=1, options=replace(FAST, queue_timeout_s=0.1))
        held = await scheduler.acquire("a")
        with pytest.raises(QueueTimeout) as err:
            await scheduler.acquire("a", key=A)
        assert err.value.status == 504 and err.value.body()["error"]["code"] == "queue_timeout"
        assert "'a' did not take this request within 0.1 s" in err.value.message
        assert "1 requests in flight (max_concurrent 1)" in err.value.message
        assert scheduler.queue_state()["a"] == {"in_flight": 1, "queued": 0}
        held.release()
        (await scheduler.acquire("a", key=A)).release()  # its key's place is free again
        assert scheduler.queue_state()["a"] == {"in_flight": 0, "queued": 0}

    run(body)


def test_a_request_whose_client_left_while_it_waited_leaves_no_trace():
    async def body():
        workers = FakeWorkers({"a": Behaviour(start_s=0.2)})
        scheduler = make(workers, limit=1)
        # One gives up while the model starts, one while it waits for a place.
        starting = asyncio.create_task(scheduler.acquire("a", key=A))
        await asyncio.sleep(0.05)
        assert scheduler.slots.of("a").joined
        starting.cancel()
        await asyncio.sleep(0)
        assert scheduler.queue_state()["a"] == {"in_flight": 0, "queued": 0}
        assert not scheduler.slots.of("a").joined  # no longer counted as in flight for the start
        held = await scheduler.acquire("a", key=A)
        waiting = asyncio.create_task(scheduler.acquire("a", key=B))
        await eventually(lambda: scheduler.queue_state()["a"]["queued"] == 1)
        waiting.cancel()
        await eventually(lambda: waiting.done())
        assert scheduler.queue_state()["a"] == {"in_flight": 1, "queued": 0}
        held.release()
        assert scheduler.queue_state()["a"] == {"in_flight": 0, "queued": 0}
        assert len(scheduler.slots.of("a").waiting) == 0 and not scheduler.slots.of("a").joined

    run(body)
