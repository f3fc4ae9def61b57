"""The Ray cluster as the manager sees it: the connection, one agent per node, a heartbeat that
samples every node once a second and says which are alive or lost, and the process host of each.

Ray is imported only here (and only when the manager is started with a Ray address): without one the
manager is the single-box program it always was.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from manager.cluster import nodes as n
from manager.cluster.agent import AGENT_VERSION, NodeAgent, NodeSample
from manager.errors import Invalid
from manager.host import process
from manager.host.local import LocalHost, ProcessHost, Spawned
from manager.metrics.collector import RemoteReading

log = logging.getLogger("vllm_manager.cluster")

NAMESPACE = "vllm-manager"
# The agent's version is in its name: a manager of another version makes its own agents instead of
# calling methods an older agent (detached, so still alive) may not have.
AGENT_NAME = "vllm-manager-agent-{version}-{node_id}"
CONNECT_TIMEOUT_S = 30.0
CALL_TIMEOUT_S = 10.0  # an agent call; a stop waits for its grace period on top
HEARTBEAT_S = 1.0
# Ray leaves CUDA_VISIBLE_DEVICES alone in a worker whose environment has this set.
NOSET_CUDA_MASK = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"
LOST_AFTER_S = 5.0  # an agent that has not answered this long: its node is lost

# Called with (node name, its new state) when a node is lost or comes back.
Listener = Callable[[str, n.NodeState], Awaitable[None]]
# The workers on a node: node name -> {worker id: (engine pid, run dir)}, for its agent's sample.
WorkersOn = Callable[[str], dict[str, tuple[int, str]]]


class RayUnreachable(Exception):
    """The Ray address given at start does not answer; the message says which and what to do."""


class NodeUnreachable(OSError):
    """A call to a node's agent failed or timed out: whether the engine lives is not known."""


def connect(address: str, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """Join the cluster at ``address`` ("auto", or host:port of the head's GCS) as a driver.

    ``ray.init`` waits minutes on an address that does not answer: a plain TCP connect says so
    first, and the whole join is bounded by ``timeout_s``.
    """
    if address != "auto":
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise RayUnreachable(
                f"the Ray address must be host:port (the head's GCS, port 6379 by default), got {address!r}"
            )
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=5):
                pass
        except OSError as exc:
            raise RayUnreachable(
                f"nothing answers at the Ray address {address} ({exc.strerror or exc}): start the head with "
                "`ray start --head` there, or give the right address (--ray-address / VLLM_MANAGER_RAY_ADDRESS)"
            ) from exc
    import ray

    failure: list[BaseException] = []

    def join() -> None:
        try:
            ray.init(address=address, namespace=NAMESPACE, log_to_driver=False, logging_level=logging.WARNING)
        except BaseException as exc:  # reported to the caller below
            failure.append(exc)

    thread = threading.Thread(target=join, daemon=True, name="ray-connect")
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise RayUnreachable(f"the Ray cluster at {address} did not accept this manager within {timeout_s:g} s")
    if failure:
        raise RayUnreachable(f"cannot join the Ray cluster at {address}: {failure[0]}")


@dataclass
class NodeStatus:
    name: str
    ray: n.RayNode
    state: n.NodeState = n.NodeState.ALIVE
    agent: Any = None
    last_answer: float | None = None
    sample: NodeSample | None = None
    pending: Any = None  # the sample asked for and not answered yet (one at a time per node)
    error: str | None = None
    local: bool = False  # the manager's own node: its engines are started directly
    since: float = field(default_factory=time.time)


class RayCluster:
    def __init__(self, address: str, workers_on: WorkersOn | None = None) -> None:
        import ray

        self._ray = ray
        self.address = address
        self.workers_on: WorkersOn = workers_on or (lambda name: {})
        self.local = LocalHost()
        self._local_id = ray.get_runtime_context().get_node_id()
        self._gcs_address = ray.get_runtime_context().gcs_address
        self._nodes: dict[str, NodeStatus] = {}
        self._lock = threading.Lock()
        self._listeners: list[Listener] = []
        self._task: asyncio.Task[None] | None = None
        self._first = True
        self.refresh()  # the nodes are known before the supervisor adopts anything
        self.local.node = self.local_name

    # ---- what the rest of the manager asks -----------------------------------------------------
    @property
    def local_name(self) -> str:
        for status in self._nodes.values():
            if status.local:
                return status.name
        return "head"

    def statuses(self) -> list[NodeStatus]:
        with self._lock:
            return sorted(self._nodes.values(), key=lambda s: (not s.local, s.name))

    def alive_names(self) -> list[str]:
        return [s.name for s in self.statuses() if s.state == n.NodeState.ALIVE]

    def is_alive(self, name: str) -> bool:
        status = self._nodes.get(name)
        return status is not None and status.state == n.NodeState.ALIVE

    def resolve(self, wanted: str) -> list[str]:
        """The names of the live nodes that a config's ``node`` picks; Invalid naming the nodes there
        are when none is called so."""
        with self._lock:
            by_name = {name: s.ray for name, s in self._nodes.items()}
        found = n.matching(by_name, wanted)
        if not found:
            raise Invalid(n.unknown_node(wanted, by_name), field="node", nodes=sorted(by_name))
        return [name for name in found if self.is_alive(name)]

    def is_local(self, name: str) -> bool:
        status = self._nodes.get(name)
        return status is not None and status.local

    def host(self, name: str) -> ProcessHost:
        """The box ``name`` is; a node not in the cluster now answers every call with NodeUnreachable."""
        return self.local if self.is_local(name) else RayHost(self, name)

    def remote_readings(self) -> list[RemoteReading]:
        """The other nodes' latest samples, for the metrics collector's snapshot."""
        return [
            RemoteReading(s.name, s.state.value, s.sample if s.state == n.NodeState.ALIVE else None)
            for s in self.statuses()
            if not s.local
        ]

    def spans_of(self, engines: dict[int, set[int]]) -> dict[int, list[n.Span]]:
        """For each worker id -> its engine's process tree pids: the nodes and GPUs it reserved through
        vLLM's Ray executor (empty for an engine on one node only). Ray's tables are read once for
        all; nothing when they cannot be read."""
        if not engines:
            return {}
        try:
            from ray._private.state import state as ray_state  # the GCS job table: drivers' pids

            groups = self._ray.util.placement_group_table()
            jobs = ray_state.job_table()
        except Exception:
            log.warning("could not read Ray's placement groups", exc_info=True)
            return {}
        names = {s.ray.node_id: s.name for s in self.statuses()}
        return {wid: n.spans(groups, jobs, pids, names) for wid, pids in engines.items()}

    def most_gpus(self) -> int:
        """The GPUs of the biggest live node (a model needing more spans nodes)."""
        return max((s.ray.gpus for s in self.statuses() if s.state == n.NodeState.ALIVE), default=0)

    def engine_address(self, name: str) -> str:
        status = self._nodes.get(name)
        if status is None or status.local:
            return self.local.address
        return status.ray.address

    def ray_env(self) -> dict[str, str]:
        """What an engine needs to join this cluster (vLLM's Ray executor, for multi-node models)."""
        return {"RAY_ADDRESS": self._gcs_address}

    def agent_call(self, name: str, method: str, *args: Any, timeout: float = CALL_TIMEOUT_S) -> Any:
        status = self._nodes.get(name)
        if status is None or status.agent is None:
            raise NodeUnreachable(f"node {name} has no agent (it is lost or not part of the cluster)")
        try:
            return self._ray.get(getattr(status.agent, method).remote(*args), timeout=timeout)
        except self._ray.exceptions.RayTaskError as exc:
            # The agent's own error (an engine that cannot be started, say): its message, not Ray's wrapping.
            cause = exc.cause
            if isinstance(cause, OSError):
                raise OSError(str(cause)) from None
            raise NodeUnreachable(f"node {name}: {type(cause).__name__}: {cause}") from None
        except Exception as exc:  # timeouts, a dead actor or node: the node did not answer
            raise NodeUnreachable(f"node {name} did not answer ({type(exc).__name__})") from exc

    def on_change(self, listener: Listener) -> None:
        self._listeners.append(listener)

    # ---- the heartbeat -----------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.create_task(self._beat(), name="cluster-heartbeat")

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _beat(self) -> None:
        while True:
            started = time.monotonic()
            try:
                changes = await asyncio.to_thread(self.refresh)
            except Exception:
                log.exception("cluster heartbeat failed")
                changes = []
            for name, state in changes:
                for listener in self._listeners:
                    try:
                        await listener(name, state)
                    except Exception:
                        log.exception("a listener of node %s failed", name)
            await asyncio.sleep(max(0.05, HEARTBEAT_S - (time.monotonic() - started)))

    def refresh(self) -> list[tuple[str, n.NodeState]]:
        """Read the node table, make sure each live node has its agent, sample every node through it,
        and return the nodes whose state changed."""
        ray = self._ray
        listed = n.from_ray(ray.nodes())
        now = time.monotonic()
        with self._lock:
            known = dict(self._nodes)
        current = n.keep_vanished(
            n.current_nodes(listed), {name: s.ray for name, s in known.items()}, {node.node_id for node in listed}
        )
        statuses: dict[str, NodeStatus] = {}
        for name, node in current.items():
            status = known.get(name)
            if status is None or status.ray.node_id != node.node_id:
                status = NodeStatus(name, node, local=node.node_id == self._local_id)
                status.last_answer = now if node.alive else None
            status.ray = node
            if node.alive and status.agent is None:
                status.agent = self._agent(node, name)
            statuses[name] = status
        pending = {}
        for name, status in statuses.items():
            if status.agent is not None and status.ray.alive:
                # A slow sample is waited for, not asked again: asks must not pile up behind it.
                if status.pending is None:
                    status.pending = status.agent.sample.remote(self.workers_on(name))
                pending[name] = status.pending
        if pending:
            ready, _ = ray.wait(list(pending.values()), num_returns=len(pending), timeout=2.0)
            done = set(ready)
            for name, ref in pending.items():
                status = statuses[name]
                if ref not in done:
                    status.error = "no answer within 2 s"
                    continue
                status.pending = None
                try:
                    status.sample = ray.get(ref, timeout=0)
                    status.last_answer = now
                    status.error = None
                except Exception as exc:
                    status.error = f"{type(exc).__name__}: {exc}"[:300]
                    if isinstance(exc, ray.exceptions.RayTaskError):
                        status.last_answer = now  # the agent's own code failed: the node is there
                    elif isinstance(exc, ray.exceptions.RayActorError):
                        status.agent = None  # made again on the next beat, if the node is alive
        changes = []
        for name, status in statuses.items():
            # The manager's own box is never lost for want of its agent's answer: only Ray can say so.
            last_answer = None if status.local else status.last_answer
            state = n.state_of(status.ray.alive, last_answer, now, LOST_AFTER_S)
            # A node first seen after the manager started counts as come back: workers stored as lost
            # there (a manager restart while it was away) are then looked for.
            unseen = n.NodeState.ALIVE if self._first else n.NodeState.LOST
            previous = known[name].state if name in known else unseen
            if state != status.state or state != previous:
                status.state = state
                status.since = time.time()
                if state != previous:
                    changes.append((name, state))
                    log.warning("node %s is %s", name, state.value)
            if state == n.NodeState.LOST and not status.ray.alive:
                status.agent = None
                status.pending = None
        with self._lock:
            self._nodes = statuses
        self._first = False
        return changes

    def _agent(self, node: n.RayNode, name: str) -> Any:
        ray = self._ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        actor = ray.remote(NodeAgent)
        try:
            return actor.options(
                name=AGENT_NAME.format(version=AGENT_VERSION, node_id=node.node_id),
                namespace=NAMESPACE,
                lifetime="detached",  # it outlives a manager restart, as the engines it started do
                get_if_exists=True,
                num_cpus=0,
                max_concurrency=8,  # a long stop must not hold up the heartbeat
                scheduling_strategy=NodeAffinitySchedulingStrategy(node.node_id, soft=False),
                # The agent keeps its raylet's CUDA_VISIBLE_DEVICES (the GPUs the node lends), which Ray
                # would otherwise empty for an actor that asks for no GPU.
                runtime_env={"env_vars": {NOSET_CUDA_MASK: "1"}},
            ).remote(name)
        except Exception:
            log.exception("could not start the agent on node %s", name)
            return None

    def close(self) -> None:
        """Leave the cluster; the agents stay (detached), with the engines they started."""
        with contextlib.suppress(Exception):
            self._ray.shutdown()


class RayHost:
    """A node's engines, reached through its agent."""

    def __init__(self, cluster: RayCluster, node: str) -> None:
        self.cluster = cluster
        self.name = node
        self.node: str | None = node
        self.address = cluster.engine_address(node)

    def spawn(self, argv: list[str], env: dict[str, str], log_path: Path, cwd: Path) -> Spawned:
        spawned: Spawned = self.cluster.agent_call(self.name, "spawn", argv, env, str(log_path), str(cwd), timeout=70)
        return spawned

    def alive(self, pid: int, create_time: float | None, cmdline: tuple[str, ...]) -> bool:
        return bool(self.cluster.agent_call(self.name, "alive", pid, create_time, cmdline))

    def exit_code(self, pid: int) -> int | None:
        return None  # the launcher, not the agent, is the engine's parent: its code is not known

    def stop_group(self, pid: int, grace_s: float) -> process.StopReport:
        result: process.StopReport = self.cluster.agent_call(
            self.name, "stop_group", pid, grace_s, timeout=grace_s + 30
        )
        return result

    def end_gpu_orphans(self, gpus: list[int], pids: list[int]) -> list[str]:
        return list(self.cluster.agent_call(self.name, "end_gpu_orphans", gpus, pids))

    def remove_stale_offload_files(self) -> list[str]:
        return list(self.cluster.agent_call(self.name, "remove_stale_offload_files"))

    def read_log(self, path: Path, offset: int) -> bytes:
        return bytes(self.cluster.agent_call(self.name, "read_log", str(path), offset))


def local_only(host: ProcessHost) -> bool:
    return isinstance(host, LocalHost)
