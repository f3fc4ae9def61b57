"""Where a start runs: the planner's check on each node a start may use, and the host RAM the other
workers there hold. The choice among nodes is ``placement.start_node``'s; this module asks the
questions it needs answered (this box's planner, or a node's agent) and turns its answer into the
refusal a caller acts on.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

from sqlmodel import Session

from manager.cluster.nodes import NodeState, spans_nodes
from manager.errors import Invalid, NotFound, WaitsForNodes
from manager.launch.command import sleep_pool_on
from manager.launch.preflight import (
    HostClaims,
    HostRamHeldBySleepers,
    Refused,
    Sleeper,
    host_bytes_of,
    sleeper_host_bytes,
)
from manager.metrics.pools import PoolsReader, launched_with_sleep_pool
from manager.placement import Candidate, CannotFit, NodeCheck, Place, sleep_level_of, start_node, start_order
from manager.schemas.model_config import ModelConfig
from manager.schemas.offload_profile import OffloadProfile
from manager.services import models
from manager.supervisor.runner import WorkerRunner
from manager.supervisor.worker_state import State

if TYPE_CHECKING:
    from manager.cluster.ray_cluster import RayCluster

# Refuses a start that cannot fit: (config, its profile, force, the host RAM other workers hold, whether
# its model is still to be downloaded, so planned from the hub).
Preflight = Callable[[ModelConfig, OffloadProfile | None, bool, HostClaims, bool], None]


class StartPlacement:
    """The node each start runs on, after the planner's check there."""

    def __init__(
        self,
        preflight: Preflight | None,
        cluster: RayCluster | None,
        runners: Callable[[], Iterable[WorkerRunner]],
        runner_of: Callable[[int], WorkerRunner | None],
        pools: PoolsReader,
    ) -> None:
        self.preflight = preflight
        self._cluster = cluster
        self._runners = runners  # every active or stopped worker's runner
        self._runner_of = runner_of  # a worker's runner, also one whose first start is not under way yet
        self._pools = pools
        self._preferred: dict[str, str] = {}  # model config -> the node its next start tries first

    def prefer(self, model: str, node: str | None) -> None:
        """The node the front door made room on (or found room on) for ``model``: its next start tries
        that node first, if the planner's check there agrees."""
        if self._cluster is not None and node is not None:
            self._preferred[model] = node

    def place(
        self,
        db: Session,
        worker_id: int,
        config: ModelConfig,
        profile: OffloadProfile | None,
        force: bool,
        fetching: bool = False,
    ) -> str | None:
        """The node a start runs on, after the planner's check there: the config's node, else the
        first live node that fits (the one it ran on before first). Invalid naming each node's refusal;
        HostRamHeldBySleepers, for the first node where only sleeping workers' host RAM is in the way,
        so that the caller may stop some of them there and try again. ``fetching``: its model is
        downloaded first (on this machine), and planned from the hub until then."""
        cluster = self._cluster
        if cluster is None:
            if config.node:
                raise Invalid(
                    f"model config {config.name} asks for node {config.node!r}, but this manager runs without a Ray "
                    "cluster: start it with --ray-address, or clear the config's node",
                    field="node",
                )
            if self.preflight is not None:
                self.preflight(config, profile, force, self.host_claims(db, worker_id), fetching)
            return None
        if spans_nodes(config.tensor_parallel_size, config.extra_args, cluster.most_gpus()):
            # vLLM's Ray executor places the model's GPU workers across the cluster itself and the API
            # server runs here; each GPU must still hold its share, planned on the biggest node's GPUs.
            # Too few GPUs in all was refused before this, forced or not (check_gpus_known): vLLM would
            # wait for them until the start timed out.
            self._plan_per_gpu(db, worker_id, config, profile, force)
            return cluster.local_name
        runner = self._runner_of(worker_id)
        previous = runner.node if runner is not None else None
        # The start's own node (this start only: a later move may go anywhere that fits), else the config's.
        wanted = (runner.take_wanted_node() if runner is not None else None) or config.node
        if wanted:
            names = cluster.resolve(wanted)
            if not names:
                raise WaitsForNodes(f"node {wanted!r} is lost: wait until it is back", field="node")
        else:
            names = cluster.alive_names()
        preferred = self._preferred.pop(config.name, None)
        order = start_order(
            Candidate(name, name == preferred, name == previous, cluster.is_local(name), self._load_on(name))
            for name in names
        )
        refusals: dict[str, Refused] = {}

        def checks() -> Iterator[NodeCheck]:
            for name in order:
                try:
                    refused = self._refusal_on(name, self.host_claims(db, worker_id, node=name), config, profile, force)
                except OSError as exc:
                    refused = Refused(str(exc))
                if refused is None:
                    yield NodeCheck(name)
                    continue
                refusals[name] = refused
                yield NodeCheck(name, refused.message, held_by_sleepers=refused.short_bytes is not None)

        decision = start_node(config.name, checks())
        if isinstance(decision, Place):
            return decision.node
        if isinstance(decision, CannotFit):
            raise Invalid(decision.reason, field="node", nodes=[f"{n}: {why}" for n, why in decision.per_node])
        held = refusals[decision.node]
        assert held.short_bytes is not None
        raise HostRamHeldBySleepers(decision.reason, held.short_bytes, held.sleepers, node=decision.node)

    def _plan_per_gpu(
        self, db: Session, worker_id: int, config: ModelConfig, profile: OffloadProfile | None, force: bool
    ) -> None:
        """The plan of one GPU's share of a model that spans nodes (tensor parallel ranks: the weights,
        KV cache and overheads of one rank), on a GPU of the node with the most of them."""
        assert self._cluster is not None
        if force:
            return
        biggest = max(
            (s for s in self._cluster.statuses() if s.state == NodeState.ALIVE), key=lambda s: (s.ray.gpus, s.local)
        )
        claims = self.host_claims(db, worker_id, node=biggest.name)
        try:
            refused = self._refusal_on(biggest.name, claims, config, profile, force)
        except OSError as exc:
            raise Invalid(f"{config.name} spans nodes, and node {biggest.name} could not plan it: {exc}") from exc
        if refused is not None:
            raise Invalid(
                f"{config.name} spans nodes; one GPU's share does not fit on {biggest.name}'s GPUs: {refused.message}",
                field="model",
            )

    def _refusal_on(
        self, node: str, claims: HostClaims, config: ModelConfig, profile: OffloadProfile | None, force: bool
    ) -> Refused | None:
        """The planner's pre-start check of ``config`` on ``node``, with that node's GPUs and RAM: its
        refusal, or None when it fits. OSError when the node does not answer."""
        assert self._cluster is not None
        if self._cluster.is_local(node):
            if self.preflight is not None:
                try:
                    self.preflight(config, profile, force, claims, False)
                except Invalid as exc:
                    return Refused.of(exc)
            return None
        if force:
            return None
        refused: Refused | None = self._cluster.agent_call(
            node, "check_fit", config.model_dump(), profile.model_dump() if profile is not None else None, claims
        )
        return refused

    def _load_on(self, node: str) -> int:
        return sum(1 for r in self._runners() if r.node == node and r.life.active)

    def host_claims(self, db: Session, worker_id: int | None, node: str | None = None) -> HostClaims:
        """Host RAM the active workers other than ``worker_id`` hold on ``node`` (None: this box): their
        offload profiles' claims, their sleep pools, and what sleepers keep."""
        profile_bytes = 0
        pool_bytes = 0
        sleepers = []
        for runner in sorted(self._runners(), key=lambda r: r.id):
            life = runner.life
            if runner.id == worker_id or not life.active or runner.node != node:
                continue
            try:
                config = models.get_model(db, life.model)
            except NotFound:
                continue
            profile = models.profile_of(db, config)
            profile_bytes += host_bytes_of(profile)
            launched = launched_with_sleep_pool(self._pools.sample(runner.run_dir))
            pooled = sleep_pool_on(config, profile) if launched is None else launched
            # Waking, it holds the RAM until its weights are back on the GPU.
            if life.state in (State.SLEEPING, State.WAKING):
                level = sleep_level_of(life.sleep_level, config.sleep_level)
                held = sleeper_host_bytes(config, profile, pooled=pooled, level=level)
                sleepers.append(Sleeper(runner.id, life.model, level, held))
            elif pooled:
                pool_bytes += sleeper_host_bytes(config, profile, pooled=True) or 0
        own = self._runner_of(worker_id) if worker_id is not None else None
        engine = own.life.engine if own is not None and own.node == node else None
        replaced = (engine.pid, engine.create_time, engine.cmdline) if engine is not None else None
        return HostClaims(profile_bytes, tuple(sleepers), pool_bytes, replaced)
