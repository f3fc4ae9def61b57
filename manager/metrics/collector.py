"""The sampler: once a second, read GPUs, host, each worker's tree, engine and pools.

Data flows one way: this module reads the sources, writes the ring buffers and the minute history,
and publishes one immutable ``Snapshot`` that every page, SSE stream and /metrics scrape shares.
It knows workers only through a callable that lists them, so it needs nothing from the supervisor.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import json
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from manager.metrics.broadcast import Broadcast
from manager.metrics.engine import EngineSample, EngineScraper
from manager.metrics.gpu import GpuCollector, GpuReport, worker_gpu_memory
from manager.metrics.history import HistoryStore, MinuteDownsampler
from manager.metrics.host import HostCollector, HostSample, ProcessTreeSample
from manager.metrics.pools import PoolReport, PoolsReader
from manager.metrics.series import Point, SeriesStore

log = logging.getLogger(__name__)

# States in which a worker's HTTP server answers /metrics (a sleeping engine still does).
SCRAPED_STATES = frozenset({"ready", "sleeping"})
RAW_WINDOW_S = 3600.0  # up to 1 h, charts get 1 s points; longer windows get minute rows


@dataclass(frozen=True)
class WorkerInfo:
    """What the collector needs to know about a worker, from whoever owns the workers."""

    id: str
    model: str
    state: str
    port: int | None = None
    root_pid: int | None = None
    run_dir: Path | None = None
    restarts: int = 0
    started_at: float | None = None  # unix time the current process started
    address: str = "127.0.0.1"  # where its HTTP server answers
    node: str | None = None  # another node of a Ray cluster: its figures come from that node's agent
    last_error: str | None = None  # why it failed or crashed, as vLLM said it (secrets hidden)
    download: str | None = None  # while its model downloads: "downloading 34 %, about 2 min left"
    download_percent: int | None = None


@dataclass(frozen=True)
class NodeMetrics:
    """Another node of the Ray cluster, as its agent read it with these same collectors."""

    name: str
    state: str  # alive | lost
    host: HostSample | None
    gpu: GpuReport | None


@dataclass(frozen=True)
class RemoteReading:
    """What the cluster's heartbeat last read on another node (``sample``: a ``NodeSample``)."""

    name: str
    state: str
    sample: Any


@dataclass(frozen=True)
class WorkerMetrics:
    id: str
    model: str
    state: str
    port: int | None
    restarts: int
    uptime_s: float | None
    process: ProcessTreeSample | None
    gpu_memory_bytes: int | None  # what NVML attributes to the worker's processes; None: n/a
    engine: EngineSample | None  # None when the worker is not in a state that serves /metrics
    pools: PoolReport | None
    last_error: str | None = None
    download: str | None = None  # while its model downloads: "downloading 34 %, about 2 min left"
    download_percent: int | None = None


@dataclass(frozen=True)
class Snapshot:
    seq: int
    taken_at: float  # unix time; the page marks data stale when this gets old
    gpu: GpuReport
    host: HostSample
    workers: tuple[WorkerMetrics, ...]
    nodes: tuple[NodeMetrics, ...] = ()  # the other nodes of a Ray cluster (none on one box)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @cached_property
    def json(self) -> str:
        """Serialised once, however many streams send it."""
        return json.dumps(self.to_dict(), default=_json_default, separators=(",", ":"))

    def series_values(self) -> dict[str, float | None]:
        """The values charted over time, by series name."""
        out: dict[str, float | None] = {}
        for g in self.gpu.gpus:
            p = f"gpu.{g.index}."
            out[p + "utilization_pct"] = g.utilization_pct
            out[p + "memory_used_bytes"] = g.memory_used_bytes
            out[p + "temperature_c"] = g.temperature_c
            out[p + "power_w"] = g.power_w
            out[p + "pcie_rx_bytes_per_s"] = g.pcie_rx_bytes_per_s
            out[p + "pcie_tx_bytes_per_s"] = g.pcie_tx_bytes_per_s
        for node in self.nodes:
            if node.gpu is not None:
                for g in node.gpu.gpus:
                    # gpu.<node>/<index>.*: the same charts (gpu.*.memory_used_bytes) show every node's GPUs
                    p = f"gpu.{node.name}/{g.index}."
                    out[p + "utilization_pct"] = g.utilization_pct
                    out[p + "memory_used_bytes"] = g.memory_used_bytes
            if node.host is not None:
                out[f"node.{node.name}.cpu_pct"] = node.host.cpu_pct
                out[f"node.{node.name}.ram_used_bytes"] = node.host.ram_used_bytes
        h = self.host
        out["host.cpu_pct"] = h.cpu_pct
        out["host.ram_used_bytes"] = h.ram_used_bytes
        out["host.ram_available_bytes"] = h.ram_available_bytes
        out["host.swap_used_bytes"] = h.swap_used_bytes
        out["host.shm_used_bytes"] = h.shm.used_bytes if h.shm else None
        for w in self.workers:
            p = f"worker.{w.id}."
            out[p + "rss_bytes"] = w.process.rss_bytes if w.process else None
            out[p + "cpu_pct"] = w.process.cpu_pct if w.process else None
            out[p + "gpu_memory_bytes"] = w.gpu_memory_bytes
            e = w.engine if w.engine and w.engine.ok else None
            for name in _ENGINE_SERIES:
                out[p + name] = getattr(e, name) if e else None
            if w.pools and w.pools.available:
                for section, values in w.pools.totals.items():
                    for key, value in values.items():
                        out[f"{p}pools.{section}.{key}"] = value
        return out


_ENGINE_SERIES = (
    "requests_running",
    "requests_waiting",
    "kv_cache_usage_pct",
    "prompt_tokens_per_s",
    "generation_tokens_per_s",
    "ttft_p50_s",
    "ttft_p95_s",
    "itl_p50_s",
    "itl_p95_s",
    "prefix_cache_hit_pct",
    "cpu_prefix_cache_hit_pct",
    "kv_offload_cpu_usage_pct",
)


def _json_default(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"cannot serialise {type(value).__name__} in a metrics snapshot")


WorkerLister = Callable[[], Iterable[WorkerInfo] | Awaitable[Iterable[WorkerInfo]]]
# The other nodes' latest readings, from the Ray cluster's heartbeat.
RemoteReadings = Callable[[], list[RemoteReading]]


class MetricsCollector:
    """Samples every ``interval_s``; ``broadcast`` carries each new ``Snapshot`` to its readers.

    ``disks`` are (label, path) pairs whose filesystem usage is shown, e.g. ("data", data_dir),
    ("models", hf_cache). ``history`` is optional: without it charts start empty after a restart.
    """

    def __init__(
        self,
        list_workers: WorkerLister,
        *,
        disks: Sequence[tuple[str, Path | str]] = (),
        gpu: GpuCollector | None = None,
        host: HostCollector | None = None,
        engine: EngineScraper | None = None,
        pools: PoolsReader | None = None,
        series: SeriesStore | None = None,
        history: HistoryStore | None = None,
        interval_s: float = 1.0,
        scraped_states: frozenset[str] = SCRAPED_STATES,
        clock: Callable[[], float] = time.time,
        remote: RemoteReadings | None = None,
    ) -> None:
        self._list_workers = list_workers
        self._remote = remote
        self._disks = tuple(disks)
        self.gpu = gpu or GpuCollector()
        self.host = host or HostCollector()
        self.engine = engine or EngineScraper()
        self.pools = pools or PoolsReader.from_plugin()
        self.series = series or SeriesStore()
        self.history = history
        self.interval_s = interval_s
        self._scraped_states = scraped_states
        self._clock = clock
        self._minutes = MinuteDownsampler()
        self._last_prune = 0.0
        self._seq = 0
        self._task: asyncio.Task[None] | None = None
        self.broadcast: Broadcast[Snapshot] = Broadcast()

    @property
    def latest(self) -> Snapshot | None:
        return self.broadcast.latest

    async def sample_once(self) -> Snapshot:
        workers = self._list_workers()
        if inspect.isawaitable(workers):
            workers = await workers
        workers = list(workers)
        # worker id -> (address, port) of the workers whose HTTP server answers /metrics now
        scraped = {w.id: (w.address, w.port) for w in workers if w.state in self._scraped_states and w.port}
        here = [w for w in workers if w.node is None]
        local, engines = await asyncio.gather(
            # psutil and NVML block; a thread keeps the event loop (and the SSE streams) moving.
            asyncio.to_thread(self._sample_local, here),
            asyncio.gather(*(self.engine.scrape(wid, port, address) for wid, (address, port) in scraped.items())),
        )
        self.engine.forget_except(set(scraped))
        host, gpu, trees, pools = local
        readings = self._remote() if self._remote is not None else []
        nodes = tuple(
            NodeMetrics(r.name, r.state, r.sample.host if r.sample else None, r.sample.gpu if r.sample else None)
            for r in readings
        )
        # A pid names a process on one node only: a remote worker's tree comes from its own node.
        node_trees = {r.name: r.sample.trees for r in readings if r.sample is not None}
        for r in readings:
            if r.sample is not None:
                pools = {**pools, **{wid: p for wid, p in r.sample.pools.items() if wid not in pools}}
        by_worker = dict(zip(scraped, engines, strict=True))
        gpu_mem = worker_gpu_memory(gpu)
        for r in readings:
            if r.sample is not None:
                gpu_mem.update(worker_gpu_memory(r.sample.gpu))
        now = self._clock()
        self._seq += 1
        snapshot = Snapshot(
            seq=self._seq,
            taken_at=now,
            gpu=gpu,
            host=host,
            nodes=nodes,
            workers=tuple(
                WorkerMetrics(
                    id=w.id,
                    model=w.model,
                    state=w.state,
                    port=w.port,
                    restarts=w.restarts,
                    uptime_s=None if w.started_at is None else max(0.0, now - w.started_at),
                    process=(node_trees.get(w.node, {}) if w.node else trees).get(w.root_pid) if w.root_pid else None,
                    gpu_memory_bytes=gpu_mem.get(w.id) if gpu.available or w.id in gpu_mem else None,
                    engine=by_worker.get(w.id),
                    pools=pools.get(w.id),
                    last_error=w.last_error,
                    download=w.download,
                    download_percent=w.download_percent,
                )
                for w in workers
            ),
        )
        await self._record(snapshot)
        self.broadcast.publish(snapshot)
        return snapshot

    def _sample_local(
        self, workers: list[WorkerInfo]
    ) -> tuple[HostSample, GpuReport, dict[int, ProcessTreeSample], dict[str, PoolReport]]:
        host = self.host.sample(self._disks)
        roots = {w.root_pid: w.id for w in workers if w.root_pid}
        trees = self.host.process_trees(roots)
        pid_to_worker = {pid: roots[root] for root, tree in trees.items() for pid in tree.pids}
        gpu = self.gpu.sample(pid_to_worker)
        pools = {
            w.id: self.pools.sample(w.run_dir)
            for w in workers
            if w.root_pid and trees.get(w.root_pid) and trees[w.root_pid].alive
        }
        return host, gpu, trees, pools

    async def _record(self, snapshot: Snapshot) -> None:
        values = snapshot.series_values()
        self.series.add(snapshot.taken_at, values)
        finished = self._minutes.add(snapshot.taken_at, values)
        if self.history is None:
            return
        try:
            if finished:
                await asyncio.to_thread(self.history.write, finished)
            if snapshot.taken_at - self._last_prune > 3600:
                self._last_prune = snapshot.taken_at
                await asyncio.to_thread(self.history.prune, snapshot.taken_at)
        except Exception:  # a locked or full database must not stop the live charts
            log.warning("could not write metric history", exc_info=True)

    async def run(self) -> None:
        """Sample on a steady grid until cancelled; a slow tick skips ahead, never bunches up."""
        loop = asyncio.get_running_loop()
        next_tick = loop.time()
        while True:
            try:
                await self.sample_once()
            except Exception:
                log.exception("metrics sample failed; trying again next tick")
            next_tick += self.interval_s
            now = loop.time()
            if next_tick < now:
                next_tick = now + self.interval_s - ((now - next_tick) % self.interval_s)
            await asyncio.sleep(next_tick - now)

    def start(self) -> asyncio.Task[None]:
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self.run(), name="metrics-collector")
        return self._task

    async def stop(self) -> None:
        """Stop sampling, store the minute in progress, end every subscription."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self.history is not None:
            try:
                await asyncio.to_thread(self.history.write, self._minutes.flush())
            except Exception:
                log.warning("could not store the last minute of metrics", exc_info=True)
        self.broadcast.close()
        await self.engine.aclose()
        self.gpu.close()

    def known_series(self) -> list[str]:
        names = set(self.series.names())
        if self.history is not None:
            names.update(self.history.series_names())
        return sorted(names)

    def points(self, name: str, window_s: float, now: float | None = None) -> list[Point]:
        """Chart points for the last ``window_s`` seconds: 1 s points up to an hour (older minutes
        from the history when the buffers do not reach back that far, e.g. after a restart),
        one point per minute (its mean) beyond. Reads SQLite: call from a thread."""
        now = self._clock() if now is None else now
        since = now - window_s
        if window_s <= RAW_WINDOW_S:
            raw = self.series.window(name, window_s, now).points
            oldest = raw[0][0] if raw else now
            older: list[Point] = []
            if self.history is not None and oldest - since > 60:
                rows = self.history.query(name, since, until=oldest - 60)
                older = [(float(r.minute), r.mean) for r in rows]
            return older + raw
        rows = self.history.query(name, since, until=now) if self.history is not None else []
        pts: list[Point] = [(float(r.minute), r.mean) for r in rows]
        current = self._minutes.partial(name)
        if current is not None and (not pts or current.minute > pts[-1][0]):
            pts.append((float(current.minute), current.mean))
        return pts
