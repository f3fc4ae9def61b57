"""A key's limits with `vllm-manager serve` and two forwarder processes (VLLM_MANAGER_FORWARDERS=2),
stand-in engines behind them: the manager's process counts for both, so a limit is one limit."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

import httpx
import pytest

from tests.frontdoor.test_engine_forwarders import Served
from tests.frontdoor.test_keys_v1 import bearer
from tests.support.engine import tiny_config


@pytest.fixture
def served(tmp_path, stand_in_python, tiny_llama) -> Iterator[Served]:
    env = {
        "VLLM_MANAGER_FORWARDERS": "2",
        "VLLM_MANAGER_ENGINE_PYTHON": stand_in_python,
        "VLLM_MANAGER_WORKER_PORTS": "18500-18599",
    }
    server = Served(tmp_path / "data", tmp_path / "manager.log", env)
    try:
        server.start()
        body = tiny_config("a", tiny_llama, start_timeout_s=60)
        assert httpx.post(f"{server.url}/api/models", json=body).status_code == 201
        yield server
    finally:
        server.stop()


def test_two_forwarders_share_one_rpm_limit(served):
    made = httpx.post(f"{served.url}/api/keys", json={"name": "app", "rpm": 2})
    assert made.status_code == 201, made.text
    key = made.json()["key"]
    chat = {"model": "a", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    # A new connection each: the kernel spreads them over both forwarders. Counted in each of them,
    # two apiece (or more) would pass.
    statuses = Counter(
        httpx.post(f"{served.url}/v1/chat/completions", json=chat, headers=bearer(key), timeout=60).status_code
        for _ in range(20)
    )
    assert statuses == {200: 2, 429: 18}
    metrics = httpx.get(f"{served.url}/metrics").text
    assert 'vllm_manager_proxy_limited_total{key="app",limit="rpm"} 18.0' in metrics
    assert 'vllm_manager_proxy_tokens_total{key="app",kind="completion",model="a"} 6.0' in metrics
