"""The fan-out the SSE streams use: many subscribers, one publication each, slow ones skip ahead."""

from __future__ import annotations

import asyncio

from manager.metrics.broadcast import Broadcast


def test_fifty_subscribers_each_get_every_value_once():
    async def run():
        hub: Broadcast[int] = Broadcast()
        got: list[list[int]] = [[] for _ in range(50)]

        async def reader(i: int) -> None:
            async for value in hub.subscribe():
                got[i].append(value)

        tasks = [asyncio.create_task(reader(i)) for i in range(50)]
        await asyncio.sleep(0)
        assert hub.subscribers == 50
        for v in range(1, 6):
            hub.publish(v)
            await asyncio.sleep(0.01)
        hub.close()
        await asyncio.wait_for(asyncio.gather(*tasks), 2)
        return got, hub.subscribers

    got, left = asyncio.run(run())
    assert all(g == [1, 2, 3, 4, 5] for g in got)
    assert left == 0  # closing ended every stream


def test_a_late_subscriber_starts_with_the_latest_value():
    async def run():
        hub: Broadcast[str] = Broadcast()
        hub.publish("old")
        hub.publish("current")
        stream = hub.subscribe()
        first = await stream.__anext__()
        hub.publish("next")
        second = await stream.__anext__()
        await stream.aclose()
        return first, second

    assert asyncio.run(run()) == ("current", "next")


def test_a_slow_subscriber_gets_the_newest_value_not_a_backlog():
    async def run():
        hub: Broadcast[int] = Broadcast()
        seq, _ = 0, None
        for v in range(100):
            hub.publish(v)  # nobody read in between
        return await hub.next_after(seq)

    assert asyncio.run(run()) == (100, 99)


def test_waiting_with_a_timeout_returns_none_when_nothing_comes():
    async def run():
        hub: Broadcast[int] = Broadcast()
        return await hub.next_after(0, timeout=0.05)

    assert asyncio.run(run()) is None
