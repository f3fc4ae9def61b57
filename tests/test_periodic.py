"""The upkeep loops (idle unload, usage, audit retention) go on after a round that fails, and stop when told."""

from __future__ import annotations

import asyncio
import logging

from manager.periodic import Periodic


def test_a_round_that_fails_is_logged_and_the_next_one_runs(caplog):
    rounds: list[int] = []

    async def round_() -> None:
        rounds.append(len(rounds))
        if len(rounds) == 1:
            raise RuntimeError("the store is locked")

    async def run() -> None:
        periodic = Periodic("test upkeep", 0.01, round_, logging.getLogger("test.periodic"))
        periodic.start()
        periodic.start()  # a second start starts no second task
        while len(rounds) < 3:
            await asyncio.sleep(0.01)
        await periodic.stop()
        stopped_at = len(rounds)
        await asyncio.sleep(0.05)
        assert len(rounds) == stopped_at  # no round after stop

    with caplog.at_level(logging.ERROR, "test.periodic"):
        asyncio.run(asyncio.wait_for(run(), 10))
    assert "test upkeep failed" in caplog.text and "the store is locked" in caplog.text
    assert rounds[:3] == [0, 1, 2]
