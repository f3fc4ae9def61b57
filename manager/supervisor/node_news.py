"""The nodes of a cluster as the supervisor sees them: each node's card, and what a node's loss or
return means for the workers on it and the engines left behind there.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Iterable
from typing import TYPE_CHECKING, Any

from manager.cluster.nodes import NodeState
from manager.cluster.views import NodeView, node_view, this_box
from manager.host import process
from manager.host.local import LocalHost, ProcessHost
from manager.metrics.gpu import GpuReport
from manager.metrics.host import HostSample
from manager.supervisor.events import EventLog
from manager.supervisor.runner import WorkerRunner
from manager.supervisor.worker_events import NodeBack, NodeLost, SpanNodeLost
from manager.supervisor.worker_state import Engine, State

if TYPE_CHECKING:
    from manager.cluster.ray_cluster import RayCluster


def node_views(
    cluster: RayCluster | None, runners: list[WorkerRunner], host: HostSample | None, gpu: GpuReport | None
) -> list[NodeView]:
    """Each node with its figures and workers; without a cluster, this box (``host``, ``gpu``: the
    latest local readings)."""
    if cluster is None:
        return [this_box(host, gpu, sorted(r.id for r in runners))]
    engines = {
        r.id: set(process.tree(r.life.engine.pid))
        for r in runners
        if r.life.engine is not None and r.life.active and isinstance(r.host, LocalHost)
    }
    spanned: dict[str, dict[int, int]] = {}
    for worker_id, worker_spans in cluster.spans_of(engines).items():
        for span in worker_spans:
            spanned.setdefault(span.node, {})[worker_id] = span.gpus
    views = []
    for status in cluster.statuses():
        sample = status.sample
        views.append(
            node_view(
                name=status.name,
                node_id=status.ray.node_id,
                hostname=status.ray.hostname,
                address=status.ray.address,
                state=status.state.value,
                here=status.local,
                since=status.since,
                error=status.error,
                host=sample.host if sample else None,
                gpu=sample.gpu if sample else None,
                workers=sorted(r.id for r in runners if r.node == status.name),
                spanned_by=spanned.get(status.name, {}),
            )
        )
    return views


class NodeNews:
    """Tells the workers of a node that was lost or is back, and ends the engines left on it."""

    def __init__(
        self,
        events: EventLog,
        runners: Callable[[], Iterable[WorkerRunner]],
        host_of: Callable[[str], ProcessHost],
        can_move: Callable[[str], bool],
        spans_nodes: Callable[[str], bool],
        stop_grace_s: float,
    ) -> None:
        self._events = events
        self._runners = runners
        self._host_of = host_of
        self._can_move = can_move  # whether a model config may run on another node
        self._spans_nodes = spans_nodes  # whether a model config needs GPUs of more than one node
        self._stop_grace_s = stop_grace_s
        self._orphans: dict[str, list[Engine]] = {}  # engines on lost nodes that no worker holds now
        self._background: set[asyncio.Task[Any]] = set()  # news of a node, on its way to each worker

    def workers_on(self, node: str) -> dict[str, tuple[int, str]]:
        """The engines on ``node`` (worker id -> pid, run folder), for its agent's sample."""
        return {
            str(r.id): (r.life.engine.pid, str(r.run_dir))
            for r in self._runners()
            if r.node == node and r.life.engine is not None
        }

    def abandon(self, node: str, engine: Engine) -> None:
        """An engine on a lost node that no worker holds any more: ended when the node is back."""
        self._orphans.setdefault(node, []).append(engine)
        self._events.record(
            "orphaned", f"the engine pid {engine.pid} on lost node {node} is ended when the node comes back"
        )

    async def changed(self, node: str, state: NodeState) -> None:
        """A node was lost or is alive (again): tell its workers, and end what was left behind there.

        Each worker is told through its own queue without waiting for it: a runner busy with a long
        stop or start must not hold up the heartbeat, and it decides for itself when it gets there
        (a worker stopped or moved meanwhile ignores the news)."""
        runners = [r for r in self._runners() if r.node == node]
        if state == NodeState.LOST:
            self._events.record("node_lost", f"node {node} is lost", None, node=node)
            for runner in runners:
                if runner.life.active and runner.life.state != State.LOST:
                    event = NodeLost(node, can_move=self._can_move(runner.life.model))
                    self._in_background(runner.send("event", event=event))
            # Models spanning nodes, wherever their engine runs: a start under way may be waiting in Ray
            # for that node's GPUs. Each is told, whatever its state now, and decides when it gets to
            # the news: a launch being carried out right now is a start by then.
            others = [r for r in self._runners() if r.node != node]
            spanning = {model for model in {r.life.model for r in others} if self._spans_nodes(model)}
            for runner in others:
                if runner.life.model in spanning:
                    self._in_background(runner.send("event", event=SpanNodeLost(node)))
            return
        self._events.record("node_back", f"node {node} is alive", None, node=node)
        self._in_background(self._end_orphans(node))
        for runner in runners:
            if runner.life.state == State.LOST:
                self._in_background(runner.send("node_back"))
        # Workers on any node whose restart the live nodes could not hold (a model spanning nodes
        # that lost one of them): the node back may be what they wait for. Every worker is told, and
        # decides when it gets to the news: a restart refused right now is waiting by then.
        for runner in self._runners():
            self._in_background(runner.send("event", event=NodeBack()))

    async def _end_orphans(self, node: str) -> None:
        host = self._host_of(node)
        for left in self._orphans.pop(node, []):
            try:
                if await asyncio.to_thread(host.alive, left.pid, left.create_time, left.cmdline):
                    await asyncio.to_thread(host.stop_group, left.pid, self._stop_grace_s)
                    self._events.record("orphan_stopped", f"stopped engine pid {left.pid} left on node {node}")
            except OSError:
                self._orphans.setdefault(node, []).append(left)  # tried again when the node is next back

    def _in_background(self, work: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
