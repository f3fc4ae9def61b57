"""A start or wake made for requests that have all gone is cancelled (after a short grace), and the GPU
goes to the next request; a start an admin asked for, and a download, are never cancelled."""

from __future__ import annotations

import asyncio
from dataclasses import replace

from manager.supervisor.worker_state import State
from tests.frontdoor.fake_workers import Behaviour, FakeWorkers
from tests.frontdoor.test_scheduler import FAST, eventually, make, run

QUICK = replace(FAST, cancel_grace_s=0.2)


def test_a_start_whose_requests_all_left_is_stopped_with_the_reason():
    async def body():
        workers = FakeWorkers({"a": Behaviour(start_s=30.0)})
        scheduler = make(workers, QUICK)
        waiting = asyncio.create_task(scheduler.acquire("a"))
        await eventually(lambda: workers.starts("a") == 1)
        waiting.cancel()  # its client left
        await eventually(lambda: workers.state(1) == State.STOPPED)
        assert workers.stops() == ["a"]
        kinds = [(kind, message) for kind, message, _ in workers.events.recorded]
        assert ("cancelled", "start of a cancelled: no request waits for it any more") in kinds
        assert scheduler.queue_state()["a"] == {"in_flight": 0, "queued": 0}

    run(body)


def test_a_start_is_not_cancelled_within_the_grace_and_a_request_that_comes_back_joins_it():
    async def body():
        workers = FakeWorkers({"a": Behaviour(start_s=30.0)})
        scheduler = make(workers, replace(FAST, cancel_grace_s=0.4))
        first = asyncio.create_task(scheduler.acquire("a"))
        await eventually(lambda: workers.starts("a") == 1)
        first.cancel()
        await asyncio.sleep(0.1)
        again = asyncio.create_task(scheduler.acquire("a"))  # the client reconnects at once: it joins
        await asyncio.sleep(0.6)
        assert workers.state(1) == State.STARTING and workers.stops() == []
        again.cancel()  # and leaves for good
        await eventually(lambda: workers.state(1) == State.STOPPED)
        assert workers.starts("a") == 1

    run(body)


def test_a_request_that_joins_as_the_start_is_cancelled_starts_it_again():
    async def body():
        workers = FakeWorkers({"a": Behaviour(start_s=0.5)}, stop_s=0.3)
        scheduler = make(workers, QUICK)
        first = asyncio.create_task(scheduler.acquire("a"))
        await eventually(lambda: workers.starts("a") == 1)
        first.cancel()
        await eventually(lambda: workers.state(1) == State.STOPPING)
        lease = await scheduler.acquire("a")  # not the cancelled start's 503
        assert lease.config == "a" and workers.starts("a") == 2

    run(body)


def test_a_start_an_admin_asked_for_is_never_cancelled_one_made_for_requests_is():
    async def body():
        workers = FakeWorkers({"a": Behaviour(start_s=1.0), "c": Behaviour(start_s=30.0)})
        scheduler = make(workers, QUICK)
        await workers.create_worker("a")  # POST /api/workers, the CLI, autostart
        for_a = asyncio.create_task(scheduler.acquire("a"))  # joins it
        for_c = asyncio.create_task(scheduler.acquire("c"))  # starts c (GPU 1)
        await eventually(lambda: workers.starts("c") == 1)
        for_a.cancel()
        for_c.cancel()
        await eventually(lambda: workers.stops() == ["c"])
        assert workers.state(1) == State.STARTING
        await eventually(lambda: workers.state(1) == State.READY)

    run(body)


def test_a_download_is_let_finish_when_its_requests_leave_a_start_is_not():
    async def body():
        workers = FakeWorkers({"a": Behaviour(download_s=0.6, start_s=0.05), "c": Behaviour(start_s=30.0)})
        scheduler = make(workers, QUICK, a={"wait_for_download": True})
        for_a = asyncio.create_task(scheduler.acquire("a"))
        for_c = asyncio.create_task(scheduler.acquire("c"))
        await eventually(lambda: workers.starts("a") == 1 and workers.starts("c") == 1)
        for_a.cancel()
        for_c.cancel()
        await eventually(lambda: workers.state(1) == State.READY)  # downloaded, then started
        await eventually(lambda: workers.stops() == ["c"])

    run(body)
