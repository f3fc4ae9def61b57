"""A node whose raylet was given some GPUs (CUDA_VISIBLE_DEVICES=1 on `ray start`): its agent keeps
that mask, so its GPU figures and its engines are the node's GPUs, not the whole box's."""

from __future__ import annotations

import gc

import pytest
import ray
from ray.cluster_utils import Cluster

from manager.cluster.nodes import NODE_LABEL
from manager.cluster.ray_cluster import RayCluster, connect

pytestmark = pytest.mark.engine


def test_a_nodes_agent_keeps_the_gpus_its_raylet_was_given():
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "labels": {NODE_LABEL: "head"}})
    try:
        # Ray empties the mask of an actor that asks for no GPU where this is set (older Rays did by
        # default); the agent must still see its raylet's.
        raylet_env = {"CUDA_VISIBLE_DEVICES": "1", "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "1"}
        cluster.add_node(num_cpus=1, num_gpus=1, labels={NODE_LABEL: "gpu-b"}, env_vars=raylet_env)
        cluster.add_node(num_cpus=1, labels={NODE_LABEL: "all-gpus"})
        cluster.wait_for_nodes()
        connect(cluster.address)
        nodes = RayCluster(cluster.address)
        nodes.refresh()
        assert nodes.agent_call("gpu-b", "hello", timeout=60)["gpus_lent"] == ["1"]
        assert nodes.agent_call("all-gpus", "hello", timeout=60)["gpus_lent"] is None
    finally:
        gc.collect()
        ray.shutdown()
        cluster.shutdown()
