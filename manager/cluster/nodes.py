"""The boxes of a Ray cluster as the manager names them, and the rules that say which are usable.

Pure functions over what Ray reports (``ray.nodes()``) and what the manager's own heartbeat saw;
no Ray import here, so the rules are tested without a cluster.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from manager.schemas.engine_values import data_parallel_backend, parallel_size

# `ray start --labels '{"vllm-manager/node": "box2"}'` names a node; otherwise its hostname does.
NODE_LABEL = "vllm-manager/node"
# Ray's own resources and labels: never a user's placement label.
_RAY_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory", "accelerator_type:")


class NodeState(StrEnum):
    ALIVE = "alive"
    LOST = "lost"  # Ray says it is dead, or its agent has not answered for a while


@dataclass(frozen=True)
class RayNode:
    """One entry of ``ray.nodes()``, the fields the manager uses."""

    node_id: str
    hostname: str
    address: str
    alive: bool
    resources: dict[str, float] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)

    @property
    def is_head(self) -> bool:
        return "node:__internal_head__" in self.resources

    @property
    def gpus(self) -> int:
        return int(self.resources.get("GPU", 0))

    @property
    def custom_resources(self) -> list[str]:
        return sorted(
            key for key in self.resources if not key.startswith("node:") and not key.startswith(_RAY_RESOURCES)
        )


def from_ray(entries: list[dict]) -> list[RayNode]:
    """``ray.nodes()`` as records (entries without an id are skipped)."""
    nodes = []
    for entry in entries:
        node_id = entry.get("NodeID")
        if not node_id:
            continue
        nodes.append(
            RayNode(
                node_id=node_id,
                hostname=str(entry.get("NodeManagerHostname") or ""),
                address=str(entry.get("NodeManagerAddress") or ""),
                alive=bool(entry.get("Alive")),
                resources={k: float(v) for k, v in (entry.get("Resources") or {}).items()},
                labels={k: str(v) for k, v in (entry.get("Labels") or {}).items() if not k.startswith("ray.io/")},
            )
        )
    return nodes


def node_name(node: RayNode) -> str:
    """The name users see and configs store: the node's label, else its hostname, else its address."""
    return node.labels.get(NODE_LABEL) or node.hostname or node.address or node.node_id[:12]


def current_nodes(nodes: list[RayNode]) -> dict[str, RayNode]:
    """One node per name. A box whose raylet came back is a new Ray node under the same name: the
    live one wins over the dead entries Ray still lists. Two live nodes under one name (two raylets on
    one host, no labels) keep them apart by a short node id."""
    by_name: dict[str, RayNode] = {}
    live_names = [node_name(n) for n in nodes if n.alive]
    for node in sorted(nodes, key=lambda n: (not n.alive, n.node_id)):
        name = node_name(node)
        if node.alive and live_names.count(name) > 1:
            name = f"{name}-{node.node_id[:6]}"
        if name not in by_name:
            by_name[name] = node
    return by_name


def keep_vanished(current: dict[str, RayNode], known: dict[str, RayNode], listed: set[str]) -> dict[str, RayNode]:
    """``current`` with the ``known`` nodes whose Ray node id is no longer ``listed`` in ``ray.nodes()``
    at all (the head's node table restarted or dropped them) kept as dead entries, without their
    resources, as Ray lists a dead node: they stay lost until a node of that name joins again, and the
    workers stored there wait for them instead of being forgotten."""
    kept = dict(current)
    for name, node in known.items():
        if name not in kept and node.node_id not in listed:
            kept[name] = RayNode(node.node_id, node.hostname, node.address, alive=False, labels=node.labels)
    return kept


def matching(nodes: dict[str, RayNode], wanted: str) -> list[str]:
    """Names of the nodes a config's ``node`` picks: a name, hostname, address, Ray node id (or its
    first 8+ characters), a custom resource, or a label value."""
    wanted = wanted.strip()
    found = []
    for name, node in nodes.items():
        if (
            wanted in (name, node.hostname, node.address, node.node_id)
            or (len(wanted) >= 8 and node.node_id.startswith(wanted))
            or wanted in node.custom_resources
            or wanted in node.labels.values()
        ):
            found.append(name)
    return found


def unknown_node(wanted: str, nodes: dict[str, RayNode]) -> str:
    known = ", ".join(sorted(nodes)) or "none"
    return (
        f"no node of the Ray cluster is called {wanted!r}; the nodes are: {known} (a node is picked by its name, "
        "hostname, address, Ray node id, a custom resource or a label value)"
    )


def state_of(ray_alive: bool, last_answer: float | None, now: float, lost_after_s: float) -> NodeState:
    """A node is lost when Ray says so, or when its agent has not answered for ``lost_after_s``: Ray
    itself takes 15 s or more to declare a killed raylet dead."""
    if not ray_alive:
        return NodeState.LOST
    if last_answer is not None and now - last_answer > lost_after_s:
        return NodeState.LOST
    return NodeState.ALIVE


def spread_gpus(tensor_parallel_size: int, extra_args: list[str]) -> int:
    """The GPUs of one engine that vLLM's Ray executor may place on several nodes: tensor x pipeline
    parallel size, times the data parallel size where Ray starts those ranks too
    (``--data-parallel-backend ray``; by default vLLM starts them all on its own node)."""
    gpus = tensor_parallel_size * parallel_size(extra_args, "pipeline")
    if data_parallel_backend(extra_args) == "ray":
        gpus *= parallel_size(extra_args, "data")
    return gpus


def spans_nodes(tensor_parallel_size: int, extra_args: list[str], most_gpus_on_a_node: int) -> bool:
    """A model whose engine needs more GPUs than the biggest node has is spread over several nodes by
    vLLM's own Ray executor (a cluster without GPUs has nothing to span)."""
    return most_gpus_on_a_node > 0 and spread_gpus(tensor_parallel_size, extra_args) > most_gpus_on_a_node


@dataclass(frozen=True)
class Span:
    """Part of a model spread over nodes by vLLM's Ray executor: a node and the GPUs it holds there."""

    node: str
    gpus: int
    bundles: int


def spans(
    placement_groups: dict[str, dict], jobs: list[dict], engine_pids: set[int], names: dict[str, str]
) -> list[Span]:
    """Where an engine's Ray workers run. vLLM's Ray executor joins the cluster as a driver from the
    engine's process tree and reserves a placement group (a bundle per GPU worker); a placement group's
    id ends with its job's id. ``names``: Ray node id -> node name."""
    job_ids = {
        str(job.get("JobID") or "")
        for job in jobs
        if job.get("DriverPid") in engine_pids and not job.get("IsDead") and job.get("JobID")
    }
    per_node: dict[str, list[float]] = {}
    for pg_id, group in placement_groups.items():
        if group.get("state") != "CREATED" or not any(job and pg_id.endswith(job) for job in job_ids):
            continue
        for index, node_id in (group.get("bundles_to_node_id") or {}).items():
            bundle = (group.get("bundles") or {}).get(index) or {}
            per_node.setdefault(names.get(node_id, node_id[:12]), []).append(float(bundle.get("GPU", 0)))
    return [Span(node, int(sum(gpus)), len(gpus)) for node, gpus in sorted(per_node.items())]
