"""A node's agent: one long-lived Ray actor per node, pinned there, that runs the manager's own local
code on that node (start an engine, recognise it, stop its group, read its log, sample the node).

This is a plain class: Ray makes it an actor (``ray_cluster.py``), and tests call it directly.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from manager import processes
from manager.errors import Invalid, ManagerError
from manager.host import gpu_cleanup, process
from manager.host.local import Spawned, read_chunk
from manager.launch.engine_key import ENV_NAME
from manager.launch.preflight import HostClaims, Refused, refuse_if_it_cannot_fit
from manager.metrics.gpu import GpuCollector, GpuReport
from manager.metrics.gpu_mask import engine_devices, visible_devices
from manager.metrics.host import HostCollector, HostSample, ProcessTreeSample
from manager.metrics.pools import PoolReport, PoolsReader
from manager.schemas.model_config import ModelConfig
from manager.schemas.offload_profile import OffloadProfile

# What Ray puts in its worker processes' environment that must not reach an engine: a device mask (the
# engine gets its own, in the driver's numbering) and the worker's identity.
_DEVICE_MASKS = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "ONEAPI_DEVICE_SELECTOR")


AGENT_VERSION = "2"  # raise it when a method's signature or meaning changes


def engine_env(inherited: dict[str, str], wanted: dict[str, str]) -> dict[str, str]:
    """The environment an engine gets on a node: the node's, without Ray's per-worker settings and
    without an API key of the node's (the engine asks for its config's, which the manager sends), then
    the command's own (which sets the GPUs it may use, and RAY_ADDRESS for multi-node engines)."""
    kept = {
        key: value
        for key, value in inherited.items()
        if key not in _DEVICE_MASKS and key != ENV_NAME and not (key.startswith("RAY_") and key != "RAY_ADDRESS")
    }
    return {**kept, **wanted}


@dataclass(frozen=True)
class NodeSample:
    """One node at one moment, as its agent read it with the manager's own collectors."""

    host: HostSample
    gpu: GpuReport
    trees: dict[int, ProcessTreeSample]
    pools: dict[str, PoolReport]


class NodeAgent:
    def __init__(self, node_name: str) -> None:
        self.node_name = node_name
        self._host = HostCollector()
        self._gpu: GpuCollector | None = None
        self._pools = PoolsReader.from_plugin()

    def hello(self) -> dict:
        """Who answers: the agent's pid and host (a heartbeat), and the driver's GPUs its node lends
        (its raylet's CUDA_VISIBLE_DEVICES; None: every GPU)."""
        mask = visible_devices()
        return {
            "node": self.node_name,
            "pid": os.getpid(),
            "hostname": socket.gethostname(),
            "gpus_lent": None if mask is None else list(mask),
        }

    def spawn(self, argv: list[str], env: dict[str, str], log_path: str, cwd: str) -> Spawned:
        """Start an engine in a fresh run folder ``cwd`` on this node, writing to ``log_path`` here."""
        shutil.rmtree(cwd, ignore_errors=True)
        Path(cwd).mkdir(parents=True, exist_ok=True)
        try:
            wanted = engine_devices(env, visible_devices())  # the GPUs this node's raylet was given
        except ValueError as exc:
            raise OSError(f"node {self.node_name}: {exc}") from None
        order = {"argv": argv, "env": engine_env(dict(os.environ), wanted), "log_path": log_path, "cwd": cwd}
        done = subprocess.run(
            [sys.executable, "-m", "manager.cluster.launcher"],
            input=json.dumps(order),
            capture_output=True,
            text=True,
            timeout=60,
            # The launcher's own environment is what the engine inherits: without Ray's worker settings.
            env={**engine_env(dict(os.environ), {}), "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)},
        )
        try:
            answer = json.loads(done.stdout.strip().splitlines()[-1])
        except (IndexError, ValueError):
            raise OSError(
                f"the engine launcher on node {self.node_name} failed: {done.stderr.strip()[-500:]}"
            ) from None
        if "error" in answer:
            raise OSError(answer["error"])
        return Spawned(int(answer["pid"]), answer["create_time"], tuple(answer["cmdline"]))

    def alive(self, pid: int, create_time: float | None, cmdline: tuple[str, ...]) -> bool:
        return processes.matches(pid, create_time, cmdline)

    def stop_group(self, pid: int, grace_s: float) -> process.StopReport:
        return process.stop_group(pid, grace_s)

    def end_gpu_orphans(self, gpus: list[int], pids: list[int]) -> list[str]:
        return gpu_cleanup.end_gpu_orphans(gpus, pids)

    def remove_stale_offload_files(self) -> list[str]:
        return processes.remove_stale_offload_files()

    def check_fit(self, config: dict, profile: dict | None, claims: HostClaims) -> Refused | None:
        """The planner's pre-start check with this node's GPUs and RAM: None when the config fits, else
        the refusal (with the sleepers to stop when only sleeping workers' host RAM is in the way)."""
        try:
            refuse_if_it_cannot_fit(
                ModelConfig.model_validate(config),
                OffloadProfile.model_validate(profile) if profile is not None else None,
                False,
                claims,
            )
        except Invalid as exc:
            return Refused.of(exc)
        except ManagerError as exc:
            return Refused(exc.message)
        return None

    def read_log(self, path: str, offset: int) -> bytes:
        return read_chunk(Path(path), offset)

    def sample(self, workers: dict[str, tuple[int, str]]) -> NodeSample:
        """The node's host and GPUs, and for each worker id -> (engine pid, run dir) its process tree
        and pool statistics, read as the head reads its own."""
        if self._gpu is None:
            self._gpu = GpuCollector()
        roots = {pid: wid for wid, (pid, _) in workers.items()}
        trees = self._host.process_trees(roots)
        pid_to_worker = {pid: roots[root] for root, tree in trees.items() for pid in tree.pids}
        pools = {
            wid: self._pools.sample(Path(run_dir))
            for wid, (pid, run_dir) in workers.items()
            if trees.get(pid) and trees[pid].alive
        }
        return NodeSample(self._host.sample(), self._gpu.sample(pid_to_worker), trees, pools)
