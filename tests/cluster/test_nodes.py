"""The node rules: names, picking a config's node, lost or alive, models that span nodes."""

from __future__ import annotations

from manager.cluster import nodes as n


def _entry(node_id: str, host: str = "box", alive: bool = True, label: str | None = None, **resources) -> dict:
    labels = {"ray.io/node-id": node_id}
    if label:
        labels[n.NODE_LABEL] = label
    return {
        "NodeID": node_id,
        "NodeManagerHostname": host,
        "NodeManagerAddress": "10.0.0.7",
        "Alive": alive,
        "Resources": {"CPU": 8.0, "node:10.0.0.7": 1.0, **resources},
        "Labels": labels,
    }


def test_a_node_is_named_by_its_label_else_its_hostname_and_ray_labels_are_not_user_labels():
    found = n.from_ray([_entry("a" * 56, label="gpu-box"), _entry("b" * 56, host="lab2"), {"Alive": True}])
    assert [n.node_name(x) for x in found] == ["gpu-box", "lab2"]
    assert found[0].labels == {n.NODE_LABEL: "gpu-box"}


def test_a_box_whose_raylet_came_back_is_the_live_node_under_its_name():
    dead, back = _entry("d" * 56, label="box2", alive=False), _entry("e" * 56, label="box2")
    current = n.current_nodes(n.from_ray([dead, back]))
    assert list(current) == ["box2"] and current["box2"].node_id == "e" * 56


def test_a_node_gone_from_rays_table_stays_lost_without_its_gpus_until_it_joins_again():
    box2 = n.from_ray([_entry("b" * 56, label="box2", GPU=2.0)])[0]
    head = n.from_ray([_entry("h" * 56, label="head", GPU=1.0)])
    known = {"head": head[0], "box2": box2}
    current = n.keep_vanished(n.current_nodes(head), known, {"h" * 56})
    assert sorted(current) == ["box2", "head"]
    gone = current["box2"]
    assert not gone.alive and gone.gpus == 0 and n.node_name(gone) == "box2"
    assert n.state_of(gone.alive, 0.0, 0.0, 5.0) == n.NodeState.LOST
    # Listed again (a new raylet under the same name): the live entry, not the kept one.
    back = n.from_ray([_entry("h" * 56, label="head"), _entry("c" * 56, label="box2", GPU=2.0)])
    again = n.keep_vanished(n.current_nodes(back), current, {"h" * 56, "c" * 56})
    assert again["box2"].alive and again["box2"].node_id == "c" * 56
    # Still listed by Ray, as dead: its own entry stands.
    listed = n.from_ray([_entry("h" * 56, label="head"), _entry("b" * 56, label="box2", alive=False)])
    assert n.keep_vanished(n.current_nodes(listed), known, {"h" * 56, "b" * 56})["box2"].node_id == "b" * 56


def test_two_live_raylets_on_one_host_without_labels_are_kept_apart():
    current = n.current_nodes(n.from_ray([_entry("1" * 56, host="vm"), _entry("2" * 56, host="vm")]))
    assert sorted(current) == ["vm-111111", "vm-222222"]


def test_a_config_picks_nodes_by_name_address_id_prefix_custom_resource_or_label():
    current = n.current_nodes(n.from_ray([_entry("abcdef0123" + "0" * 46, label="box2", a100=4.0, GPU=4.0)]))
    for wanted in ("box2", "10.0.0.7", "abcdef01", "a100"):
        assert n.matching(current, wanted) == ["box2"], wanted
    # Ray's own resources and a too-short id prefix pick nothing.
    for wanted in ("GPU", "CPU", "abc", "box9"):
        assert n.matching(current, wanted) == [], wanted
    message = n.unknown_node("box9", current)
    assert "box9" in message and "box2" in message


def test_a_node_is_lost_when_ray_says_so_or_its_agent_has_not_answered_for_a_while():
    assert n.state_of(False, 100.0, 100.5, 5.0) == n.NodeState.LOST
    assert n.state_of(True, 100.0, 104.0, 5.0) == n.NodeState.ALIVE
    assert n.state_of(True, 100.0, 106.0, 5.0) == n.NodeState.LOST
    assert n.state_of(True, None, 106.0, 5.0) == n.NodeState.ALIVE  # not asked yet


def test_a_model_larger_than_any_node_spans_nodes():
    # Tensor x pipeline parallel GPUs, with the flags read as vLLM reads them...
    assert n.spans_nodes(4, ["--pipeline-parallel-size", "2"], most_gpus_on_a_node=4)
    assert n.spans_nodes(2, ["-pp=3"], most_gpus_on_a_node=4)
    assert n.spans_nodes(2, ["--pipeline_parallel_size", "3"], most_gpus_on_a_node=4)
    # ...times the data parallel size only where Ray starts those ranks: vLLM keeps them on one node.
    assert n.spans_nodes(2, ["--data-parallel-size", "2", "--data-parallel-backend", "ray"], most_gpus_on_a_node=2)
    assert n.spans_nodes(2, ["-dp", "2", "-dpb=ray"], most_gpus_on_a_node=2)
    assert not n.spans_nodes(2, ["-dp", "2"], most_gpus_on_a_node=2)
    assert not n.spans_nodes(2, ["-dp", "2", "--data-parallel-backend", "mp"], most_gpus_on_a_node=2)
    assert n.spans_nodes(8, [], most_gpus_on_a_node=4)
    assert not n.spans_nodes(4, [], most_gpus_on_a_node=4)
    assert not n.spans_nodes(8, [], most_gpus_on_a_node=0)  # a CPU cluster has nothing to span


def test_the_nodes_a_model_spans_come_from_its_engines_placement_group():
    # As Ray's tables list them: the engine core (pid 711, a child of the API server 700) is the driver
    # of job 02000000, whose placement group ends with that id: 4 GPU bundles on head, 4 on box2.
    head, box2 = "c8" * 28, "4b" * 28
    groups = {
        "1158d685709d5b1af820429851b102000000": {
            "state": "CREATED",
            "bundles": {i: {"GPU": 1.0, "CPU": 1.0} for i in range(8)},
            "bundles_to_node_id": {i: head if i < 4 else box2 for i in range(8)},
        },
        "99aa00000000000000000000000003000000": {  # another driver's group
            "state": "CREATED",
            "bundles": {0: {"GPU": 1.0}},
            "bundles_to_node_id": {0: box2},
        },
    }
    jobs = [
        {"JobID": "01000000", "DriverPid": 42, "IsDead": False},
        {"JobID": "02000000", "DriverPid": 711, "IsDead": False},
        {"JobID": "03000000", "DriverPid": 900, "IsDead": False},
    ]
    found = n.spans(groups, jobs, {700, 711}, {head: "head", box2: "box2"})
    assert found == [n.Span("box2", 4, 4), n.Span("head", 4, 4)]
    assert n.spans(groups, jobs, {1234}, {}) == []  # an engine of one node reserves nothing
