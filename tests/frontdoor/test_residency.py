"""Two busy models on one GPU: with a residency they take turns in batches, without it they swap on
every request; past its residency a model stays while more requests queue for it than for the other
(at most twice its residency); what waits for a residency is told in an event."""

from __future__ import annotations

import asyncio

from manager.frontdoor.metrics import FrontDoorMetrics
from manager.frontdoor.scheduler import Lease, Scheduler
from tests.frontdoor.fake_workers import Behaviour, FakeWorkers
from tests.frontdoor.test_scheduler import FAST, eventually, make, placements, run

REQUESTS = 20  # per client: about 0.2 s of answers, longer than the residency below


async def two_clients(scheduler: Scheduler) -> list[str]:
    """Two clients, one per model (a and b share GPU 0), each asking again as soon as it is answered;
    the models in the order their answers came."""
    answered: list[str] = []

    async def client(model: str) -> None:
        for _ in range(REQUESTS):
            lease = await scheduler.acquire(model)
            await asyncio.sleep(0.01)  # the engine answers
            lease.release()
            answered.append(model)

    await asyncio.gather(client("a"), client("b"))
    return answered


def swaps(min_residency_s: float) -> tuple[int, list[str]]:
    async def body() -> tuple[int, list[str]]:
        workers = FakeWorkers({"a": Behaviour(start_s=0.02), "b": Behaviour(start_s=0.02)})
        scheduler = make(workers, a={"min_residency_s": min_residency_s}, b={"min_residency_s": min_residency_s})
        answered = await two_clients(scheduler)
        return workers.starts(), answered

    return run(body)


def turns(answered: list[str]) -> int:
    return 1 + sum(1 for before, after in zip(answered, answered[1:], strict=False) if before != after)


def test_two_busy_models_on_one_gpu_take_turns_in_batches_with_a_residency():
    thrashing, without = swaps(0)
    batched, with_residency = swaps(0.15)
    assert sorted(without) == sorted(with_residency) == ["a"] * REQUESTS + ["b"] * REQUESTS  # all answered
    # Without: every request swaps its model in.
    assert thrashing >= REQUESTS
    # With: each model serves a batch of its client's requests, then the other gets a turn.
    assert batched <= thrashing // 3
    assert turns(with_residency) >= 3  # they took turns: neither waited for the other's client to finish


def test_a_swap_waits_for_the_models_residency_told_in_an_event_and_ends_when_that_model_goes_idle():
    async def body():
        workers = FakeWorkers({"a": Behaviour(start_s=0.05), "b": Behaviour(start_s=0.05)})
        # No min_residency_s: a stays its last swap-in time plus a few seconds.
        scheduler = make(workers, FAST, a={"min_residency_s": None}, b={"min_residency_s": None})
        loop = asyncio.get_running_loop()
        lease = await scheduler.acquire("a")  # a is swapped in for this request
        swapped_in = loop.time()
        b = asyncio.create_task(scheduler.acquire("b"))
        await eventually(lambda: any(kind == "swap_held" for kind, _, _ in workers.events.recorded))
        held = next(message for kind, message, _ in workers.events.recorded if kind == "swap_held")
        assert "b needs the room of a (swapped in" in held and "unless it goes idle" in held
        assert "the swap waits up to 5." in held  # 5 s and its swap-in's fraction of a second
        await asyncio.sleep(0.3)
        assert workers.starts("b") == 0 and workers.stops() == []  # a keeps serving
        second = await scheduler.acquire("a")  # ... and takes its client's next request at once
        assert second.worker_id == lease.worker_id
        lease.release()
        second.release()
        b_lease = await b  # a idle for a moment: b goes in before a's residency would have ended
        assert loop.time() - swapped_in < 5.0
        assert workers.stops() == ["a"] and workers.starts("b") == 1
        b_lease.release()

    run(body)


RESIDENCY_S = 10.0  # on a clock the tests move forward: no test sleeps through it


class QueuedResident:
    """``a`` on GPU 0, swapped in for requests, one at a time (max_concurrent 1), with ``queued`` more
    of its requests waiting for their turn; a clock that a test moves past its residency."""

    def __init__(self, queued: int) -> None:
        self.workers = FakeWorkers({"a": Behaviour(start_s=0.02), "b": Behaviour(start_s=0.02)})
        loop = asyncio.get_running_loop()
        self.skew = 0.0
        table = placements(a={"min_residency_s": RESIDENCY_S}, b={"min_residency_s": RESIDENCY_S})
        self.scheduler = Scheduler(
            self.workers,
            lambda: table,
            options=FAST,
            metrics=FrontDoorMetrics(),
            clock=lambda: loop.time() + self.skew,
            max_concurrent=lambda config: 1 if config == "a" else None,
        )
        self.queued = queued

    async def fill(self) -> tuple[Lease, list[asyncio.Task[Lease]]]:
        serving = await self.scheduler.acquire("a")  # swaps a in
        waiting = []
        for _ in range(self.queued):
            waiting.append(asyncio.create_task(self.scheduler.acquire("a")))
            await asyncio.sleep(0)  # joins the queue in this order
        await eventually(lambda: self.scheduler.queue_state()["a"]["queued"] == self.queued)
        return serving, waiting

    def b_in(self) -> bool:
        return self.workers.starts("b") > 0


async def served_next(serving: Lease, waiting: list[asyncio.Task[Lease]]) -> Lease:
    """Answer the request in flight: the first one queued goes in its place."""
    serving.release()
    nxt = waiting.pop(0)
    return await asyncio.wait_for(nxt, 2)


def test_a_model_with_a_queue_stays_past_its_residency_for_one_request_of_another_until_its_queue_is_no_longer():
    async def body():
        a = QueuedResident(queued=4)
        serving, waiting = await a.fill()
        a.skew += RESIDENCY_S + 1  # past a's residency, within twice it
        b = asyncio.create_task(a.scheduler.acquire("b"))
        await eventually(lambda: any(kind == "swap_held" for kind, _, _ in a.workers.events.recorded))
        held = next(message for kind, message, _ in a.workers.events.recorded if kind == "swap_held")
        assert "4 requests wait on a, 1 on b" in held, held
        for queue in (3, 2):  # a answers its requests in turn, more of them queued than for b
            serving = await served_next(serving, waiting)
            await asyncio.sleep(0.1)
            assert not a.b_in() and a.workers.stops() == [], queue
            assert a.scheduler.queue_state()["a"]["queued"] == queue
        serving = await served_next(serving, waiting)  # 1 queued for a, 1 for b: a goes as it would have
        await asyncio.sleep(0.1)
        assert not b.done() and a.workers.stops() == []  # ... once the request it serves is answered
        serving.release()
        (await asyncio.wait_for(b, 2)).release()
        assert a.workers.stops() == ["a"] and a.workers.starts("b") == 1
        for task in waiting:
            task.cancel()

    run(body)


def test_a_queue_keeps_the_model_no_longer_than_twice_its_residency():
    async def body():
        a = QueuedResident(queued=5)
        serving, waiting = await a.fill()
        a.skew += RESIDENCY_S + 1
        b = asyncio.create_task(a.scheduler.acquire("b"))
        await asyncio.sleep(0.2)
        assert not a.b_in() and a.scheduler.slots.of("a").leaving is None  # a stays for its queue ...
        a.skew += RESIDENCY_S  # ... until twice its residency since its swap-in, however long its queue
        await eventually(lambda: a.scheduler.slots.of("a").leaving is not None, timeout=3)  # drained
        assert a.scheduler.queue_state()["a"]["queued"] == 5
        serving.release()  # the request it serves is answered; the queued ones wait for it to come back
        (await asyncio.wait_for(b, 2)).release()
        assert a.workers.stops() == ["a"] and a.workers.starts("b") == 1
        for task in waiting:
            task.cancel()

    run(body)
