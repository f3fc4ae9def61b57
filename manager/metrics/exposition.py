"""The manager's own Prometheus endpoint: worker states and restarts, GPU and host gauges.

Values come from the collector's latest snapshot at scrape time, so a Grafana scrape costs no
extra sampling and shows exactly what the dashboard shows. The registry is private (not
prometheus_client's global one) so tests and several apps in one process do not collide. Engine
metrics are not repeated here: Prometheus should scrape each worker's own /metrics for those.
A value the hardware does not report is left out rather than exported as 0.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from manager.metrics.collector import Snapshot

P = "vllm_manager_"


class SnapshotCollector(Collector):
    def __init__(self, latest: Callable[[], Snapshot | None]) -> None:
        self._latest = latest

    def collect(self) -> Iterator[Metric]:
        snap = self._latest()
        if snap is None:
            return
        yield from _worker_metrics(snap)
        yield from _gpu_metrics(snap)
        yield from _host_metrics(snap)
        age = GaugeMetricFamily(P + "metrics_sample_timestamp_seconds", "When the values were sampled.")
        age.add_metric([], snap.taken_at)
        yield age


def _gauge(name: str, doc: str, labels: list[str]) -> GaugeMetricFamily:
    return GaugeMetricFamily(P + name, doc, labels=labels)


def _add(family: GaugeMetricFamily, labels: list[str], value: float | None, scale: float = 1.0) -> None:
    if value is not None:
        family.add_metric(labels, value * scale)


def _worker_metrics(snap: Snapshot) -> Iterator[Metric]:
    wl = ["worker", "model"]
    state = _gauge("worker_state", "1 for the worker's current state (label state).", wl + ["state"])
    restarts = CounterMetricFamily(P + "worker_restarts", "Automatic restarts of the worker.", labels=wl)
    uptime = _gauge("worker_uptime_seconds", "Seconds since the worker's process started.", wl)
    rss = _gauge("worker_rss_bytes", "Resident memory of the worker's process tree (sum of RSS).", wl)
    cpu = _gauge("worker_cpu_percent", "CPU of the worker's process tree, 100 per busy core.", wl)
    gmem = _gauge("worker_gpu_memory_bytes", "GPU memory NVML attributes to the worker's processes.", wl)
    for w in snap.workers:
        labels = [w.id, w.model]
        state.add_metric(labels + [w.state], 1)
        restarts.add_metric(labels, w.restarts)
        _add(uptime, labels, w.uptime_s)
        if w.process is not None:
            _add(rss, labels, w.process.rss_bytes)
            _add(cpu, labels, w.process.cpu_pct)
        _add(gmem, labels, w.gpu_memory_bytes)
    yield from (state, restarts, uptime, rss, cpu, gmem)


def _gpu_metrics(snap: Snapshot) -> Iterator[Metric]:
    available = _gauge("gpu_available", "1 when NVML reads the GPUs, 0 when no NVIDIA GPU is detected.", [])
    available.add_metric([], 1 if snap.gpu.available else 0)
    yield available
    gl = ["gpu", "name", "uuid"]
    fams = {
        "util": _gauge("gpu_utilization_percent", "GPU utilization.", gl),
        "used": _gauge("gpu_memory_used_bytes", "GPU memory used.", gl),
        "total": _gauge("gpu_memory_total_bytes", "GPU memory total.", gl),
        "temp": _gauge("gpu_temperature_celsius", "GPU temperature.", gl),
        "power": _gauge("gpu_power_watts", "GPU power draw.", gl),
        "limit": _gauge("gpu_power_limit_watts", "Enforced GPU power limit.", gl),
        "sm": _gauge("gpu_sm_clock_hertz", "SM clock.", gl),
        "mem": _gauge("gpu_memory_clock_hertz", "Memory clock.", gl),
        "rx": _gauge("gpu_pcie_rx_bytes_per_second", "PCIe receive throughput (host to GPU).", gl),
        "tx": _gauge("gpu_pcie_tx_bytes_per_second", "PCIe transmit throughput (GPU to host).", gl),
    }
    for g in snap.gpu.gpus:
        labels = [str(g.index), g.name or "", g.uuid or ""]
        _add(fams["util"], labels, g.utilization_pct)
        _add(fams["used"], labels, g.memory_used_bytes)
        _add(fams["total"], labels, g.memory_total_bytes)
        _add(fams["temp"], labels, g.temperature_c)
        _add(fams["power"], labels, g.power_w)
        _add(fams["limit"], labels, g.power_limit_w)
        _add(fams["sm"], labels, g.sm_clock_mhz, 1e6)
        _add(fams["mem"], labels, g.memory_clock_mhz, 1e6)
        _add(fams["rx"], labels, g.pcie_rx_bytes_per_s)
        _add(fams["tx"], labels, g.pcie_tx_bytes_per_s)
    yield from fams.values()


def _host_metrics(snap: Snapshot) -> Iterator[Metric]:
    h = snap.host
    for name, doc, value in (
        ("host_cpu_percent", "Host CPU use, 0-100 over all cores.", h.cpu_pct),
        ("host_memory_total_bytes", "Host RAM.", h.ram_total_bytes),
        ("host_memory_used_bytes", "Host RAM not available to new processes.", h.ram_used_bytes),
        (
            "host_memory_available_bytes",
            "Host RAM available to new processes.",
            h.ram_available_bytes,
        ),
        ("host_swap_total_bytes", "Swap size.", h.swap_total_bytes),
        ("host_swap_used_bytes", "Swap used.", h.swap_used_bytes),
    ):
        fam = _gauge(name, doc, [])
        fam.add_metric([], value)
        yield fam
    total = _gauge("host_filesystem_total_bytes", "Size of the filesystem holding a path.", ["label", "path"])
    used = _gauge(
        "host_filesystem_used_bytes",
        "Used bytes of the filesystem holding a path.",
        ["label", "path"],
    )
    for du in ((h.shm,) if h.shm else ()) + h.disks:
        _add(total, [du.label, du.path], du.total_bytes)
        _add(used, [du.label, du.path], du.used_bytes)
    yield from (total, used)


class ManagerExposition:
    """``render()`` gives the body and content type of ``GET /metrics``."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, latest: Callable[[], Snapshot | None]) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(SnapshotCollector(latest))
        # The manager process itself (CPU seconds, RSS, open fds): what the SSE bench watches.
        ProcessCollector(namespace="vllm_manager", registry=self.registry)

    def render(self) -> bytes:
        return generate_latest(self.registry)
