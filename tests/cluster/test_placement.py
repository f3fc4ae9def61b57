"""Which node a start runs on: the planner's check on each live node, with that node's figures.

The nodes here have GPUs, which this machine lacks: each node's answer to the planner's check (what
its agent says) is given, the choice among them is the supervisor's own code.
"""

from __future__ import annotations

import httpx
import pytest

from manager.db import make_engine, migrate, session
from manager.errors import Invalid, WaitsForNodes
from manager.host.local import LocalHost
from manager.launch.preflight import HostRamHeldBySleepers, Refused, Sleeper
from manager.schemas.model_config import ModelConfig
from manager.supervisor.supervisor import Supervisor


class Nodes:
    """A cluster of GPU boxes as the supervisor sees it: each remote node's planner answer is set."""

    def __init__(self, answers: dict[str, str | Refused | None], gpus: int = 8) -> None:
        self.answers = answers  # node -> the planner's refusal there (None: it fits)
        self.gpus = gpus
        self.local = LocalHost("head")
        self.local_name = "head"
        self.asked: list[str] = []
        self.workers_on = None

    def on_change(self, listener) -> None:
        pass

    def alive_names(self) -> list[str]:
        return ["head", *self.answers]

    def resolve(self, wanted: str) -> list[str]:
        if wanted not in self.alive_names():
            raise Invalid(f"no node of the Ray cluster is called {wanted!r}; the nodes are: {self.alive_names()}")
        return [wanted]

    def is_local(self, name: str) -> bool:
        return name == "head"

    def statuses(self) -> list:
        """Each node with its GPUs: the head has ``head_gpus``, the others ``gpus``."""
        from types import SimpleNamespace

        from manager.cluster.nodes import NodeState

        gpus = getattr(self, "statuses_gpus", {})
        lost = getattr(self, "lost", [])
        return [
            SimpleNamespace(
                name=name,
                local=name == "head",
                state=NodeState.LOST if name in lost else NodeState.ALIVE,
                ray=SimpleNamespace(gpus=gpus.get(name, self.gpus), node_id=name),
            )
            for name in [*self.alive_names(), *lost]
        ]

    def most_gpus(self) -> int:
        return self.gpus

    def host(self, name: str) -> LocalHost:
        return self.local

    def ray_env(self) -> dict[str, str]:
        return {"RAY_ADDRESS": "10.0.0.1:6379"}

    def agent_call(self, name: str, method: str, *args):
        assert method == "check_fit"
        self.asked.append(name)
        answer = self.answers[name]
        return Refused(answer) if isinstance(answer, str) else answer


def _supervisor(tmp_path, nodes: Nodes, head_refusal: str | None) -> Supervisor:
    from manager.settings import Settings

    def preflight(config, profile, force, claims, fetching=False) -> None:
        if head_refusal and not force:
            raise Invalid(head_refusal)

    engine = make_engine(tmp_path / "m.db")
    migrate(engine)
    settings = Settings(data_dir=tmp_path, api_token=None)
    return Supervisor(settings, engine, httpx.AsyncClient(), preflight, cluster=nodes)  # type: ignore[arg-type]


def _place(sup: Supervisor, config: ModelConfig) -> str | None:
    with session(sup.engine) as db:
        return sup.starts.place(db, 1, config, None, force=False)


def test_the_first_node_that_fits_takes_the_worker_the_managers_box_first(tmp_path):
    nodes = Nodes({"box2": None, "box3": None})
    assert _place(_supervisor(tmp_path, nodes, head_refusal=None), ModelConfig(name="m", model="/m")) == "head"
    assert nodes.asked == []  # the head's own check said yes: no agent was asked


def test_a_node_where_the_plan_does_not_fit_is_passed_over(tmp_path):
    nodes = Nodes({"box2": "needs 70 GiB of GPU memory, 40 GiB free", "box3": None})
    sup = _supervisor(tmp_path, nodes, head_refusal="needs 70 GiB of GPU memory, 20 GiB free")
    assert _place(sup, ModelConfig(name="m", model="/m")) == "box3"


def test_when_no_node_fits_the_refusal_names_each_node_and_why(tmp_path):
    nodes = Nodes({"box2": "KV cache for max_model_len 32768 needs 9 GiB, 2 GiB left"})
    sup = _supervisor(tmp_path, nodes, head_refusal="host RAM 12 GiB short")
    with pytest.raises(Invalid) as refused:
        _place(sup, ModelConfig(name="big", model="/m"))
    message = refused.value.message
    assert message.startswith("big fits on no node")
    assert "head: host RAM 12 GiB short" in message and "box2: KV cache for max_model_len 32768" in message


def test_sleepers_holding_a_remote_nodes_host_ram_are_named_with_that_node_for_the_front_door_to_stop(tmp_path):
    sleeper = Sleeper(7, "old", 1, 16 << 30)
    held = Refused("host RAM 4 GiB short, held by sleeping workers (old)", short_bytes=4 << 30, sleepers=(sleeper,))
    nodes = Nodes({"box2": "needs 70 GiB of GPU memory, 40 GiB free", "box3": held})
    sup = _supervisor(tmp_path, nodes, head_refusal="needs 70 GiB of GPU memory, 20 GiB free")
    with pytest.raises(HostRamHeldBySleepers) as refused:
        _place(sup, ModelConfig(name="m", model="/m"))
    # Not the head's sleepers, nor a message alone: box3's, with what box3 lacks.
    assert refused.value.node == "box3"
    assert refused.value.sleepers == (sleeper,) and refused.value.short_bytes == 4 << 30
    assert "box3: host RAM 4 GiB short" in refused.value.message and "head: needs 70 GiB" in refused.value.message


def test_sleepers_holding_the_heads_host_ram_are_named_with_the_head(tmp_path):
    sleeper = Sleeper(3, "old", 1, 16 << 30)
    nodes = Nodes({"box2": "needs 70 GiB of GPU memory, 40 GiB free"})
    sup = _supervisor(tmp_path, nodes, head_refusal=None)

    def preflight(config, profile, force, claims, fetching=False) -> None:
        raise HostRamHeldBySleepers("host RAM 2 GiB short, held by sleeping workers (old)", 2 << 30, (sleeper,))

    sup.starts.preflight = preflight
    with pytest.raises(HostRamHeldBySleepers) as refused:
        _place(sup, ModelConfig(name="m", model="/m"))
    assert (refused.value.node, refused.value.sleepers, refused.value.short_bytes) == ("head", (sleeper,), 2 << 30)


def test_the_node_the_front_door_made_room_on_is_tried_first_once(tmp_path):
    nodes = Nodes({"box2": None, "box3": None})
    sup = _supervisor(tmp_path, nodes, head_refusal=None)
    sup.prefer_node("m", "box3")
    assert _place(sup, ModelConfig(name="m", model="/m")) == "box3"
    assert _place(sup, ModelConfig(name="m", model="/m")) == "head"  # the next start: the usual order
    # Where the planner refuses it, the usual order goes on.
    nodes.answers["box3"] = "needs 70 GiB of GPU memory, 40 GiB free"
    sup.prefer_node("m", "box3")
    assert _place(sup, ModelConfig(name="m", model="/m")) == "head"


def test_a_config_pinned_to_a_node_is_only_checked_there(tmp_path):
    nodes = Nodes({"box2": "1 GiB short", "box3": None})
    sup = _supervisor(tmp_path, nodes, head_refusal=None)
    assert _place(sup, ModelConfig(name="m", model="/m", node="box3")) == "box3"
    with pytest.raises(Invalid, match="box2: 1 GiB short"):
        _place(sup, ModelConfig(name="m", model="/m", node="box2"))
    assert nodes.asked == ["box3", "box2"]


def test_a_model_larger_than_any_node_is_spread_by_vllm_from_the_managers_box_after_a_per_gpu_plan(tmp_path):
    nodes = Nodes({"box2": None}, gpus=4)
    sup = _supervisor(tmp_path, nodes, head_refusal=None)
    assert _place(sup, ModelConfig(name="m", model="/m", tensor_parallel_size=8)) == "head"
    # One GPU's share that does not fit is refused, with the planner's numbers.
    nodes.answers["box2"] = "needs 90 GiB per GPU, 80 GiB"
    nodes.statuses_gpus = {"head": 1, "box2": 7}  # the biggest node plans a GPU's share
    with pytest.raises(Invalid, match="one GPU's share does not fit on box2's GPUs: needs 90 GiB per GPU"):
        _place(sup, ModelConfig(name="m", model="/m", tensor_parallel_size=8))


def test_a_model_larger_than_any_node_is_launched_with_vllms_ray_executor_in_the_same_cluster(tmp_path):
    nodes = Nodes({"box2": None}, gpus=4)
    sup = _supervisor(tmp_path, nodes, head_refusal=None)
    with session(sup.engine) as db:
        db.add(
            ModelConfig(name="big", model="/m", tensor_parallel_size=4, extra_args=["--pipeline-parallel-size", "2"])
        )
        db.add(ModelConfig(name="small", model="/m", tensor_parallel_size=4))
        db.commit()
    big = sup._prepare(1, "big", 8100, [], force=False)
    assert big.command.argv[-2:] == ["--distributed-executor-backend", "ray"]
    assert big.command.env["RAY_ADDRESS"] == "10.0.0.1:6379"
    assert any("more GPUs than any one node" in note for note in big.command.notes)
    small = sup._prepare(2, "small", 8101, [], force=False)
    assert "--distributed-executor-backend" not in small.command.argv


def test_a_model_that_spans_nodes_is_refused_when_the_live_nodes_lack_gpus_for_it_forced_or_not(tmp_path):
    """After a node holding some of its ranks is lost, a restart would have vLLM wait for GPUs that are
    not there until the start times out: refused at once, with each live node's GPUs; it waits for
    the lost node, forced or not."""
    nodes = Nodes({"box2": None}, gpus=1)
    nodes.statuses_gpus = {"head": 1, "box2": 1}
    nodes.lost = ["box3"]
    sup = _supervisor(tmp_path, nodes, head_refusal=None)
    with session(sup.engine) as db:
        db.add(ModelConfig(name="tp2", model="/m", tensor_parallel_size=2))
        db.add(ModelConfig(name="tp4", model="/m", tensor_parallel_size=4))
        db.commit()
    assert _place(sup, ModelConfig(name="tp2", model="/m", tensor_parallel_size=2)) == "head"
    for force in (False, True):
        with pytest.raises(WaitsForNodes) as refused:  # a worker that crashed so starts again when a node is back
            sup._prepare(1, "tp4", 8100, [], force=force)
        assert (
            "tp4 needs 4 GPUs and the Ray cluster's live nodes have 2 (box2: 1, head: 1), with node box3 lost"
            in str(refused.value.message)
        )


def test_the_news_of_a_lost_node_knows_which_stored_models_span_nodes(tmp_path):
    """The configs whose starts a node's loss ends: more GPUs than any one node has."""
    sup = _supervisor(tmp_path, Nodes({"box2": None}, gpus=1), head_refusal=None)
    with session(sup.engine) as db:
        db.add(ModelConfig(name="tp2", model="/m", tensor_parallel_size=2))
        db.add(ModelConfig(name="one", model="/m"))
        db.commit()
    assert sup._spans_nodes("tp2") and not sup._spans_nodes("one")
    assert not sup._spans_nodes("deleted since")


def test_a_start_needing_more_gpus_than_the_live_nodes_have_waits_when_a_node_is_lost(tmp_path):
    """Seen on two GPUs: the TP-2 model's crash restart, just after Ray called gpu-b lost, was refused
    for good ("lower tensor_parallel_size"), and it did not start again when gpu-b came back."""
    nodes = Nodes({}, gpus=1)
    nodes.lost = ["gpu-b"]
    sup = _supervisor(tmp_path, nodes, head_refusal=None)
    with session(sup.engine) as db:
        db.add(ModelConfig(name="tp2", model="/m", tensor_parallel_size=2))
        db.commit()
    with pytest.raises(
        WaitsForNodes,
        match=r"tp2 needs 2 GPUs and the Ray cluster's live nodes have 1 \(head: 1\), with node gpu-b lost",
    ):
        sup._prepare(1, "tp2", 8100, [], force=False)
    nodes.lost = []  # no node lost: more GPUs than the cluster has is a config to change
    with pytest.raises(Invalid, match="lower tensor_parallel_size") as refused:
        sup._prepare(1, "tp2", 8100, [], force=False)
    assert not isinstance(refused.value, WaitsForNodes)
