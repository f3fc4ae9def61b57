"""A node that stops answering: commands say so (503) instead of guessing whether its engine lives."""

from __future__ import annotations

import asyncio

import pytest

from manager.cluster.ray_cluster import NodeUnreachable
from manager.db import session
from manager.errors import Unavailable
from manager.schemas.model_config import ModelConfig
from manager.schemas.worker import Worker
from manager.supervisor.worker_state import State
from tests.cluster.test_placement import Nodes, _supervisor


class SilentHost:
    """box2 after its network went away: it answered once (at the manager's start), then never."""

    node = "box2"
    address = "10.0.0.2"

    def __init__(self) -> None:
        self.calls = 0

    def alive(self, pid, create_time, cmdline) -> bool:
        self.calls += 1
        if self.calls == 1:
            return True
        raise NodeUnreachable("node box2 did not answer (GetTimeoutError)")


def test_a_stop_on_a_node_that_does_not_answer_is_a_503_and_the_worker_keeps_its_engine(tmp_path):
    nodes = Nodes({"box2": None})
    silent = SilentHost()
    nodes.host = lambda name: silent if name == "box2" else nodes.local
    nodes.is_alive = lambda name: True
    sup = _supervisor(tmp_path, nodes, head_refusal=None)
    with session(sup.engine) as db:
        db.add(ModelConfig(name="m", model="/m"))
        db.add(
            Worker(
                model_name="m", port=8100, node="box2", state="ready", pid=4242, pid_create_time=1.0, cmdline=["vllm"]
            )
        )
        db.commit()

    async def scenario() -> None:
        await sup.start_up()
        view = sup.view(1)
        assert view.state == State.STARTING and view.node == "box2" and view.address == "10.0.0.2"  # re-adopted
        with pytest.raises(Unavailable) as refused:
            await sup.command(1, "stop")
        assert "node box2 does not answer" in refused.value.message and refused.value.status == 503
        after = sup.view(1)
        assert after.state == State.STARTING and after.pid == 4242  # nothing guessed, nothing lost
        await sup.shut_down()

    asyncio.run(scenario())
