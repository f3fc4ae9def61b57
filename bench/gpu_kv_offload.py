"""CPU KV offload inside vLLM on the GPU machine, with the plugin: what it does and what it refuses.

Runs there after ``source bench/gpu/env.sh`` (bench/README.md has the calls). Llama-3.1-8B shape,
dummy weights, eager, a GPU KV cache held small on purpose (``--kv-cache-memory-bytes``) and a CPU
tier from ``--kv-offloading-size``:

1. ``served``: a long prompt A is answered, two other long prompts push A's blocks out of the GPU
   cache, then A again: its prefix comes back from the CPU tier, seen in vLLM's own counters
   (prefix-cache hits from the external tier, offload bytes loaded) and in its time to first token
   against a prompt of the same length never seen before.
2. ``too_long``: max_model_len above what the GPU KV cache holds, with a CPU tier large enough for
   it: vLLM refuses to start, and the plugin's message says why the CPU tier does not help.
3. ``shm``: an offload size above /dev/shm's free space: refused before the region is made, with
   both sizes.

Results go to ``OUT/gpu_kv_offload.json`` as each case ends.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_planner import make_model
from gpu_sleep import http

GiB = 1024**3
WATCH = ("prefix_cache", "kv_offload", "prompt_tokens")


TP = ["--tensor-parallel-size", "1"]  # set from --tensor-parallel-size


def start(folder: Path, log: Path, port: int, extra: list[str]) -> subprocess.Popen[bytes]:
    argv = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(folder), "--served-model-name", "m", "--load-format", "dummy",
        "--dtype", "bfloat16", "--enforce-eager", "--port", str(port), *TP, *extra,
    ]  # fmt: skip
    env = {**os.environ, "VLLM_PLUGINS": "offload_patches", "VLLM_MANAGER_PATCHES": json.dumps({})}
    with log.open("w") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def wait(proc: subprocess.Popen[bytes], port: int, timeout: float) -> bool:
    """True when /health answers; False when the engine exits first."""
    deadline = time.perf_counter() + timeout
    while time.perf_counter() < deadline:
        if proc.poll() is not None:
            return False
        with contextlib.suppress(OSError):
            if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).status == 200:
                return True
        time.sleep(1)
    raise RuntimeError(f"no answer and no exit in {timeout:.0f} s")


def stop(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
    time.sleep(3)


def counters(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("vllm:") and any(w in line for w in WATCH):
            name = line.split("{", 1)[0].split(" ", 1)[0]
            with contextlib.suppress(ValueError):
                out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def prompt(seed: int, words: int) -> str:
    rng = random.Random(seed)
    return " ".join(f"w{rng.randrange(1000, 120000)}" for _ in range(words))


def ttft(port: int, text: str) -> float:
    seconds, _ = http(
        "POST", f"http://127.0.0.1:{port}/v1/completions", {"model": "m", "prompt": text, "max_tokens": 1}
    )
    return seconds


def log_lines(log: Path, *needles: str) -> list[str]:
    return [line[-700:] for line in log.read_text(errors="replace").splitlines() if any(n in line for n in needles)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/gpu-kv-out")))
    parser.add_argument("--work", type=Path, default=Path("/tmp/gpu-kv"))
    parser.add_argument("--model", default="Llama-3.1-8B-Instruct")
    parser.add_argument("--gpu-kv-gib", type=float, default=3.0, help="--kv-cache-memory-bytes")
    parser.add_argument("--cpu-gib", type=float, default=16.0, help="--kv-offloading-size")
    parser.add_argument("--words", type=int, default=10000, help="tokens per long prompt")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument(
        "--cases", nargs="+", choices=["served", "too_long", "shm"], default=["served", "too_long", "shm"]
    )
    args = parser.parse_args()
    TP[1] = str(args.tensor_parallel_size)
    suffix = f"_tp{args.tensor_parallel_size}" if args.tensor_parallel_size > 1 else ""
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    folder = make_model(args.work / args.model, args.model)
    kv = ["--kv-cache-memory-bytes", str(int(args.gpu_kv_gib * GiB))]
    results: dict[str, Any] = {
        "model": args.model,
        "gpu_kv_gib": args.gpu_kv_gib,
        "cpu_gib": args.cpu_gib,
        "tensor_parallel_size": args.tensor_parallel_size,
        "planned_region": planned_region(folder, args.cpu_gib, args.tensor_parallel_size),
    }

    def save() -> None:
        (args.out / f"gpu_kv_offload{suffix}.json").write_text(json.dumps(results, indent=1))

    if "served" in args.cases:
        served(folder, kv, args, results)
        save()
    if "too_long" in args.cases:
        too_long(folder, kv, args, results)
        save()
    if "shm" in args.cases:
        too_big_for_shm(folder, kv, args, results)
        save()
    return 0


def planned_region(folder: Path, cpu_gib: float, tp: int) -> dict[str, Any]:
    """What the planner says vLLM makes of ``--kv-offloading-size`` at this world size (planner/kv.py)."""
    sys.path.append(str(Path(__file__).resolve().parents[1]))
    from manager.planner.kv import kv_page_bytes, offload_prefix_tokens

    config = json.loads((folder / "config.json").read_text())
    tokens = offload_prefix_tokens(int(cpu_gib * GiB), config, tensor_parallel_size=tp, dtype="bfloat16")
    return {
        "block_bytes_all_ranks": kv_page_bytes(config, tensor_parallel_size=tp, dtype="bfloat16"),
        "cpu_blocks": tokens // 16,  # vLLM's block of 16 tokens
        "prefix_tokens": tokens,
    }


def shm_regions() -> list[dict[str, Any]]:
    """vLLM's CPU KV offload regions in /dev/shm, with their sizes."""
    found = []
    for path in sorted(Path("/dev/shm").glob("vllm_offload_*")):
        with contextlib.suppress(OSError):
            found.append({"file": path.name, "bytes": path.stat().st_size})
    return found


def served(folder: Path, kv: list[str], args: argparse.Namespace, results: dict[str, Any]) -> None:
    """A prefix pushed out of the GPU cache comes back from the CPU tier."""
    log = args.work / "served.log"
    proc = start(folder, log, 8500, [*kv, "--max-model-len", "16384", "--kv-offloading-size", str(args.cpu_gib)])
    case: dict[str, Any] = {}
    try:
        if not wait(proc, 8500, 400):
            raise RuntimeError("\n".join(log.read_text(errors="replace").splitlines()[-20:]))
        a, b, c, fresh = (prompt(seed, args.words) for seed in (1, 2, 3, 4))
        before = counters(8500)
        case["a_first_s"] = round(ttft(8500, a), 3)
        case["b_s"], case["c_s"] = round(ttft(8500, b), 3), round(ttft(8500, c), 3)
        time.sleep(1)  # the offload stores finish off the request's path
        middle = counters(8500)
        case["a_again_s"] = round(ttft(8500, a), 3)
        after = counters(8500)
        case["fresh_same_length_s"] = round(ttft(8500, fresh), 3)
        case["counters_during_fill"] = {k: middle.get(k, 0) - before.get(k, 0) for k in middle}
        case["counters_for_a_again"] = {k: after.get(k, 0) - middle.get(k, 0) for k in after}
        case["kv_lines"] = log_lines(log, "GPU KV cache size", "Maximum concurrency", "offload", "engine_patches")[:12]
        case["shm_regions"] = shm_regions()
    except Exception as exc:
        case["error"] = str(exc)[-3000:]
    finally:
        stop(proc)
    results["served"] = case


def too_long(folder: Path, kv: list[str], args: argparse.Namespace, results: dict[str, Any]) -> None:
    """max_model_len beyond the GPU KV cache, with a CPU tier that could hold it: refused, and why."""
    log = args.work / "too_long.log"
    proc = start(folder, log, 8501, [*kv, "--max-model-len", "65536", "--kv-offloading-size", str(args.cpu_gib)])
    try:
        started = wait(proc, 8501, 300)
        results["too_long"] = {
            "started": started,
            "message": log_lines(log, "The GPU KV cache cannot hold")[:2],
            "vllm": log_lines(log, "max_model_len", "KV cache is needed")[-3:],
        }
    finally:
        stop(proc)


def too_big_for_shm(folder: Path, kv: list[str], args: argparse.Namespace, results: dict[str, Any]) -> None:
    """An offload region larger than /dev/shm: refused before it is made."""
    free = shutil.disk_usage("/dev/shm").free if os.path.isdir("/dev/shm") else 0
    size = int(free / GiB) + 8
    log = args.work / "shm.log"
    proc = start(folder, log, 8502, [*kv, "--max-model-len", "4096", "--kv-offloading-size", str(size)])
    try:
        started = wait(proc, 8502, 300)
        results["shm"] = {
            "shm_free_gib": round(free / GiB, 2),
            "asked_gib": size,
            "started": started,
            "message": log_lines(log, "The CPU KV offload region needs")[:2],
        }
    finally:
        stop(proc)


if __name__ == "__main__":
    sys.exit(main())
