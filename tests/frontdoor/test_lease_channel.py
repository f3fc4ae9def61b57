"""The lease channel between forwarder processes and the manager's: leases asked and given back, refusals
passed on as made, outcomes counted, and nothing held once a forwarder goes away."""

from __future__ import annotations

import asyncio
import functools
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from manager.auth.throttle import ADMIN_TOKEN, INFERENCE_KEY, WrongTokenThrottle
from manager.frontdoor.access import ANYONE, Caller
from manager.frontdoor.errors import ModelUnavailable, OverKeyLimit, QueueFull
from manager.frontdoor.forwarding import Held, Outcome
from manager.frontdoor.lease_channel import LeaseClient, LeaseServer, Refused
from manager.frontdoor.limits import KeyLimits, Limited, Limiter
from manager.frontdoor.metering import Tokens


@dataclass
class DoorLease:
    port: int
    worker_id: int = 1
    address: str = "127.0.0.1"
    queued: bool = False
    engine_key: str | None = None
    released: bool = False

    def release(self) -> None:
        self.released = True


@dataclass
class Door:
    """The manager's side as the channel sees it: leases handed out when ``open`` is set."""

    leases: list[DoorLease] = field(default_factory=list)
    outcomes: list[tuple[Outcome, Held | None]] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    open: asyncio.Event = field(default_factory=asyncio.Event)
    refuse: Exception | None = None
    callers: list[Caller] = field(default_factory=list)  # whom each acquire was for
    limiter: Limiter = field(default_factory=lambda: Limiter(lambda key_id, since: 0))
    now: float = 1_800_000_000.0
    gave_up: int = 0  # acquires cancelled while they waited (their client left)
    waits_for: str = "loading a 42 %"

    async def admit(self, caller: Caller, asked_tokens: int) -> dict[str, str]:
        assert caller.limits is not None
        try:
            return self.limiter.admit(caller.key_id, caller.key_name or "", caller.limits, asked_tokens, self.now)
        except Limited as exc:
            raise OverKeyLimit(exc.message, exc.limit, exc.headers) from None

    def let_go(self, key_id: int) -> None:
        self.limiter.ended(key_id, None, self.now)

    async def acquire(
        self,
        config: str,
        adapter: str | None,
        affinity: str | None = None,
        avoid: tuple[int, ...] = (),
        caller: Caller = ANYONE,
    ) -> Held:
        self.callers.append(caller)
        try:
            await self.open.wait()
        except asyncio.CancelledError:
            self.gave_up += 1
            raise
        if self.refuse is not None:
            raise self.refuse
        lease = DoorLease(port=8000 + len(self.leases), queued=adapter is not None, engine_key=f"key-of-{config}")
        self.leases.append(lease)
        return lease

    def adapter_missing(self, lease: Held, adapter: str) -> None:
        self.missing.append(adapter)

    async def loading(self, config: str) -> str:
        return f"{self.waits_for} ({config})"

    def record(self, outcome: Outcome, lease: Held | None = None) -> None:
        if lease is not None:
            lease.release()
        if outcome.admitted:
            tokens = outcome.tokens.prompt + outcome.tokens.completion if outcome.tokens else None
            self.limiter.ended(outcome.key_id, tokens, self.now)
        self.outcomes.append((outcome, lease))


def on_a_loop(test):
    """Run an async test on its own event loop, within 20 s."""

    @functools.wraps(test)
    def run(tmp_path: Path) -> None:
        asyncio.run(asyncio.wait_for(test(tmp_path), timeout=20))

    return run


async def until(check, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not check():
        assert asyncio.get_running_loop().time() < deadline, "not reached in time"
        await asyncio.sleep(0.01)


async def channel(tmp_path: Path, door: Door) -> tuple[LeaseServer, LeaseClient]:
    server = LeaseServer(door, tmp_path / "leases.sock")
    await server.start()
    client = LeaseClient()
    await client.connect(server.path)
    return server, client


@on_a_loop
async def test_a_lease_is_the_managers_and_ends_when_the_request_is_done(tmp_path):
    door = Door()
    door.open.set()
    server, client = await channel(tmp_path, door)
    lease = await client.acquire("a", "my-adapter")
    # The engine's API key comes with the lease: the forwarder sends it to the engine.
    assert (lease.port, lease.address, lease.queued, lease.engine_key) == (8000, "127.0.0.1", True, "key-of-a")
    assert not door.leases[0].released
    client.adapter_missing(lease, "my-adapter")
    client.record(Outcome(7, "a", 200, Tokens(5, 9), 0.0004), lease)
    await until(lambda: door.outcomes)
    outcome, held = door.outcomes[0]
    assert outcome == Outcome(7, "a", 200, Tokens(5, 9), 0.0004)
    assert held is door.leases[0] and door.leases[0].released
    assert door.missing == ["my-adapter"]
    # An error before any lease is counted too.
    client.record(Outcome(7, None, 404))
    await until(lambda: len(door.outcomes) == 2)
    assert door.outcomes[1] == (Outcome(7, None, 404), None)
    await client.close()
    await server.close()


@on_a_loop
async def test_the_callers_key_and_priority_reach_the_managers_queue(tmp_path):
    door = Door()
    door.open.set()
    server, client = await channel(tmp_path, door)
    await client.acquire("a", None, caller=Caller(key_id=7, key_name="nightly", priority="batch"))
    await client.acquire("a", None)
    # Only what places the request in line crosses; the models a key may use were checked by the forwarder.
    assert door.callers == [Caller(key_id=7, priority="batch"), ANYONE]
    await client.close()
    await server.close()


@on_a_loop
async def test_a_refusal_reaches_the_forwarders_client_as_the_manager_made_it(tmp_path):
    door = Door(refuse=QueueFull("64 requests are already waiting for 'a'", retry_after_s=5))
    door.open.set()
    server, client = await channel(tmp_path, door)
    with pytest.raises(Refused) as refused:
        await client.acquire("a", None)
    assert refused.value.status == 429
    assert refused.value.headers == {"Retry-After": "5"}
    assert refused.value.body() == QueueFull("64 requests are already waiting for 'a'", 5).body()
    await client.close()
    await server.close()


@on_a_loop
async def test_a_forwarder_that_goes_away_gives_back_what_it_held(tmp_path):
    door = Door()
    door.open.set()
    server, client = await channel(tmp_path, door)
    await client.acquire("a", None)
    await client.acquire("a", None)
    await client.close()
    await until(lambda: all(lease.released for lease in door.leases))
    assert len(door.leases) == 2
    await server.close()


@on_a_loop
async def test_a_client_that_left_while_waiting_stops_waiting_in_the_managers_process_too(tmp_path):
    door = Door()
    server, client = await channel(tmp_path, door)
    waiting = asyncio.create_task(client.acquire("a", None))
    await asyncio.sleep(0.05)
    waiting.cancel()  # the client left during a cold start
    # The manager's acquire is cancelled: the request leaves the queue, and a load made for it alone may go.
    await until(lambda: door.gave_up == 1)
    door.open.set()
    await asyncio.sleep(0.05)
    assert door.leases == []
    await client.close()
    await server.close()


@on_a_loop
async def test_a_forwarder_asks_the_manager_what_a_model_waits_for(tmp_path):
    door = Door()
    server, client = await channel(tmp_path, door)
    assert await client.loading("qwen") == "loading a 42 % (qwen)"
    await client.close()
    await server.close()


@on_a_loop
async def test_when_the_manager_goes_away_requests_get_a_503_not_a_hang(tmp_path):
    door = Door()
    server, client = await channel(tmp_path, door)
    waiting = asyncio.create_task(client.acquire("a", None))
    await asyncio.sleep(0.05)
    await server.close()  # as when the manager's process ends
    with pytest.raises(ModelUnavailable):
        await asyncio.wait_for(waiting, 5)
    await until(client.lost.is_set)
    with pytest.raises(ModelUnavailable):
        await client.acquire("a", None)
    await client.close()


@on_a_loop
async def test_wrong_tokens_are_counted_by_the_manager_and_every_forwarder_hears_of_the_limit(tmp_path):
    door = Door()
    tokens, keys = WrongTokenThrottle(limit=3), WrongTokenThrottle(limit=3)
    server = LeaseServer(door, tmp_path / "leases.sock", {ADMIN_TOKEN: tokens, INFERENCE_KEY: keys})
    await server.start()
    first, second = LeaseClient(), LeaseClient()
    await first.connect(server.path)
    await second.connect(server.path)
    for _ in range(2):
        first.throttles[INFERENCE_KEY].record_failure("10.0.0.7")
    keys.record_failure("10.0.0.7")  # a stale key sent to the manager's own API: the same count
    await until(lambda: second.throttles[INFERENCE_KEY].retry_after("10.0.0.7") is not None)
    assert first.throttles[INFERENCE_KEY].retry_after("10.0.0.7") == keys.retry_after("10.0.0.7")
    assert second.throttles[INFERENCE_KEY].retry_after("10.0.0.8") is None
    # Keys and the admin token are counted apart: the address may still bring the admin token.
    assert tokens.retry_after("10.0.0.7") is None
    assert second.throttles[ADMIN_TOKEN].retry_after("10.0.0.7") is None
    for _ in range(3):
        second.throttles[ADMIN_TOKEN].record_failure("10.0.0.9")
    await until(lambda: first.throttles[ADMIN_TOKEN].retry_after("10.0.0.9") is not None)
    assert tokens.retry_after("10.0.0.9") is not None and keys.retry_after("10.0.0.9") is None
    assert first.throttles[INFERENCE_KEY].retry_after("10.0.0.9") is None
    for client in (first, second):
        await client.close()
    await server.close()


@on_a_loop
async def test_a_keys_limits_are_counted_by_the_manager_for_every_forwarder(tmp_path):
    door = Door()
    server, first = await channel(tmp_path, door)
    second = LeaseClient()
    await second.connect(server.path)
    caller = Caller(3, "app", limits=KeyLimits(rpm=3, tpm=10, max_concurrent=2))
    headers = await first.admit(caller, 1)
    assert headers["x-ratelimit-remaining-requests"] == "2"
    await second.admit(caller, 1)
    # Two in flight, one through each forwarder: the third is refused as the manager made the refusal.
    with pytest.raises(Refused) as refused:
        await second.admit(caller, 1)
    assert refused.value.status == 429 and refused.value.code == "rate_limit_exceeded"
    assert "max_concurrent 2" in refused.value.message and refused.value.headers["Retry-After"] == "1"
    # One ends with its tokens (charged to tpm); the other's forwarder goes away: it is no longer in flight.
    first.record(Outcome(3, "a", 200, Tokens(2, 8), 0.0, "app", admitted=True))
    await second.close()
    await until(lambda: door.limiter.in_flight(3) == 0)
    assert door.limiter.headers(3, KeyLimits(tpm=10), door.now)["x-ratelimit-remaining-tokens"] == "0"
    with pytest.raises(Refused) as over_tpm:
        await first.admit(caller, 1)
    assert "tpm 10" in over_tpm.value.message
    await first.close()
    await server.close()


@on_a_loop
async def test_a_request_let_go_is_no_longer_in_flight(tmp_path):
    door = Door()
    server, client = await channel(tmp_path, door)
    caller = Caller(3, "app", limits=KeyLimits(max_concurrent=1))
    await client.admit(caller, 1)
    client.let_go(3)
    await until(lambda: door.limiter.in_flight(3) == 0)
    await client.admit(caller, 1)
    await client.close()
    await server.close()
