"""Per-node snapshots merged once a second: the head's cost for 8, 16 and 32 nodes of a Ray cluster.

    ~/.cache/vllm-manager/test-venv/bin/python bench/cluster_merge.py --out bench/results

One local Ray instance stands in for the cluster: ``ray.nodes()`` is made to list N nodes, all this
box, and the manager's own ``RayCluster`` gives each its ``NodeAgent`` actor and samples them with
its own ``refresh()``. Each node has ``--workers`` simulated workers, each a real process tree (a
shell with two ``sleep`` children, like an API server with an engine core and a worker) with a
pool-stats file in its run folder, so the agents read real trees and real stats files.

Every tick, as the heartbeat does: ``refresh()`` in a thread (sample calls to every agent, wait for
all with a 2 s limit), then the merged view (node name -> sample) serialised to JSON once, as the
dashboard's stream would send it. Tick = refresh start to the JSON being ready: the delay the merge
adds to every update. CPU is over the measured window: the driver (the manager) alone, Ray's own
processes (GCS, raylet, the agent workers, the rest), and the whole box, whose busy time beyond
those is "others" (anything else running here); 100 % = one core. Before each measured window the
agents sit ``--idle-seconds`` without calls, for their cost between beats.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from manager.cluster import nodes as n  # noqa: E402
from manager.cluster.agent import NodeAgent  # noqa: E402
from manager.cluster.ray_cluster import HEARTBEAT_S, NAMESPACE, RayCluster  # noqa: E402


class SimulatedRay:
    """The ``ray`` module, except that ``nodes()`` lists ``count()`` nodes: the real one (the head,
    where the driver runs) and copies of it under other ids and names."""

    def __init__(self, real: Any, count: Callable[[], int]) -> None:
        self._real = real
        self._count = count

    def nodes(self) -> list[dict]:
        head = next(e for e in self._real.nodes() if e["Alive"])
        entries = []
        for i in range(self._count()):
            entry = dict(head, Labels={**head.get("Labels", {}), n.NODE_LABEL: f"sim-{i:02d}"})
            if i > 0:
                entry["NodeID"] = f"{i:056x}"
                entry["Resources"] = {k: v for k, v in head["Resources"].items() if "__internal_head__" not in k}
            entries.append(entry)
        return entries

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


class SimulatedCluster(RayCluster):
    """The manager's ``RayCluster``, unchanged but for where its nodes and agents come from."""

    node_count = 8

    # RayCluster keeps the ray module in ``self._ray``; this puts the simulated node table in front.
    @property
    def _ray(self) -> Any:
        return self._simulated_ray

    @_ray.setter
    def _ray(self, real: Any) -> None:
        self._simulated_ray = SimulatedRay(real, lambda: self.node_count)

    def _agent(self, node: n.RayNode, name: str) -> Any:
        # As RayCluster._agent, without pinning to the node (the simulated ids have no raylet) and
        # not detached (the agents end with this run).
        return (
            self._ray.remote(NodeAgent)
            .options(
                name=f"cluster-merge-agent-{node.node_id}",
                namespace=NAMESPACE,
                get_if_exists=True,
                num_cpus=0,
                max_concurrency=8,
            )
            .remote(name)
        )


class Workers:
    """The simulated engines: per node, ``per_node`` process trees with a stats file each."""

    def __init__(self, root: Path, per_node: int) -> None:
        self.root = root
        self.per_node = per_node
        self.on_node: dict[str, dict[str, tuple[int, str]]] = {}
        self.popens: list[subprocess.Popen[bytes]] = []

    def __call__(self, node: str) -> dict[str, tuple[int, str]]:
        if node not in self.on_node:
            self.on_node[node] = dict(self._start(node, i) for i in range(self.per_node))
        return self.on_node[node]

    def _start(self, node: str, i: int) -> tuple[str, tuple[int, str]]:
        run_dir = self.root / node / f"w{i}"
        run_dir.mkdir(parents=True)
        popen = subprocess.Popen(["sh", "-c", "sleep 3600 & sleep 3600 & wait"], start_new_session=True)
        self.popens.append(popen)
        stats = {"pid": popen.pid, "role": "api_server", "updated_at": time.time(), "pinned": _pinned_stats()}
        (run_dir / f"stats-{popen.pid}.json").write_text(json.dumps(stats))
        return f"{node}-w{i}", (popen.pid, str(run_dir))

    def pids(self) -> set[int]:
        found = set()
        for popen in self.popens:
            with contextlib.suppress(psutil.NoSuchProcess):
                found |= {popen.pid, *(c.pid for c in psutil.Process(popen.pid).children(recursive=True))}
        return found

    def stop(self) -> None:
        for popen in self.popens:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(popen.pid, signal.SIGKILL)
            popen.wait()


def _pinned_stats() -> dict[str, int]:
    names = ("asked_bytes", "mapped_bytes", "pinned_bytes", "pageable_bytes", "allocations", "chunks")
    return {name: 1_000_000 * (i + 1) for i, name in enumerate(names)}


def _role(proc: psutil.Process) -> str:
    try:
        line = " ".join(proc.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return "other"
    if "gcs_server" in line:
        return "gcs"
    if "raylet" in line.split(" ", 1)[0]:
        return "raylet"
    if line.startswith("ray::NodeAgent"):
        return "agents"
    return "other"  # Ray's dashboard and runtime-env agents, its monitors, idle workers


def ray_cpu(skip: set[int]) -> dict[tuple[int, float], tuple[str, float]]:
    """CPU seconds so far of each of Ray's processes (the driver's descendants but the sleeps)."""
    out = {}
    for proc in psutil.Process().children(recursive=True):
        if proc.pid in skip:
            continue
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            times = proc.cpu_times()
            out[(proc.pid, proc.create_time())] = (_role(proc), times.user + times.system)
    return out


class CpuWindow:
    """CPU % (100 = one core) used between ``__init__`` and ``end()``: the driver, each kind of Ray
    process, and the whole box."""

    def __init__(self, skip: set[int]) -> None:
        self.skip = skip
        self.started = time.monotonic()
        self.driver = _used(psutil.Process().cpu_times())
        self.ray = ray_cpu(skip)
        self.box = _busy(psutil.cpu_times())

    def end(self) -> dict[str, Any]:
        wall = time.monotonic() - self.started
        driver = _used(psutil.Process().cpu_times()) - self.driver
        by_role: dict[str, float] = {}
        for key, (role, used) in ray_cpu(self.skip).items():
            by_role[role] = by_role.get(role, 0.0) + used - self.ray.get(key, (role, 0.0))[1]
        box = _busy(psutil.cpu_times()) - self.box
        pct = {"driver": driver, **by_role, "ray": sum(by_role.values()), "box": box}
        # what else ran meanwhile (other people's tests share this box): box - driver - Ray
        pct["others"] = box - driver - pct["ray"]
        return {"wall_s": wall, "driver_s": driver, "pct": {k: 100 * v / wall for k, v in pct.items()}}


def _used(times: Any) -> float:
    return times.user + times.system


def _busy(times: Any) -> float:
    return sum(times) - times.idle - getattr(times, "iowait", 0.0)


def _pct(values: list[float], q: float) -> float:
    return sorted(values)[min(len(values) - 1, round(q * (len(values) - 1)))]


async def tick(cluster: RayCluster) -> tuple[float, float, int, int]:
    """One heartbeat: refresh, merge, JSON. Returns (refresh s, merge+JSON s, JSON bytes, nodes missed)."""
    started = time.perf_counter()
    await asyncio.to_thread(cluster.refresh)
    refreshed = time.perf_counter()
    merged = {s.name: dataclasses.asdict(s.sample) if s.sample else None for s in cluster.statuses()}
    body = json.dumps(merged).encode()
    done = time.perf_counter()
    missed = sum(1 for s in cluster.statuses() if s.error or s.sample is None)
    return refreshed - started, done - refreshed, len(body), missed


async def beat(cluster: RayCluster, seconds: float) -> list[tuple[float, float, int, int]]:
    ticks = []
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        started = time.monotonic()
        ticks.append(await tick(cluster))
        await asyncio.sleep(max(0.05, HEARTBEAT_S - (time.monotonic() - started)))
    return ticks


async def warm_up(cluster: SimulatedCluster, limit_s: float) -> float:
    """Beat until every node answered three ticks in a row; returns how long that took."""
    started = time.monotonic()
    clean = 0
    while clean < 3:
        if time.monotonic() - started > limit_s:
            raise SystemExit(f"the {cluster.node_count} agents did not all answer within {limit_s:g} s")
        clean = clean + 1 if (await beat(cluster, 0.5))[-1][3] == 0 else 0
    return time.monotonic() - started


async def measure(cluster: SimulatedCluster, count: int, workers: Workers, seconds: float, idle_s: float) -> dict:
    cluster.node_count = count
    warm_s = await warm_up(cluster, limit_s=180)
    # The agents between beats: what Ray's worker processes cost when nobody calls them.
    idle = CpuWindow(workers.pids())
    await asyncio.sleep(idle_s)
    idle_pct = idle.end()["pct"]
    window = CpuWindow(workers.pids())
    ticks = await beat(cluster, seconds)
    cpu = window.end()
    samples = len(ticks) * count - sum(m for _, _, _, m in ticks)
    agents_s = cpu["pct"].get("agents", 0.0) * cpu["wall_s"] / 100
    tick_ms = [1000 * (r + m) for r, m, _, _ in ticks]
    return {
        "nodes": count,
        "workers": count * workers.per_node,
        "warm_up_s": round(warm_s, 1),
        "ticks": len(ticks),
        "window_s": round(cpu["wall_s"], 2),
        "tick_ms": {"p50": _pct(tick_ms, 0.5), "p95": _pct(tick_ms, 0.95), "max": max(tick_ms)},
        "refresh_ms_p50": 1000 * statistics.median(r for r, _, _, _ in ticks),
        "merge_json_ms_p50": 1000 * statistics.median(m for _, m, _, _ in ticks),
        "per_node_ms_p50": _pct(tick_ms, 0.5) / count,
        "driver_cpu_ms_per_tick": 1000 * cpu["driver_s"] / len(ticks),
        "cpu_pct": cpu["pct"],
        "idle_cpu_pct": idle_pct,
        "agent_cpu_ms_per_sample": 1000 * agents_s / max(1, samples),
        "json_bytes": statistics.median(b for _, _, b, _ in ticks),
        "missed_node_samples": len(ticks) * count - samples,
    }


def table(runs: list[dict]) -> str:
    lines = [
        "| nodes (workers) | tick p50 / p95 / max | per node (p50) | manager CPU per tick (% of a core) "
        "| agent CPU per sample | Ray's processes (agents; agents idle) | box busy of 200 % (others) "
        "| JSON per tick | missed samples |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in runs:
        t, cpu, idle = r["tick_ms"], r["cpu_pct"], r["idle_cpu_pct"]
        lines.append(
            f"| {r['nodes']} ({r['workers']}) | {t['p50']:.0f} / {t['p95']:.0f} / {t['max']:.0f} ms "
            f"| {r['per_node_ms_p50']:.1f} ms | {r['driver_cpu_ms_per_tick']:.0f} ms ({cpu['driver']:.1f} %) "
            f"| {r['agent_cpu_ms_per_sample']:.0f} ms "
            f"| {cpu['ray']:.0f} % ({cpu.get('agents', 0):.0f} %; {idle.get('agents', 0):.0f} %) "
            f"| {cpu['box']:.0f} % ({cpu['others']:.0f} %) | {r['json_bytes'] / 1024:.0f} KiB "
            f"| {r['missed_node_samples']} of {r['ticks'] * r['nodes']} |"
        )
    return "\n".join(lines)


async def run(args: argparse.Namespace) -> dict:
    import ray

    # "node X is lost/alive" while 32 agents start on 2 cores is expected here, not news
    logging.getLogger("vllm_manager.cluster").setLevel(logging.ERROR)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    ray.init(
        address="local",  # a new instance of its own, even where another one runs on this box
        num_cpus=psutil.cpu_count(),
        include_dashboard=False,
        namespace=NAMESPACE,
        log_to_driver=False,
        logging_level=logging.WARNING,
        object_store_memory=256 * 1024**2,
    )
    scratch = Path(tempfile.mkdtemp(prefix="cluster-merge-"))
    workers = Workers(scratch / "runs", args.workers)
    runs = []
    try:
        cluster = SimulatedCluster("local", workers_on=workers)
        for count in args.nodes:
            runs.append(await measure(cluster, count, workers, args.seconds, args.idle_seconds))
            print(table(runs[-1:]).splitlines()[-1], flush=True)
    finally:
        ray.shutdown()
        workers.stop()
        shutil.rmtree(scratch, ignore_errors=True)
    return {
        "bench": "cluster_merge",
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "box": {"cores": psutil.cpu_count(), "ram_gib": round(psutil.virtual_memory().total / 2**30, 1)},
        "python": platform.python_version(),
        "ray": ray.__version__,
        "workers_per_node": args.workers,
        "seconds_per_run": args.seconds,
        "idle_seconds": args.idle_seconds,
        "runs": runs,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--workers", type=int, default=4, help="simulated workers per node")
    parser.add_argument("--seconds", type=float, default=25.0, help="measured seconds per node count")
    parser.add_argument("--idle-seconds", type=float, default=5.0, help="agents' idle CPU read before each run")
    parser.add_argument("--out", type=Path, help="folder for cluster_merge.json")
    args = parser.parse_args()
    result = asyncio.run(run(args))
    print(table(result["runs"]))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "cluster_merge.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
