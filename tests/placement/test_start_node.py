"""Which node of a cluster a start runs on, from the planner's check on each node."""

from __future__ import annotations

from collections.abc import Iterator

from hypothesis import given
from hypothesis import strategies as st

from manager.placement import (
    Candidate,
    CannotFit,
    NodeCheck,
    Place,
    StopSleepersFirst,
    start_node,
    start_order,
)


def test_the_first_node_that_fits_is_taken_and_later_nodes_are_not_asked():
    asked: list[str] = []

    def checks() -> Iterator[NodeCheck]:
        for name, refusal in [("a", "GPU 0 is 3.0 GiB short"), ("b", None), ("c", None)]:
            asked.append(name)
            yield NodeCheck(name, refusal)

    assert start_node("chat", checks()) == Place("b", ())
    assert asked == ["a", "b"]


def test_a_start_that_fits_nowhere_says_each_nodes_reason():
    decision = start_node("chat", [NodeCheck("a", "GPU 0 is 3.0 GiB short"), NodeCheck("b", "no GPU")])
    assert isinstance(decision, CannotFit)
    assert decision.reason == "chat fits on no node: a: GPU 0 is 3.0 GiB short; b: no GPU"
    assert decision.per_node == (("a", "GPU 0 is 3.0 GiB short"), ("b", "no GPU"))


def test_where_only_sleepers_hold_the_ram_the_first_such_node_is_named_not_the_first_node():
    checks = [
        NodeCheck("a", "GPU 0 is 3.0 GiB short"),
        NodeCheck("b", "host RAM 4.0 GiB short, held by sleeping workers", held_by_sleepers=True),
        NodeCheck("c", "host RAM 1.0 GiB short, held by sleeping workers", held_by_sleepers=True),
    ]
    decision = start_node("chat", checks)
    assert isinstance(decision, StopSleepersFirst)
    assert decision.node == "b"
    assert "a: GPU 0 is 3.0 GiB short" in decision.reason and "c: host RAM 1.0 GiB" in decision.reason


def test_a_cluster_without_a_live_node_is_said_so():
    decision = start_node("chat", [])
    assert isinstance(decision, CannotFit) and decision.reason == "no node of the Ray cluster is alive"


def test_the_order_is_the_node_made_room_on_then_the_previous_then_this_box_then_the_least_loaded():
    nodes = [
        Candidate("busy", load=3),
        Candidate("quiet", load=0),
        Candidate("head", local=True, load=5),
        Candidate("before", previous=True, load=9),
        Candidate("room", preferred=True, load=9),
    ]
    assert start_order(nodes) == ["room", "before", "head", "quiet", "busy"]


@given(st.lists(st.tuples(st.sampled_from("abcdef"), st.booleans(), st.booleans()), unique_by=lambda t: t[0]))
def test_a_start_is_placed_exactly_when_some_node_fits_and_on_the_first_such(nodes):
    checks = [NodeCheck(name, None if fits else f"{name} is short", held) for name, fits, held in nodes]
    decision = start_node("chat", checks)
    fitting = [c.node for c in checks if c.refusal is None]
    if fitting:
        assert decision == Place(fitting[0], ())
    elif any(c.held_by_sleepers for c in checks):
        assert isinstance(decision, StopSleepersFirst)
        assert decision.node == next(c.node for c in checks if c.held_by_sleepers)
    else:
        assert isinstance(decision, CannotFit)
        assert [n for n, _ in decision.per_node] == [c.node for c in checks]
