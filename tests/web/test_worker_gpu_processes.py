"""A worker on several GPUs: its page head lists each of its processes on each GPU with NVML's memory,
so both ranks of a tensor-parallel worker are seen, and no other worker's process is counted."""

from __future__ import annotations

import re

from manager.metrics import Snapshot, WorkerMetrics
from manager.metrics.collector import NodeMetrics
from manager.metrics.gpu import GpuProcess, GpuReport, GpuSample
from manager.metrics.host import HostSample
from manager.web.render import render

HOST = HostSample(0.0, 2, 8 << 30, 1 << 30, 7 << 30, 0, 0, None, ())
GIB = 1 << 30


def gpu(index: int, *processes: GpuProcess) -> GpuSample:
    return GpuSample(index, "H100", None, None, None, 80 * GIB, None, None, None, None, None, None, None, processes)


def worker(wid: str, on_gpus: int | None) -> WorkerMetrics:
    return WorkerMetrics(
        id=wid, model=f"model-{wid}", state="ready", port=18000, restarts=0, uptime_s=1.0, process=None,
        gpu_memory_bytes=on_gpus, engine=None, pools=None,
    )  # fmt: skip


def rows(html: str) -> list[str]:
    listed = re.search(r'data-testid="gpu-processes">(.*?)</ul>', html, re.S)
    assert listed is not None
    return [re.sub(r"\s+", " ", r).strip() for r in re.findall(r"<li>(.*?)</li>", listed.group(1), re.S)]


def test_both_ranks_of_a_tensor_parallel_worker_are_listed_with_their_gpu_and_memory():
    report = GpuReport(
        available=True,
        gpus=(
            gpu(0, GpuProcess(812, 70 * GIB, "4"), GpuProcess(900, 3 * GIB, "5")),
            gpu(1, GpuProcess(813, 69 * GIB, "4"), GpuProcess(812, 512 << 20, "4")),
        ),
    )
    snap = Snapshot(1, 0.0, report, HOST, (worker("4", 139 * GIB + (512 << 20)), worker("5", 3 * GIB)))
    html = render("fragments/worker_head.html", w=snap.workers[0], snap=snap)
    assert rows(html) == [
        "GPU 0: 70.0 GiB · pid 812",
        "GPU 1: 69.0 GiB · pid 813",
        "GPU 1: 512.0 MiB · pid 812",
    ]
    assert "pid 900" not in html  # the other worker's process on GPU 0


def test_a_worker_on_another_node_lists_that_nodes_gpus():
    remote = GpuReport(available=True, gpus=(gpu(0, GpuProcess(40, 20 * GIB, "7")),))
    snap = Snapshot(
        1, 0.0, GpuReport.unavailable("test"), HOST, (worker("7", 20 * GIB),),
        nodes=(NodeMetrics("gpu-b", "alive", None, remote), NodeMetrics("gpu-c", "lost", None, None)),
    )  # fmt: skip
    assert rows(render("fragments/worker_head.html", w=snap.workers[0], snap=snap)) == ["GPU 0: 20.0 GiB · pid 40"]


def test_the_gpu_cards_say_which_model_holds_each_gpu():
    report = GpuReport(
        available=True,
        gpus=(
            gpu(0, GpuProcess(3963, 782 << 20, "2"), GpuProcess(4532, 48 * GIB, "4"), GpuProcess(77, GIB, None)),
            gpu(1, GpuProcess(3925, 48 * GIB, "3")),
        ),
    )
    workers = (worker("2", 782 << 20), worker("3", 48 * GIB), worker("4", 48 * GIB))
    html = render("fragments/gpus.html", snap=Snapshot(1, 0.0, report, HOST, workers))
    held = dict(re.findall(r'data-gpu="(\d)".*?data-testid="held-by">([^<]*)<', html, re.S))
    assert held == {"0": "model-2, model-4", "1": "model-3"}
    assert "pid 4532 · worker 4 (model-4): 48.0 GiB" in html
    assert "pid 77: 1.0 GiB" in html  # not one of ours: no worker, no model
