"""Other nodes' GPUs on the overview: a card per GPU of each node, and the same charts' series."""

from __future__ import annotations

from manager.metrics.collector import NodeMetrics, Snapshot
from manager.metrics.gpu import GpuReport, GpuSample
from manager.metrics.host import HostCollector
from manager.web.render import render


def _gpu(index: int, used_gib: int) -> GpuSample:
    return GpuSample(
        index,
        "NVIDIA H200",
        f"GPU-{index}",
        35.0,
        used_gib << 30,
        141 << 30,
        41.0,
        310.0,
        700.0,
        1980,
        3200,
        None,
        None,
    )


def test_each_nodes_gpus_get_cards_and_series_and_a_lost_node_says_so():
    host = HostCollector().sample()
    snap = Snapshot(
        seq=1,
        taken_at=0.0,
        gpu=GpuReport.unavailable("no driver on the manager's box"),
        host=host,
        workers=(),
        nodes=(
            NodeMetrics("box2", "alive", host, GpuReport(True, None, "580.1", (_gpu(0, 60), _gpu(1, 12)))),
            NodeMetrics("box3", "lost", None, None),
        ),
    )
    html = render("fragments/gpus.html", snap=snap)
    assert "box2 · GPU 0 · NVIDIA H200" in html and "box2 · GPU 1 · NVIDIA H200" in html
    assert 'data-node="box3"' in html and "lost: no figures" in html
    values = snap.series_values()
    # The overview's GPU memory chart reads gpu.*.memory_used_bytes: every node's GPUs match it.
    assert values["gpu.box2/0.memory_used_bytes"] == 60 << 30 and values["gpu.box2/1.memory_used_bytes"] == 12 << 30
    assert values["node.box2.ram_used_bytes"] == host.ram_used_bytes
