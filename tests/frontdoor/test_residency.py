"""Two busy models on one GPU: with a residency they take turns in batches, without it they swap on
every request; what waits for a residency is told in an event."""

from __future__ import annotations

import asyncio

from manager.frontdoor.scheduler import Scheduler
from tests.frontdoor.fake_workers import Behaviour, FakeWorkers
from tests.frontdoor.test_scheduler import FAST, eventually, make, run

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
