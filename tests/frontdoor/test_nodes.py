"""The scheduler in a cluster: nodes whose GPUs have the same ids are different GPUs."""

from __future__ import annotations

import asyncio

from manager.frontdoor.metrics import FrontDoorMetrics
from manager.frontdoor.placements import Placement
from manager.frontdoor.scheduler import Scheduler, SchedulerOptions
from manager.launch.preflight import HostRamHeldBySleepers, Sleeper
from manager.supervisor.worker_state import State
from tests.frontdoor.fake_workers import FakeWorkers

G = 1 << 30
FAST = SchedulerOptions(max_queue=8, retry_after_s=3, drain_timeout_s=2.0, poll_s=0.005, idle_check_s=60)
TWO_NODES = {"node-a": {0: 80 * G}, "node-b": {0: 80 * G}}


def scheduler(workers: FakeWorkers, table: dict[str, Placement], capacity=None) -> Scheduler:
    return Scheduler(workers, lambda: table, lambda: capacity, options=FAST, metrics=FrontDoorMetrics())


def test_a_model_for_node_b_never_evicts_the_worker_on_node_as_gpu_0():
    async def body():
        workers = FakeWorkers()
        on_a = workers.add_ready("a", gpus=(0,), node="node-a")
        table = {
            "a": Placement("a", (0,), None, start_timeout_s=5, nodes=("node-a",)),
            "b": Placement("b", (0,), None, start_timeout_s=5, nodes=("node-b",)),
        }
        lease = await scheduler(workers, table).acquire("b")
        assert lease.config == "b"
        assert workers.state(on_a) == State.READY and workers.stops() == []

    asyncio.run(asyncio.wait_for(body(), timeout=20))


def test_a_model_free_to_run_anywhere_takes_the_node_with_room_rather_than_evicting():
    async def body():
        workers = FakeWorkers()
        on_a = workers.add_ready("a", gpus=(0,), node="node-a")
        table = {
            "a": Placement("a", (0,), 60 * G, start_timeout_s=5, nodes=("node-a",)),
            "b": Placement("b", (0,), 60 * G, start_timeout_s=5),
        }
        (await scheduler(workers, table, TWO_NODES).acquire("b")).release()
        assert workers.state(on_a) == State.READY and workers.stops() == []

    asyncio.run(asyncio.wait_for(body(), timeout=20))


def test_on_the_same_node_the_worker_on_its_gpu_still_makes_room():
    async def body():
        workers = FakeWorkers()
        on_b = workers.add_ready("a", gpus=(0,), node="node-b")
        table = {
            "a": Placement("a", (0,), 60 * G, start_timeout_s=5, nodes=("node-b",)),
            "b": Placement("b", (0,), 60 * G, start_timeout_s=5, nodes=("node-b",)),
        }
        (await scheduler(workers, table, TWO_NODES).acquire("b")).release()
        assert workers.state(on_b) == State.STOPPED and workers.stops() == ["a"]

    asyncio.run(asyncio.wait_for(body(), timeout=20))


def test_a_start_short_of_host_ram_on_node_b_stops_a_sleeper_on_node_b_only():
    async def body():
        def node_b_short(model: str, views: list) -> None:
            asleep = tuple(
                Sleeper(v.id, v.model, 1, 16 * G) for v in views if v.state == State.SLEEPING and v.node == "node-b"
            )
            if asleep:
                raise HostRamHeldBySleepers("b: sleepers on node-b hold the RAM", 8 * G, asleep, node="node-b")

        workers = FakeWorkers(preflight=node_b_short)
        on_a = workers.add_ready("old", gpus=(1,), node="node-a")
        on_b = workers.add_ready("newer", gpus=(2,), node="node-b")
        table = {
            "old": Placement("old", (1,), None, start_timeout_s=5, nodes=("node-a",)),
            "newer": Placement("newer", (2,), None, start_timeout_s=5, nodes=("node-b",)),
            "b": Placement("b", (0,), None, start_timeout_s=5, nodes=("node-b",)),
        }
        sched = scheduler(workers, table)
        (await sched.acquire("old")).release()
        (await sched.acquire("newer")).release()
        await workers.command(on_a, "sleep", level=1)
        await workers.command(on_b, "sleep", level=1)
        lease = await sched.acquire("b")
        # old (node-a) is the least recently used sleeper, but stopping it frees nothing on node-b.
        assert workers.state(lease.worker_id) == State.READY
        assert workers.state(on_b) == State.STOPPED and workers.state(on_a) == State.SLEEPING

    asyncio.run(asyncio.wait_for(body(), timeout=20))


def test_whether_an_evicted_worker_may_sleep_counts_the_host_ram_of_its_own_node():
    async def body():
        workers = FakeWorkers()
        on_b = workers.add_ready("a", gpus=(0,), node="node-b")
        table = {
            "a": Placement("a", (0,), None, 5, sleep_level=1, sleep_host_bytes=16 * G, nodes=("node-b",)),
            "b": Placement("b", (0,), None, start_timeout_s=5, nodes=("node-b",)),
        }
        # This box has room for a's weights; node-b, where a runs, has 4 GiB.
        room = {None: 64 * G, "node-a": 64 * G, "node-b": 4 * G}
        sched = Scheduler(
            workers,
            lambda: table,
            options=FAST,
            metrics=FrontDoorMetrics(),
            host_available=lambda node: room[node],
        )
        (await sched.acquire("b")).release()
        assert workers.state(on_b) == State.STOPPED and workers.sleep_levels == []

    asyncio.run(asyncio.wait_for(body(), timeout=20))


def test_in_a_cluster_models_that_fit_side_by_side_on_a_nodes_gpu_stay_side_by_side():
    async def body():
        workers = FakeWorkers()
        on_a = workers.add_ready("a", gpus=(0,), node="node-a")
        on_b = workers.add_ready("c", gpus=(0,), node="node-b")
        # The manager's own box has no GPU: each node's GPU size, from its readings, sizes the shares.
        table = {
            "a": Placement("a", (0,), None, 5, nodes=("node-a",), gpu_share=0.7),
            "c": Placement("c", (0,), None, 5, nodes=("node-b",), gpu_share=0.4),
            "b": Placement("b", (0,), None, 5, gpu_share=0.5),
        }
        (await scheduler(workers, table, TWO_NODES).acquire("b")).release()
        assert workers.state(on_a) == State.READY and workers.state(on_b) == State.READY and workers.stops() == []

    asyncio.run(asyncio.wait_for(body(), timeout=20))


def test_the_start_is_pointed_at_the_node_placement_found_room_on():
    async def body():
        workers = FakeWorkers()
        workers.add_ready("a", gpus=(0,), node="node-a")
        table = {
            "a": Placement("a", (0,), 60 * G, start_timeout_s=5, nodes=("node-a",)),
            "b": Placement("b", (0,), 60 * G, start_timeout_s=5),
        }
        (await scheduler(workers, table, TWO_NODES).acquire("b")).release()
        assert workers.preferred == [("b", "node-b")]

    asyncio.run(asyncio.wait_for(body(), timeout=20))
