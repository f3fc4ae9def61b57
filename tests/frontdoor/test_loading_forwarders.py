"""Loading progress and cancelled loads with `vllm-manager serve` and two forwarder processes
(VLLM_MANAGER_FORWARDERS=2), stand-in engines behind them: the forwarder asks the manager's process what
the model waits for, and tells it when a client left."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest

from tests.frontdoor.test_engine_forwarders import Served, wait_for
from tests.support.engine import tiny_config


@pytest.fixture
def served(tmp_path, stand_in_python, tiny_llama) -> Iterator[Served]:
    env = {
        "VLLM_MANAGER_FORWARDERS": "2",
        "VLLM_MANAGER_ENGINE_PYTHON": stand_in_python,
        "VLLM_MANAGER_WORKER_PORTS": "18600-18699",
        "VLLM_MANAGER_ALLOW_CODE_FLAGS": "1",  # the stand-in's STAND_IN_* knobs
    }
    server = Served(tmp_path / "data", tmp_path / "manager.log", env)
    try:
        server.start()
        for name, start_s in (("slow", "60"), ("quick", "4")):  # both on GPU 0: one at a time
            body = tiny_config(name, tiny_llama, start_timeout_s=90, gpu_ids=[0], env={"STAND_IN_START_S": start_s})
            answer = httpx.post(f"{server.url}/api/models", json=body)
            assert answer.status_code == 201, answer.text
        yield server
    finally:
        server.stop()


def states(url: str) -> dict[str, str]:
    return {w["model"]: w["state"] for w in httpx.get(f"{url}/api/workers").json()}


def test_through_forwarders_a_cancelled_load_frees_the_gpu_and_a_stream_gets_loading_comments(served):
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up during the slow start
        httpx.post(f"{served.url}/v1/chat/completions", json={"model": "slow", **chat}, timeout=2.0)
    wait_for(lambda: states(served.url).get("slow") == "stopped", 15, "the abandoned start was not cancelled")
    events = httpx.get(f"{served.url}/api/events?limit=1000").json()
    assert "start of slow cancelled: no request waits for it any more" in [e["message"] for e in events]

    started = time.monotonic()
    body = {"model": "quick", "stream": True, **chat}
    headers = {"X-Loading-Progress": "1"}
    with httpx.stream("POST", f"{served.url}/v1/chat/completions", json=body, headers=headers, timeout=60) as answer:
        assert answer.status_code == 200
        lines = [line for line in answer.iter_lines() if line]
    assert time.monotonic() - started >= 3  # it did wait for the start
    first_data = next(i for i, line in enumerate(lines) if line.startswith("data:"))
    assert first_data >= 1 and all(line.startswith(": starting quick, ") for line in lines[:first_data]), lines
    assert lines[-1] == "data: [DONE]"


def test_through_forwarders_a_value_the_header_does_not_take_is_refused_before_any_worker_starts(served):
    body = {"model": "quick", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    for _ in range(4):  # one connection each: the kernel spreads them over both forwarders
        answer = httpx.post(f"{served.url}/v1/chat/completions", json=body, headers={"X-Loading-Progress": "maybe"})
        assert answer.status_code == 400, answer.text
        message = answer.json()["error"]["message"]
        assert message.startswith("X-Loading-Progress: 'maybe' is not a value it takes; send 1 or true"), message
    assert httpx.get(f"{served.url}/api/workers").json() == []
