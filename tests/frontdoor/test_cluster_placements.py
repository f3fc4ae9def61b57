"""What the front door gives its scheduler in a Ray cluster: each node's GPUs and host RAM from that
node's latest readings, and the nodes a config's ``node`` picks (stand-in nodes: no Ray needed)."""

from __future__ import annotations

from types import SimpleNamespace

import httpx

from manager.cluster.nodes import NodeState
from manager.db import make_engine, migrate, session
from manager.errors import Invalid
from manager.frontdoor.front_door import FrontDoor
from manager.frontdoor.metrics import FrontDoorMetrics
from manager.frontdoor.usage import UsageRecorder
from manager.host.local import LocalHost
from manager.metrics.gpu import GpuReport, GpuSample
from manager.metrics.host import HostSample
from manager.planner.gpus import NoGPU
from manager.schemas.model_config import ModelConfig
from manager.settings import Settings
from manager.supervisor.supervisor import Supervisor

G = 1 << 30


def gpu(index: int, total: int | None) -> GpuSample:
    return GpuSample(index, "H100", None, 0.0, 0, total, None, None, None, None, None, None, None)


def host(available: int) -> HostSample:
    return HostSample(0.0, 8, 64 * G, 64 * G - available, available, 0, 0, None, ())


class Nodes:
    """The head (no GPU reading) and box2 (two 80 GiB GPUs, 12 GiB of RAM available); box3 is lost."""

    local = LocalHost("head")
    local_name = "head"
    workers_on = None

    def on_change(self, listener) -> None:
        pass

    def statuses(self) -> list:
        def status(name: str, state: NodeState, sample) -> SimpleNamespace:
            return SimpleNamespace(name=name, local=name == "head", state=state, sample=sample)

        box2 = SimpleNamespace(host=host(12 * G), gpu=GpuReport(True, gpus=(gpu(0, 80 * G), gpu(1, 80 * G))))
        return [
            status("head", NodeState.ALIVE, SimpleNamespace(host=host(30 * G), gpu=GpuReport.unavailable("no NVML"))),
            status("box2", NodeState.ALIVE, box2),
            status("box3", NodeState.LOST, box2),
        ]

    def is_local(self, name: str) -> bool:
        return name == "head"

    def resolve(self, wanted: str) -> list[str]:
        if wanted not in ("head", "box2", "box3"):
            raise Invalid(f"no node is called {wanted!r}")
        return [wanted] if wanted != "box3" else []


def door(tmp_path) -> FrontDoor:
    engine = make_engine(tmp_path / "m.db")
    migrate(engine)
    settings = Settings(data_dir=tmp_path, api_token=None)
    supervisor = Supervisor(settings, engine, httpx.AsyncClient(), None, cluster=Nodes())  # type: ignore[arg-type]
    with session(engine) as db:
        db.add(ModelConfig(name="pinned", model="/m", node="box2", gpu_memory_utilization=0.5))
        db.add(ModelConfig(name="anywhere", model="/m", gpu_memory_utilization=0.3))
        db.add(ModelConfig(name="gone", model="/m", node="box3"))
        db.commit()
    return FrontDoor(
        settings,
        engine,
        supervisor,
        httpx.AsyncClient(),
        FrontDoorMetrics(),
        UsageRecorder(engine),
        gpu=lambda: NoGPU("no GPU"),
    )


def test_each_live_nodes_gpus_are_its_own_readings(tmp_path):
    assert door(tmp_path).gpu_capacity() == {"head": None, "box2": {0: 80 * G, 1: 80 * G}}


def test_a_configs_node_names_where_it_may_run_and_its_share_is_sized_there(tmp_path):
    placements = door(tmp_path).placements()
    assert placements["pinned"].nodes == ("box2",) and placements["anywhere"].nodes is None
    assert placements["gone"].nodes == ()  # its node is lost: nowhere to run now
    assert placements["pinned"].gpu_bytes is None and placements["pinned"].gpu_share == 0.5


def test_another_nodes_host_ram_is_its_own_reading(tmp_path):
    front = door(tmp_path)
    assert front.host_available("box2") == 12 * G
    assert front.host_available("box3") is None  # lost: not known
