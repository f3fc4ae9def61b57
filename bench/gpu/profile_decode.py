"""Where a decode step's time goes inside real vLLM 0.32.0 with MoE expert offload: a torch profile.

Runs on the GPU machine after ``source bench/gpu/env.sh`` (bench/README.md has the call). One engine
of a ``bench/gpu_moe_graphs.py`` case (same model, same argv from the manager's ``build_command``),
started with vLLM's torch profiler (``--profiler-config``). For each batch size it decodes a while,
then profiles ``--steps`` engine steps of decode (vLLM's ``/start_profile`` with ``delay_iterations``
and ``max_iterations``) and reads the worker's trace back:

- GPU time: the union of kernels and copies on the device, its idle time, and the gaps between them
  (how many, how long, what they total);
- the kernels by name (total ms and calls per step), so the expert reads can be told from the rest;
- for each idle gap of ``--gap-us`` or more: whether the kernel after it was launched only after the GPU
  had gone idle (the CPU was late: a sync, or Python slower than the GPU) or before (the GPU waited
  on something else), and the CPU op that launched it;
- the host calls that wait for the GPU (cudaStreamSynchronize, cudaEventSynchronize, cudaMemcpy,
  cudaDeviceSynchronize), with the op they ran under.

Results: ``OUT/<name>.json`` (a summary per batch), and the smallest raw trace beside it.

    python3 bench/gpu/profile_decode.py --out $OUT --case offload_25 --batches 64 1
"""

from __future__ import annotations

import argparse
import bisect
import collections
import gzip
import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import gpu_moe_graphs as moe  # noqa: E402

WAITS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize", "cudaMemcpy", "cudaStreamWaitEvent")
GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
GAP_EDGES_US = (5, 20, 100, 1000)
GAP_BUCKETS = ("<5us", "5-20us", "20-100us", "100us-1ms", ">1ms")


def load_trace(path: Path) -> list[dict[str, Any]]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return list(json.load(f).get("traceEvents", []))


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def innermost(ops: list[tuple[float, float, str]], starts: list[float], ts: float) -> str:
    """The shortest CPU op on the thread that encloses ``ts`` (ops sorted by start)."""
    best, best_dur = "?", float("inf")
    i = bisect.bisect_right(starts, ts) - 1
    seen = 0
    while i >= 0 and seen < 400:  # enclosing ops start earlier; look back a bounded way
        start, end, name = ops[i]
        if end >= ts and end - start < best_dur:
            best, best_dur = name, end - start
        i -= 1
        seen += 1
    return best


def summarise(events: list[dict[str, Any]], steps: int, gap_us: float) -> dict[str, Any]:
    """The figures above, per step: ``steps`` where the trace holds no step annotation of vLLM's."""
    forwards = [e for e in events if e.get("ph") == "X" and e.get("name") == "gpu_model_runner: forward"]
    contexts = [
        e for e in events if e.get("cat") == "user_annotation" and str(e.get("name")).startswith("execute_context")
    ]
    steps = len(forwards) or len(contexts) or steps
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in GPU_CATS]
    if not gpu:
        return {"error": "no GPU events in the trace"}
    runtime = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("cuda_runtime", "cuda_driver")]
    launch_of = {e["args"].get("correlation"): e for e in runtime if "correlation" in e.get("args", {})}
    cpu_ops: dict[Any, list[tuple[float, float, str]]] = collections.defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "python_function", "user_annotation"):
            cpu_ops[e.get("tid")].append((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)), str(e["name"])))
    starts: dict[Any, list[float]] = {}
    for tid, ops in cpu_ops.items():
        ops.sort()
        starts[tid] = [o[0] for o in ops]

    gpu.sort(key=lambda e: float(e["ts"]))
    spans = union([(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))) for e in gpu])
    first, last = spans[0][0], spans[-1][1]
    busy = sum(end - start for start, end in spans)
    gaps = [(spans[i][1], spans[i + 1][0]) for i in range(len(spans) - 1)]
    gpu_starts = [float(e["ts"]) for e in gpu]

    big: list[dict[str, Any]] = []
    late_total = waiting_total = 0.0
    by_op: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for start, end in gaps:
        length = end - start
        if length < gap_us:
            continue
        nxt = gpu[bisect.bisect_left(gpu_starts, end)]
        launch = launch_of.get(nxt.get("args", {}).get("correlation"))
        late = launch is not None and float(launch["ts"]) > start
        op = (
            innermost(cpu_ops.get(launch.get("tid"), []), starts.get(launch.get("tid"), []), float(launch["ts"]))
            if launch
            else "?"
        )
        if late:
            late_total += length
        else:
            waiting_total += length
        key = f"{'late' if late else 'waits'}: {op[:90]} -> {str(nxt['name'])[:60]}"
        by_op[key][0] += 1
        by_op[key][1] += length
        if len(big) < 40:
            big.append(
                {"us": round(length, 1), "launched_late": late, "op": op[:120], "next_kernel": str(nxt["name"])[:100]}
            )

    kernels: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for e in gpu:
        name = str(e["name"])[:100]
        kernels[name][0] += 1
        kernels[name][1] += float(e.get("dur", 0))
    waits: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for e in runtime:
        if str(e["name"]).startswith(WAITS):
            op = innermost(cpu_ops.get(e.get("tid"), []), starts.get(e.get("tid"), []), float(e["ts"]))
            key = f"{e['name']} under {op[:90]}"
            waits[key][0] += 1
            waits[key][1] += float(e.get("dur", 0))

    def per_step(table: dict[str, list[float]], top: int) -> list[dict[str, Any]]:
        rows = sorted(table.items(), key=lambda kv: -kv[1][1])[:top]
        return [
            {"name": k, "calls_per_step": round(v[0] / steps, 2), "ms_per_step": round(v[1] / steps / 1e3, 3)}
            for k, v in rows
        ]

    hist = collections.Counter(GAP_BUCKETS[bisect.bisect_right(GAP_EDGES_US, end - start)] for start, end in gaps)
    window = last - first
    return {
        "steps": steps,
        "forward_cpu_ms_per_step": (
            round(sum(float(e.get("dur", 0)) for e in forwards) / steps / 1e3, 3) if forwards else None
        ),
        "window_ms_per_step": round(window / steps / 1e3, 3),
        "gpu_busy_ms_per_step": round(busy / steps / 1e3, 3),
        "gpu_idle_ms_per_step": round((window - busy) / steps / 1e3, 3),
        "idle_in_gaps_of_gap_us_or_more_ms_per_step": {
            "gpu_waiting_for_cpu": round(late_total / steps / 1e3, 3),
            "kernel_queued_already": round(waiting_total / steps / 1e3, 3),
        },
        "gap_histogram": dict(hist),
        "gaps_by_op": per_step(by_op, 25),
        "largest_gaps_first_40": big,
        "kernels": per_step(kernels, 40),
        "host_waits": per_step(waits, 20),
        "gpu_events": len(gpu),
    }


def post(base: str, path: str, body: dict[str, Any] | None = None) -> None:
    moe.http("POST", base + path, body or {})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/profile-decode-out")))
    parser.add_argument("--work", type=Path, default=Path("/tmp/gpu-moe-graphs"))
    parser.add_argument("--name", default="profile_decode")
    parser.add_argument("--case", default="offload_25", help="a bench/gpu_moe_graphs.py case")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--cache-fraction", type=float, default=0.25)
    parser.add_argument("--batches", type=int, nargs="*", default=[64, 1])
    parser.add_argument("--steps", type=int, default=4, help="decode steps profiled per batch")
    parser.add_argument("--gap-us", type=float, default=20.0)
    parser.add_argument("--start-timeout", type=float, default=400)
    parser.add_argument("--engine-args", nargs="*", default=[])
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    traces = args.work / "traces"
    shutil.rmtree(traces, ignore_errors=True)
    traces.mkdir(parents=True)

    cfg = moe.make_model(args.work / "model", args.layers, moe.FIXTURE)
    all_experts = moe.expert_bytes(cfg)
    # The engine settings gpu_moe_graphs.Engine reads, at that bench's defaults, plus the profiler.
    engine_ns = moe.build_parser().parse_args([])
    engine_ns.work = args.work
    engine_ns.uva_args = moe.uva_args(all_experts)
    engine_ns.engine_args = [
        *args.engine_args,
        "--profiler-config",
        json.dumps({"profiler": "torch", "torch_profiler_dir": str(traces), "torch_profiler_with_stack": False}),
    ]
    fraction = moe.cache_fraction(args.case, args.cache_fraction)
    gib = round(fraction * all_experts / moe.GiB, 4) if fraction is not None else None
    results: dict[str, Any] = {"case": args.case, "cache_gib": gib, "layers": args.layers, "batches": {}}
    engine = moe.Engine(args.case, args.work / "model", 8600, gib, engine_ns)
    try:
        results["start_s"] = round(engine.wait_ready(args.start_timeout), 1)
        for batch in args.batches:
            prompts = moe.PROMPTS[:batch]
            engine.complete(prompts, 16, ignore_eos=True)  # warm-up: compiles, the cache fills
            before = set(traces.rglob("*"))
            # Skip the prefill and the first decode steps, then profile ``steps`` of them.
            post(
                engine.base,
                "/start_profile",
                {"delay_iterations": 6, "max_iterations": args.steps, "profile_prefix": f"b{batch}"},
            )
            seconds, _ = engine.complete(prompts, 6 + args.steps + 8, ignore_eos=True)
            post(engine.base, "/stop_profile")
            deadline = time.monotonic() + 120
            found: list[Path] = []
            while time.monotonic() < deadline:
                found = [p for p in set(traces.rglob("*.json*")) - before if p.is_file()]
                if found and all(p.stat().st_size > 0 for p in found):
                    time.sleep(3)  # the writer may still be finishing
                    break
                time.sleep(2)
            summary: dict[str, Any] = {"request_s": round(seconds, 3), "trace_files": [p.name for p in found]}
            for path in sorted(found, key=lambda p: -p.stat().st_size):
                events = load_trace(path)
                if any(e.get("cat") == "kernel" for e in events):
                    summary.update(summarise(events, args.steps, args.gap_us))
                    if path.stat().st_size < 15 * 2**20 and not (args.out / path.name).exists():
                        shutil.copy(path, args.out / f"{args.name}_b{batch}{''.join(path.suffixes[-2:])}")
                    break
            results["batches"][str(batch)] = summary
            print(
                json.dumps(
                    {
                        batch: {
                            k: summary.get(k)
                            for k in (
                                "window_ms_per_step",
                                "gpu_busy_ms_per_step",
                                "gpu_idle_ms_per_step",
                                "idle_in_gaps_of_gap_us_or_more_ms_per_step",
                            )
                        }
                    }
                ),
                flush=True,
            )
            (args.out / f"{args.name}.json").write_text(json.dumps(results, indent=1))
    except Exception as exc:  # the summary says what failed
        results["error"] = str(exc)[-3000:]
        print(results["error"], flush=True)
    finally:
        results["log"] = engine.log_lines()
        engine.stop()
        (args.out / f"{args.name}.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
