"""Streams through /v1 on a real port (uvicorn), against stand-in engines: chunk by chunk, and a client
that leaves ends the engine's request. The official openai client works against it unchanged."""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from manager.app import create_app
from tests.frontdoor.conftest import served


@pytest.fixture
def manager_url(door_settings):
    app = create_app(door_settings)
    with served(app) as url:
        for body in (
            {
                "name": "a",
                "model": "org/a",
                "gpu_ids": [0],
                "aliases": ["alpha"],
                "env": {"STAND_IN_TOKEN_S": "0.05"},
            },
            {"name": "b", "model": "org/b", "gpu_ids": [0]},
        ):
            assert httpx.post(f"{url}/api/models", json=body).status_code == 201
        yield url


def running_requests(port: int) -> float:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
    for family in text_string_to_metric_families(text):
        if family.name == "vllm:num_requests_running":
            return sum(s.value for s in family.samples)
    raise AssertionError("no vllm:num_requests_running")


def port_of(url: str, model: str) -> int:
    return next(w["port"] for w in httpx.get(f"{url}/api/workers").json() if w["model"] == model)


def test_stream_chunks_arrive_as_the_engine_writes_them(manager_url):
    body = {"model": "alpha", "prompt": "hi", "max_tokens": 10, "stream": True}
    arrivals: list[float] = []
    with httpx.stream("POST", f"{manager_url}/v1/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        for line in resp.iter_lines():
            if line.startswith("data: "):
                arrivals.append(time.monotonic())
    assert len(arrivals) == 11  # ten tokens and [DONE]
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]
    # The engine writes a token every 50 ms: buffering would bring them all at once at the end.
    assert arrivals[-1] - arrivals[0] > 0.3
    assert sum(1 for g in gaps if g > 0.02) >= 7


def test_a_client_that_leaves_mid_stream_ends_the_engines_request(manager_url):
    body = {"model": "a", "prompt": "hi", "max_tokens": 2000, "stream": True}
    with httpx.stream("POST", f"{manager_url}/v1/completions", json=body, timeout=60) as resp:
        lines = resp.iter_lines()
        for _ in range(3):
            assert next(lines).startswith("data: ")
            next(lines)  # the blank line after each event
        port = port_of(manager_url, "a")
        assert running_requests(port) == 1
    deadline = time.monotonic() + 10
    while running_requests(port) != 0:
        assert time.monotonic() < deadline, "the engine kept generating for a client that left"
        time.sleep(0.05)
    # The lease ended with the response: the manager counts nothing in flight.
    metrics = httpx.get(f"{manager_url}/metrics").text
    assert 'vllm_manager_proxy_in_flight{model="a"} 0.0' in metrics


def test_the_official_openai_client_streaming_and_not(manager_url):
    client = openai.OpenAI(base_url=f"{manager_url}/v1", api_key="unused", max_retries=0)
    reply = client.chat.completions.create(model="alpha", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert reply.choices[0].message.content == "t0 t1 t2" and reply.model == "a"
    stream = client.chat.completions.create(
        model="alpha", messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True
    )
    assert "".join(chunk.choices[0].delta.content or "" for chunk in stream) == "t0 t1 t2 t3 "
    names = {m.id: m for m in client.models.list()}
    assert set(names) == {"a", "alpha", "b"}
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="nope", prompt="x")
    assert err.value.code == "model_not_found" and "Models that exist: a, alpha, b" in err.value.message
    with pytest.raises(openai.BadRequestError):
        client.post("/completions", body={"prompt": "x"}, cast_to=object)


def test_five_requests_during_a_swap_make_one_start_and_all_are_answered(manager_url):
    body = {"model": "a", "prompt": "hi", "max_tokens": 2}
    assert httpx.post(f"{manager_url}/v1/completions", json={**body, "model": "b"}, timeout=60).status_code == 200
    results: list[httpx.Response] = []

    def ask() -> None:
        results.append(httpx.post(f"{manager_url}/v1/completions", json=body, timeout=60))

    threads = [threading.Thread(target=ask) for _ in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r.status_code for r in results] == [200] * 5
    assert all(json.loads(r.text)["model"] == "a" for r in results)
    workers = httpx.get(f"{manager_url}/api/workers").json()
    assert {w["model"]: w["state"] for w in workers} == {"a": "ready", "b": "stopped"}
    starts = [e for e in httpx.get(f"{manager_url}/api/events?limit=1000").json() if e["kind"] == "starting"]
    assert sorted(e["message"].split(":")[1].split()[0] for e in starts) == ["a", "b"]
