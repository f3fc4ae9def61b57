"""The order requests waiting for one model are let through: priority, round-robin over keys, FIFO in a key."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from manager.frontdoor.fair_queue import FairQueue, Ticket


def drain(queue: FairQueue) -> list[Ticket]:
    out = []
    while (ticket := queue.next()) is not None:
        queue.release(ticket)
        out.append(ticket)
    return out


def test_interactive_requests_go_before_batch_ones_whatever_came_first():
    queue = FairQueue()
    batch = [queue.join(1, "batch") for _ in range(3)]
    interactive = queue.join(2, "interactive")
    assert drain(queue) == [interactive, *batch]


def test_keys_take_turns_and_each_key_keeps_its_own_order():
    queue = FairQueue()
    a = [queue.join(1) for _ in range(10)]
    b = [queue.join(2) for _ in range(2)]
    assert drain(queue) == [a[0], b[0], a[1], b[1], *a[2:]]


def test_a_key_that_arrives_late_joins_the_back_of_the_ring():
    queue = FairQueue()
    a = [queue.join(1) for _ in range(3)]
    b = queue.join(2)
    first = queue.next()
    assert first is a[0]
    queue.release(first)
    c = queue.join(3)
    assert drain(queue) == [b, a[1], c, a[2]]


def test_a_request_that_gives_up_leaves_and_its_key_keeps_its_place():
    queue = FairQueue()
    a = [queue.join(1) for _ in range(2)]
    b = queue.join(2)
    queue.drop(a[0])
    queue.drop(a[0])  # twice is once
    assert len(queue) == 2 and queue.waiting(1) == 1
    assert drain(queue) == [a[1], b]
    assert len(queue) == 0 and queue.waiting(1) == 0


def test_next_may_pass_over_tickets_that_may_not_go_yet():
    queue = FairQueue()
    a = queue.join(1)
    b = queue.join(2)
    assert queue.next(lambda t: t is not a) is b
    assert list(queue.order()) == [a, b]


def test_an_unknown_priority_goes_after_the_known_ones():
    queue = FairQueue()
    odd = queue.join(1, "someday")
    batch = queue.join(2, "batch")
    assert drain(queue) == [batch, odd]


# An arrival sequence: join (key, priority), let the next one through, or one waiting request gives up.
ops = st.lists(
    st.one_of(
        st.tuples(st.just("join"), st.integers(0, 4), st.sampled_from(["interactive", "batch"])),
        st.tuples(st.just("release"), st.just(0), st.just("")),
        st.tuples(st.just("drop"), st.integers(0, 30), st.just("")),
    ),
    max_size=120,
)


@settings(max_examples=300, deadline=None)
@given(ops)
def test_no_key_waits_behind_more_than_one_turn_of_each_other_key(sequence):
    """For any arrivals, releases and give-ups: take any moment at which key k has a request waiting
    in priority p, and the keys of p with requests waiting then. Until k's next request goes through,
    the requests of p that go are each of a different one of those other keys (so at most their
    number); a key that arrives later goes after k. Within a key, requests go in their arrival order;
    a batch request goes only while no interactive one waits."""
    queue = FairQueue()
    waiting: list[Ticket] = []  # in arrival order
    # (k, p) -> the other keys of p that may still go before k's next request, as at the watched moment.
    ahead: dict[tuple[int, str], set[int]] = {}

    def watch() -> None:
        keys = {(t.key, t.priority) for t in waiting}
        for key, priority in keys:
            others = {k for k, p in keys if p == priority and k != key}
            # Watching anew at every step: each must hold from every moment, not only the first.
            ahead[(key, priority)] = ahead.get((key, priority), others) & others

    for op, number, priority in sequence:
        if op == "join":
            waiting.append(queue.join(number, priority))
        elif op == "drop" and waiting:
            gone = waiting.pop(number % len(waiting))
            queue.drop(gone)
            if not any((t.key, t.priority) == (gone.key, gone.priority) for t in waiting):
                ahead.pop((gone.key, gone.priority), None)
        elif op == "release":
            ticket = queue.next()
            if ticket is None:
                assert not waiting
                continue
            assert ticket is next(t for t in waiting if t.key == ticket.key and t.priority == ticket.priority)
            if ticket.priority == "batch":
                assert all(t.priority == "batch" for t in waiting)
            queue.release(ticket)
            waiting.remove(ticket)
            for (key, priority), others in ahead.items():
                if priority == ticket.priority and key != ticket.key:
                    assert ticket.key in others, f"key {ticket.key} went twice (or arrived later) ahead of {key}"
                    others.discard(ticket.key)
            ahead.pop((ticket.key, ticket.priority), None)
        watch()
        assert len(queue) == len(waiting)
        assert sorted(map(id, queue.order())) == sorted(map(id, waiting))
