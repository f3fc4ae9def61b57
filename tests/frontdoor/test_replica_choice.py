"""Which replica a /v1 request goes to: spread by load, a conversation kept on one, a failed one passed over."""

from __future__ import annotations

from collections import Counter

from manager.frontdoor.replica_choice import AFFINITY_SLACK, affinity_of, choose


class Leasing:
    """The counts the front door keeps for one model: requests in flight and served, per worker."""

    def __init__(self, ready: list[int]) -> None:
        self.ready = ready
        self.in_flight: Counter[int] = Counter()
        self.served: Counter[int] = Counter()

    def lease(self, affinity: str | None = None, avoid: tuple[int, ...] = ()) -> int:
        chosen = choose(self.ready, self.in_flight, self.served, affinity, avoid)
        self.in_flight[chosen] += 1
        self.served[chosen] += 1
        return chosen

    def release(self, worker_id: int) -> None:
        self.in_flight[worker_id] -= 1


def test_requests_in_flight_at_once_split_evenly_over_two_replicas():
    leasing = Leasing([1, 2])
    taken = Counter(leasing.lease() for _ in range(40))
    assert taken == {1: 20, 2: 20}


def test_one_conversation_sending_many_requests_at_once_still_spreads():
    leasing = Leasing([1, 2])
    taken = Counter(leasing.lease("user:alice") for _ in range(40))
    assert set(taken) == {1, 2}
    assert max(taken.values()) <= 0.65 * 40, taken


def test_requests_one_after_another_alternate():
    leasing = Leasing([1, 2])
    order = []
    for _ in range(6):
        chosen = leasing.lease()
        order.append(chosen)
        leasing.release(chosen)
    assert order == [1, 2, 1, 2, 1, 2]


def test_a_conversation_stays_on_one_replica_across_its_turns():
    homes = {}
    for key in (f"user:u{i}" for i in range(20)):
        leasing = Leasing([1, 2, 3])
        seen = set()
        for _ in range(12):
            chosen = leasing.lease(key)
            seen.add(chosen)
            leasing.release(chosen)
        assert len(seen) == 1, (key, seen)
        homes[key] = seen.pop()
    assert len(set(homes.values())) > 1  # conversations are spread over the replicas, not all on one


def home_of(key: str, ready: list[int]) -> int:
    return choose(ready, {}, {}, key)


def test_a_conversation_moves_to_the_least_loaded_replica_when_its_home_is_busy():
    key = "user:bob"
    home = home_of(key, [1, 2])
    other = 3 - home
    almost = {home: 5 + AFFINITY_SLACK - 1, other: 5}
    assert choose([1, 2], almost, {}, key) == home
    busy = {home: 5 + AFFINITY_SLACK, other: 5}
    assert choose([1, 2], busy, {}, key) == other


def test_a_replica_that_leaves_moves_only_its_own_conversations():
    keys = [f"opening:conversation {i}" for i in range(200)]
    before = {key: home_of(key, [1, 2, 3, 4]) for key in keys}
    assert set(before.values()) == {1, 2, 3, 4}
    after = {key: home_of(key, [1, 2, 4]) for key in keys}
    moved = {key for key in keys if before[key] != after[key]}
    assert moved == {key for key in keys if before[key] == 3}
    # And one that joins takes conversations only for itself.
    joined = {key: home_of(key, [1, 2, 3, 4, 5]) for key in keys}
    assert all(joined[key] in (before[key], 5) for key in keys)


def test_a_replica_that_just_failed_is_passed_over_while_another_is_ready():
    assert choose([1, 2], {}, {}) == 1
    assert choose([1, 2], {}, {}, avoid=(1,)) == 2
    key = next(f"user:{i}" for i in range(100) if home_of(f"user:{i}", [1, 2]) == 1)
    assert choose([1, 2], {}, {}, key, avoid=(1,)) == 2
    assert choose([1, 2], {2: 30}, {}, key, avoid=(1,)) == 2  # however loaded the other is


def test_a_replica_that_just_failed_is_used_when_it_is_the_only_one():
    assert choose([1], {}, {}, avoid=(1,)) == 1
    assert choose([1], {1: 3}, {}, "user:x", avoid=(1,)) == 1


def test_the_user_field_names_the_conversation_over_its_prompt():
    one = affinity_of({"user": "alice", "prompt": "Once upon a time"})
    two = affinity_of({"user": "alice", "prompt": "Something else entirely"})
    assert one is not None and one == two
    assert one != affinity_of({"prompt": "Once upon a time"})
    assert affinity_of({"user": "bob", "prompt": "Once upon a time"}) != one


def test_later_turns_of_a_chat_keep_its_conversation():
    opening = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is a replica?"},
    ]
    first = affinity_of({"messages": opening})
    later = affinity_of(
        {
            "messages": [
                *opening,
                {"role": "assistant", "content": "A copy of a worker."},
                {"role": "user", "content": "And why several?"},
            ]
        }
    )
    assert first is not None and first == later


def test_conversations_that_open_differently_differ():
    chat = [{"role": "user", "content": "Hello"}]
    other = [{"role": "user", "content": "Bonjour"}]
    assert affinity_of({"messages": chat}) != affinity_of({"messages": other})
    assert affinity_of({"prompt": "Hello"}) != affinity_of({"prompt": "Bonjour"})
    assert affinity_of({"prompt": ["Hello", "x"]}) == affinity_of({"prompt": "Hello"})


def test_a_request_without_a_prompt_or_messages_has_no_conversation():
    assert affinity_of({}) is None
    assert affinity_of({"model": "m", "input": "embed me"}) is None
    assert affinity_of({"messages": []}) is None
    assert affinity_of({"prompt": []}) is None
    assert affinity_of({"user": "", "max_tokens": 5}) is None
