"""The planner against vLLM 0.32.0 on a real GPU: predicted vs logged KV cache size, eager and with graphs.

Runs on the lent GPU machine after ``source bench/gpu/env.sh`` (bench/README.md has the calls). For
each model shape (real config.json files from tests/fixtures/model_configs, word-level tokenizers,
``--load-format dummy``) and each mode (``--enforce-eager`` or CUDA graphs), it asks the planner for
its prediction on this GPU, starts vLLM with DEBUG logging, waits for the line
"GPU KV cache size: N tokens", stops the engine at once (nothing is served), and keeps vLLM's own
memory-profiling figures: weights, the activation peak, non-torch memory and the CUDA graph
estimate. Each case is written to ``OUT/planner_gpu.json`` as soon as it ends.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "model_configs"
GiB = 1024**3

SHAPES = ["Llama-3.1-8B-Instruct", "Qwen3-30B-A3B", "DeepSeek-V2-Lite", "gemma-3-12b-it"]

PATTERNS = {
    "kv_cache_tokens": re.compile(r"GPU KV cache size: ([\d,]+) tokens"),
    "available_kv_gib": re.compile(r"Available KV cache memory: ([\d.]+) GiB"),
    "weights_gib": re.compile(r"Model loading took ([\d.]+) GiB"),
    "graph_estimate_gib": re.compile(r"CUDA graph pool memory: [\d.]+ GiB \(actual\), ([\d.]+) GiB \(estimated\)"),
    "requested_gib": re.compile(r"Requested memory: [\d.]+ \(util\), ([\d.]+) GiB"),
}
PROFILE = re.compile(r"(Memory profiling takes.*|.*torch peak memory increase.*|.*non_kv_cache_memory.*)")
# vLLM's CUDA graph memory profile (DEBUG): which graphs it captures, and per mode the first capture and
# the per-graph cost it extrapolates from the second one.
GRAPH_GROUPS = re.compile(r"Profiling CUDA graph memory: (.*)")
GRAPH_MODE = re.compile(r"Estimated (\w+) CUDA graph memory: ([\d.]+) MiB first-capture \+ \((\d+)-1\) × ([\d.]+) MiB")
TORCH_PEAK = re.compile(r"torch peak memory increase: ([\d.]+)GiB")
NON_KV = re.compile(r"Total non KV cache memory: ([\d.]+)GiB")


def text_only(config: dict[str, Any]) -> dict[str, Any]:
    """A multimodal config's language model as a text-only model (Gemma 3's text tower)."""
    if config.get("model_type") == "gemma3" and "text_config" in config:
        from transformers import Gemma3TextConfig

        fields = {k: v for k, v in config["text_config"].items() if k != "model_type"}
        text = Gemma3TextConfig(**fields).to_dict()  # transformers fills in Gemma 3's defaults
        text.update(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", torch_dtype="bfloat16")
        return text
    return config


def make_model(folder: Path, name: str) -> Path:
    from manager.tiny_model import _save_tokenizer

    config = text_only(json.loads((FIXTURES / f"{name}.json").read_text()))
    config.pop("quantization_config", None)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    _save_tokenizer(folder, int(config["vocab_size"]))
    return folder


def plan_for(
    folder: Path, utilization: float, max_len: int, eager: bool, tensor_parallel_size: int = 1
) -> dict[str, Any]:
    from manager.planner import PlanRequest, make_plan

    fields: dict[str, Any] = dict(
        model=str(folder),
        dtype="bfloat16",
        max_model_len=max_len,
        gpu_memory_utilization=utilization,
        gpu="detected",
        tensor_parallel_size=tensor_parallel_size,
    )
    if "enforce_eager" in PlanRequest.model_fields:
        fields["enforce_eager"] = eager
    plan = make_plan(PlanRequest(**fields))
    return {
        "kv_cache_tokens": plan.kv_cache_tokens,
        "kv_budget_gib": round(plan.kv_budget_bytes / GiB, 3),
        "overhead_gib": plan.line("overhead").value,
        "weights_gib": plan.line("weights_on_device").value,
        "usable_gib": plan.line("usable").value,
    }


def run_engine(
    folder: Path,
    log_path: Path,
    utilization: float,
    max_len: int,
    eager: bool,
    timeout: float,
    tensor_parallel_size: int = 1,
) -> str:
    argv = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(folder),
        "--load-format",
        "dummy",
        "--dtype",
        "bfloat16",
        "--max-model-len",
        str(max_len),
        "--gpu-memory-utilization",
        str(utilization),
        "--port",
        "8399",
    ] + (["--enforce-eager"] if eager else [])
    if tensor_parallel_size > 1:
        argv += ["--tensor-parallel-size", str(tensor_parallel_size)]
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "DEBUG"}
    with log_path.open("w") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    deadline = time.perf_counter() + timeout
    try:
        while time.perf_counter() < deadline and proc.poll() is None:
            text = log_path.read_text(errors="replace")
            if PATTERNS["kv_cache_tokens"].search(text):
                time.sleep(1)  # the graph-pool line follows capture; not waited for
                break
            time.sleep(0.5)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
        time.sleep(
            3 if tensor_parallel_size == 1 else 4
        )  # the GPU memory of the killed engine (every rank) is released
    return log_path.read_text(errors="replace")


def read_engine(text: str) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for key, pattern in PATTERNS.items():
        match = pattern.search(text)
        if match:
            value = match.group(1).replace(",", "")
            found[key] = int(value) if key == "kv_cache_tokens" else float(value)
    found["profile"] = [m.group(0)[-600:] for m in PROFILE.finditer(text)][:4]
    if match := GRAPH_GROUPS.search(text):
        found["graph_groups"] = match.group(1).strip()
    found["graph_modes"] = {
        m.group(1): {"first_mib": float(m.group(2)), "graphs": int(m.group(3)), "per_graph_mib": float(m.group(4))}
        for m in GRAPH_MODE.finditer(text)
    }
    for key, pattern in (("torch_peak_gib", TORCH_PEAK), ("non_kv_gib", NON_KV)):
        if match := pattern.search(text):
            found[key] = float(match.group(1))
    errors = [line for line in text.splitlines() if "Error" in line and "import_utils" not in line]
    if "kv_cache_tokens" not in found and errors:
        found["error"] = errors[-3:]
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/gpu-planner-out")))
    parser.add_argument("--work", type=Path, default=Path("/tmp/gpu-planner"))
    parser.add_argument("--utilization", type=float, default=0.85)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument(
        "--cases",
        nargs="*",
        default=None,
        help="SHAPE:UTILIZATION:MAX_LEN:eager|graphs each (instead of --shapes x both modes at one setting)",
    )
    parser.add_argument("--budget-s", type=float, default=520, help="stop starting new cases after this long")
    parser.add_argument("--shapes", nargs="*", default=SHAPES)
    parser.add_argument("--name", default="planner_gpu", help="the results file's name in OUT")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    wanted: list[tuple[str, float, int, bool]] = []
    if args.cases:
        for text in args.cases:
            name, util, length, mode = text.split(":")
            wanted.append((name, float(util), int(length), mode == "eager"))
    else:
        wanted = [(n, args.utilization, args.max_model_len, e) for n in args.shapes for e in (True, False)]
    started = time.perf_counter()
    results: dict[str, Any] = {"utilization": args.utilization, "max_model_len": args.max_model_len, "cases": []}
    for name, utilization, max_len, eager in wanted:
        folder = make_model(args.work / name, name)
        left = args.budget_s - (time.perf_counter() - started)
        case: dict[str, Any] = {"model": name, "eager": eager, "utilization": utilization, "max_model_len": max_len}
        if left < 40:
            results["cases"].append({**case, "skipped": "out of time"})
            continue
        try:
            case["plan"] = plan_for(folder, utilization, max_len, eager)
        except Exception as exc:  # a plan that fails is a finding too
            case["plan"] = {"error": f"{type(exc).__name__}: {exc}"}
        t0 = time.perf_counter()
        log = args.work / f"{name}-{utilization}-{max_len}-{'eager' if eager else 'graphs'}.log"
        text = run_engine(folder, log, utilization, max_len, eager, left - 5)
        case["engine"] = read_engine(text)
        case["seconds"] = round(time.perf_counter() - t0, 1)
        plan_tokens = case["plan"].get("kv_cache_tokens")
        engine_tokens = case["engine"].get("kv_cache_tokens")
        if plan_tokens and engine_tokens:
            case["plan_error_percent"] = round(100 * (plan_tokens - engine_tokens) / engine_tokens, 2)
        print(json.dumps(case), flush=True)
        results["cases"].append(case)
        (args.out / f"{args.name}.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
