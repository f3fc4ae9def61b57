"""MoE expert offload with CUDA graphs inside real vLLM 0.32.0, against resident experts and vLLM's own offload.

Runs on the GPU machine after ``source bench/gpu/env.sh`` (bench/README.md has the calls). One model,
one engine at a time, each launched with the argv and environment the manager's own
``build_command`` makes (so the manager's CUDA graph limit for offload is what runs). Cases:

- ``offload_NN``: MoE expert offload with a GPU cache of NN % of the expert bytes, CUDA graphs on;
  the manager adds ``--max-cudagraph-capture-size`` = max(slots per layer / top_k, 16), and the plugin
  plans batches of up to 64 tokens on the GPU, their experts that find no slot read in place. ``offload_NN_eager``
  adds ``--enforce-eager``; ``offload_graphs`` / ``offload_eager`` use ``--cache-fraction``.
  ``offload_NN_ahead`` fetches ahead (the plugin's ``moe_fetch_ahead``): while a layer runs, the
  stand-in's guess at the next layer's experts, right ``--guess-accuracy`` of the time
  (``offload_NN_aheadAA``: AA %), is fetched on a side stream. ``offload_NN_inplaceTT`` plans batches
  of up to TT tokens on the GPU (the plugin's ``moe_in_place_tokens``, 64 by default) and captures
  graphs up to that size (``--max-cudagraph-capture-size TT``). A case with ``_freq`` in its name
  evicts by decayed use counts (the plugin's ``moe_cache_policy: "frequency"``, its default since
  2026-11-27), one with ``_lru`` the least recently used expert. One with ``_stage`` gathers the
  experts of a batch past the cache that find no slot into a staging buffer and computes them there
  (the plugin's ``moe_stage_overflow``), instead of reading them in place.
- ``resident``: every expert on the GPU, CUDA graphs on (vLLM's defaults).
- ``vllm_uva``: vLLM's own expert offload, ``--cpu-offload-gb <all expert GiB> --cpu-offload-params
  experts --offload-backend uva``: every expert stays in pinned host memory and vLLM's kernel
  reads the routed ones over the link at every step.

``--routing zipf`` sets ``VLLM_MOE_ROUTING_SIMULATION_STRATEGY=engine_patches_zipf_reuse`` in every
engine (the plugin's benchmark stand-in: Zipf(1.0) expert popularity per layer, each sequence
keeping each expert of its previous token with probability 0.5, as in bench/moe_offload.py);
dummy weights otherwise send nearly every token to the same experts. Under it the answers are
meaningless, so greedy outputs are compared only without it.

Per engine: start time, the engine's own log lines, decode tokens/s at each batch size (two
lengths, so the prefill cancels out) and, for the offload cases, the bytes the expert cache moved
per decode token, from the plugin's stats channel (the same two lengths, differenced). The link
bound of a case is its decode bytes per token over the pinned host-to-GPU bandwidth measured in
the same call; for ``vllm_uva`` the bytes are the distinct routed experts per layer and step, taken
from the stand-in's own routing. Results go to ``OUT/gpu_moe_graphs.json`` after each engine.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from gpu_sleep import http  # noqa: E402

from engine_patches.stats import read_stats  # noqa: E402

FIXTURE = ROOT / "tests" / "fixtures" / "model_configs" / "Qwen3-30B-A3B.json"
GiB = 1024**3
WORDS = ("river", "bridge", "market", "tower", "garden", "harbour", "wall", "gate")
PROMPTS = [f"The {w} of the city is" for w in WORDS] + [
    f"Story {i}: the {WORDS[i % 8]} of the city is" for i in range(8, 256)
]
STANDIN = "engine_patches_zipf_reuse"
LOG_NEEDLES = (
    "GPU KV cache size",
    "Graph capturing finished",
    "Capturing CUDA graphs",
    "cudagraph",
    "MoE expert offload",
    "offload_patches active",
    "Model loading took",
    "torch.compile took",
    "Error",
    "Traceback",
)


def make_model(folder: Path, layers: int, config_path: Path) -> dict[str, Any]:
    from manager.tiny_model import _save_tokenizer

    cfg = json.loads(config_path.read_text())
    cfg["num_hidden_layers"] = cfg["max_window_layers"] = layers
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    if not (folder / "tokenizer.json").exists():
        _save_tokenizer(folder, int(cfg["vocab_size"]))
    return cfg


def expert_bytes(cfg: dict[str, Any]) -> int:
    from engine_patches.moe.sizing import expert_offload_sizing

    return expert_offload_sizing(
        num_experts=cfg.get("num_experts") or cfg["num_local_experts"],
        num_layers=cfg["num_hidden_layers"],
        hidden_size=cfg["hidden_size"],
        moe_intermediate_size=cfg["moe_intermediate_size"],
        dtype_bytes=2,
        cache_gib=0,
        top_k=cfg["num_experts_per_tok"],
    ).all_expert_bytes


class Engine:
    def __init__(self, case: str, folder: Path, port: int, cache_gib: float | None, args: argparse.Namespace):
        """``cache_gib`` None: experts resident, or in vLLM's own UVA offload for ``vllm_uva``."""
        from manager.launch.command import build_command
        from manager.schemas.model_config import ModelConfig
        from manager.schemas.offload_profile import OffloadProfile

        self.case, self.port = case, port
        in_place = in_place_tokens(case)
        self.run_dir = args.work / f"run-{case}"
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.log = args.work / f"{case}.log"
        config = ModelConfig(
            name=case,
            model=str(folder),
            dtype="bfloat16",
            max_model_len=args.max_model_len,
            max_num_seqs=args.max_num_seqs,
            gpu_memory_utilization=args.utilization,
            enforce_eager=case.endswith("eager"),
            tensor_parallel_size=args.tensor_parallel_size,
            gpu_ids=list(range(args.tensor_parallel_size)) if args.tensor_parallel_size > 1 else [],
            extra_args=[
                "--load-format",
                "dummy",
                *args.engine_args,
                *(args.uva_args if case == "vllm_uva" else []),
                *(["--max-cudagraph-capture-size", str(in_place)] if in_place is not None else []),
            ],
        )
        profile = (
            OffloadProfile(name="moe", moe_expert_offload=True, moe_gpu_cache_gib=cache_gib)
            if cache_gib is not None
            else None
        )
        cmd = build_command(config, profile, engine_python=sys.executable, port=port, run_dir=self.run_dir)
        self.argv, self.notes = cmd.argv, cmd.notes
        env = {**os.environ, **cmd.env}
        accuracy = guess_accuracy(case, args.guess_accuracy)
        # The plugin settings a case changes, on top of those the manager wrote.
        patches: dict[str, Any] = {}
        if args.stream_below_hit_rate:
            patches["moe_stream_below_hit_rate"] = args.stream_below_hit_rate
        if in_place is not None:
            patches["moe_in_place_tokens"] = in_place
        if "_freq" in case:
            patches["moe_cache_policy"] = "frequency"
        if "_lru" in case:
            patches["moe_cache_policy"] = "lru"
        if "_stage" in case:
            patches["moe_stage_overflow"] = True
        if accuracy is not None:
            patches["moe_fetch_ahead"] = True
            env["ENGINE_PATCHES_STANDIN_GUESS"] = str(accuracy)
        if patches:
            env["VLLM_MANAGER_PATCHES"] = json.dumps({**json.loads(env["VLLM_MANAGER_PATCHES"]), **patches})
        env.pop("VLLM_MOE_ROUTING_SIMULATION_STRATEGY", None)
        if args.routing == "zipf":
            env["VLLM_MOE_ROUTING_SIMULATION_STRATEGY"] = STANDIN
        self.t0 = time.perf_counter()
        with self.log.open("w") as log:
            self.proc = subprocess.Popen(
                cmd.argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        self.base = f"http://127.0.0.1:{port}"

    def wait_ready(self, timeout: float) -> float:
        deadline = time.perf_counter() + timeout
        while time.perf_counter() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.case} exited: {self.tail()}")
            with contextlib.suppress(OSError):
                if urllib.request.urlopen(self.base + "/health", timeout=2).status == 200:
                    return time.perf_counter() - self.t0
            time.sleep(1)
        raise RuntimeError(f"{self.case} not ready in {timeout:.0f} s: {self.tail()}")

    def tail(self) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-25:])

    def complete(self, prompts: list[str], max_tokens: int, ignore_eos: bool = False) -> tuple[float, list[str]]:
        body = {
            "model": self.case,
            "prompt": prompts,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": ignore_eos,
        }
        seconds, out = http("POST", self.base + "/v1/completions", body)
        texts = [c["text"] for c in sorted(out["choices"], key=lambda c: c["index"])]
        return seconds, texts

    def decode_rate(self, batch: int, short: int, long: int, repeats: int) -> dict[str, Any]:
        """Tokens/s of decode at ``batch`` sequences: the extra tokens of a long run over its extra time."""
        prompts = PROMPTS[:batch]
        self.complete(prompts, short, ignore_eos=True)  # warm-up
        rates: list[float] = []
        seconds: list[list[float]] = []  # [short, long] of each repeat, to tell a stall from a slow step
        dropped = 0
        for _ in range(repeats):
            t_short, _ = self.complete(prompts, short, ignore_eos=True)
            t_long, _ = self.complete(prompts, long, ignore_eos=True)
            seconds.append([round(t_short, 3), round(t_long, 3)])
            if t_long <= t_short:  # a stall in the short run: no decode time to divide by
                dropped += 1
                continue
            rates.append(batch * (long - short) / (t_long - t_short))
        if not rates:
            return {"dropped": dropped, "short": short, "long": long, "seconds": seconds}
        return {
            "tok_s": round(statistics.median(rates), 1),
            "per_seq_tok_s": round(statistics.median(rates) / batch, 1),
            "runs": [round(r, 1) for r in rates],
            "dropped": dropped,
            "short": short,
            "long": long,
            "seconds": seconds,
        }

    def cache_snapshot(self) -> dict[str, Any] | None:
        """The expert cache's counters once the engine is idle: the plugin's publisher thread puts the
        counters of the last whole step (graph replays included) on the stats channel within about
        two seconds; read until two reads a second and a half apart agree."""
        last: dict[str, Any] | None = None
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            time.sleep(1.5)
            stats = self.expert_stats()
            now = stats[-1] if stats else None
            if now is not None and last is not None and now.get("tokens") == last.get("tokens"):
                return now
            last = now
        return last

    def decode_bytes(self, batch: int, short: int, long: int) -> dict[str, Any]:
        """Host-to-GPU bytes the expert cache moved per decode token at ``batch`` sequences."""
        prompts = PROMPTS[:batch]
        s0 = self.cache_snapshot()
        self.complete(prompts, long, ignore_eos=True)
        s1 = self.cache_snapshot()
        self.complete(prompts, short, ignore_eos=True)
        s2 = self.cache_snapshot()
        if not (s0 and s1 and s2):
            return {"error": "the plugin published no expert cache stats"}

        def delta(a: dict[str, Any], b: dict[str, Any], key: str) -> float:
            return float(b[key]) - float(a[key])

        # Each difference holds one prefill of the same prompts: they cancel. Experts read in
        # place (moe_stream_below_hit_rate) cross the link too.
        for snap in (s0, s1, s2):
            snap["link_bytes"] = float(snap["bytes_moved"]) + float(snap.get("streamed_bytes") or 0)
        moved = delta(s0, s1, "link_bytes") - delta(s1, s2, "link_bytes")
        tokens = delta(s0, s1, "tokens") - delta(s1, s2, "tokens")
        hits = delta(s0, s1, "hits") - delta(s1, s2, "hits")
        misses = delta(s0, s1, "misses") - delta(s1, s2, "misses")
        for snap in (s0, s1, s2):  # experts fetched ahead on a guess (their bytes are in bytes_moved)
            for key in ("ahead_used", "ahead_wasted", "ahead_bytes"):
                snap.setdefault(key, 0)
        used = delta(s0, s1, "ahead_used") - delta(s1, s2, "ahead_used")
        wasted = delta(s0, s1, "ahead_wasted") - delta(s1, s2, "ahead_wasted")
        ahead_bytes = delta(s0, s1, "ahead_bytes") - delta(s1, s2, "ahead_bytes")
        return {
            "guess_hit_rate": round(used / (used + wasted), 4) if used + wasted > 0 else None,
            "ahead_bytes_per_token": round(ahead_bytes / tokens) if tokens > 0 else None,
            "decode_tokens_counted": int(tokens),
            "decode_tokens_asked": batch * (long - short),
            "bytes_per_token": round(moved / tokens) if tokens > 0 else None,
            "hit_rate": round(hits / (hits + misses), 4) if hits + misses > 0 else None,
            "snapshots": [
                {
                    k: x.get(k)
                    for k in ("tokens", "bytes_moved", "streamed_bytes", "hits", "misses", "ahead_used", "ahead_wasted")
                }
                for x in (s0, s1, s2)
            ],
        }

    def expert_stats(self) -> list[dict[str, Any]]:
        # Live engine processes only: an earlier engine of this case on the same machine left its file.
        return [doc["expert_cache"] for doc in read_stats(self.run_dir) if "expert_cache" in doc]

    def log_lines(self) -> list[str]:
        text = self.log.read_text(errors="replace").splitlines()
        return [line[-300:] for line in text if any(n in line for n in LOG_NEEDLES)][:60]

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)
        time.sleep(3)  # the GPU memory of the stopped engine is released


def kv_tokens(lines: list[str]) -> int | None:
    for line in lines:
        m = re.search(r"KV cache size: ([\d,]+) tokens", line)
        if m:
            return int(m.group(1).replace(",", ""))
    return None


def lengths(batch: int, args: argparse.Namespace) -> tuple[int, int]:
    """Short and long completion lengths at ``batch``: fewer decode steps for the big batches."""
    return (args.short, args.long) if batch < 32 else (args.short_big, args.long_big)


def run_case(case: str, folder: Path, cache_gib: float | None, port: int, args: argparse.Namespace) -> dict[str, Any]:
    engine = Engine(case, folder, port, cache_gib, args)
    result: dict[str, Any] = {"argv": engine.argv[3:], "notes": engine.notes}
    try:
        result["start_s"] = round(engine.wait_ready(args.start_timeout), 1)
        if args.routing == "model":  # under the stand-in the answers mean nothing
            _, result["greedy_1"] = engine.complete(PROMPTS[:1], args.greedy_tokens)
            _, result["greedy_8"] = engine.complete(PROMPTS[:8], args.greedy_tokens)
        result["decode"] = {}
        for b in args.batches:
            result["decode"][str(b)] = engine.decode_rate(b, *lengths(b, args), args.repeats)
            if cache_gib is not None:
                result["decode"][str(b)]["moved"] = engine.decode_bytes(b, *lengths(b, args))
            print(f"   {case} batch {b}: {json.dumps(result['decode'][str(b)])}", flush=True)
        result["expert_cache"] = engine.expert_stats()[-1:]
    except Exception as exc:
        result["error"] = str(exc)[-3000:]
    finally:
        result["log"] = engine.log_lines()
        result["kv_cache_tokens"] = kv_tokens(result["log"])
        engine.stop()
    return result


def compare(cases: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Greedy texts of every offload case against the resident engine's."""
    out: dict[str, Any] = {}
    for a in cases:
        b = "resident"
        if a == b or b not in cases or "greedy_8" not in cases[a] or "greedy_8" not in cases[b]:
            continue
        same_1 = cases[a]["greedy_1"] == cases[b]["greedy_1"]
        same_8 = [x == y for x, y in zip(cases[a]["greedy_8"], cases[b]["greedy_8"], strict=True)]
        out[f"{a}_vs_{b}"] = {"batch1_equal": same_1, "batch8_equal": same_8, "all_equal": same_1 and all(same_8)}
    return out


def guess_accuracy(case: str, default: float) -> float | None:
    """offload_25_ahead -> ``default``, offload_25_ahead50 -> 0.5; None for a case that does not fetch ahead."""
    match = re.search(r"_ahead(\d*)$", case)
    if match is None:
        return None
    return int(match.group(1)) / 100 if match.group(1) else default


def in_place_tokens(case: str) -> int | None:
    """offload_25_inplace64 -> 64; None where the case keeps the plugin's default."""
    match = re.search(r"_inplace(\d+)", case)
    return int(match.group(1)) if match else None


def cache_fraction(case: str, default: float) -> float | None:
    """offload_25 -> 0.25, offload_graphs / offload_eager -> the default; None for the others."""
    if not case.startswith("offload"):
        return None
    part = case.split("_")[1]
    return int(part) / 100 if part.isdigit() else default


def pinned_bandwidth() -> float:
    """Pinned host-to-GPU copy rate in GB/s (1 GiB, median of 5), in a child so this process holds no GPU."""
    code = (
        "import torch, statistics, time\n"
        "n = 1 << 30\n"
        "h = torch.empty(n, dtype=torch.uint8).pin_memory(); d = torch.empty(n, dtype=torch.uint8, device='cuda')\n"
        "ts = []\n"
        "for _ in range(6):\n"
        "    torch.cuda.synchronize(); t = time.perf_counter(); d.copy_(h, non_blocking=True); torch.cuda.synchronize()\n"
        "    ts.append(time.perf_counter() - t)\n"
        "print(n / statistics.median(ts[1:]) / 1e9)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    return float(out.stdout.strip().splitlines()[-1])


@functools.cache
def routed_experts_per_step(experts: int, top_k: int, layers: int, batch: int, steps: int = 200) -> float:
    """Distinct experts per layer and decode step under the stand-in's routing (what UVA reads)."""
    import torch

    from engine_patches.moe.routing_standin import ZipfReuseRouting

    torch.manual_seed(0)
    counts = []
    for layer in range(layers):
        routing = ZipfReuseRouting(experts, top_k, layer=layer)
        for step in range(steps + 10):
            _, ids = routing.route(batch, "cpu")
            if step >= 10:
                counts.append(len(torch.unique(ids)))
    return statistics.mean(counts)


def link_bounds(results: dict[str, Any], cfg: dict[str, Any], args: argparse.Namespace) -> None:
    """Add each case's link bound (tok/s if only its host-to-GPU bytes took time) and its ratio."""
    gbs = results.get("pinned_gb_s")
    experts = cfg.get("num_experts") or cfg["num_local_experts"]
    # Per rank: under tensor parallelism each rank reads its share of every routed expert over its own
    # link (the offload cases' stats are already one rank's).
    per_expert = results["expert_gib"] * GiB / (args.layers * experts) / max(1, args.tensor_parallel_size)
    for case, r in results["cases"].items():
        for b, d in r.get("decode", {}).items():
            if not gbs or "tok_s" not in d:
                continue
            if case == "vllm_uva" and args.routing == "zipf":
                distinct = routed_experts_per_step(experts, cfg["num_experts_per_tok"], args.layers, int(b))
                per_token = args.layers * distinct * per_expert / int(b)
                d["uva_distinct_experts_per_layer_step"] = round(distinct, 2)
            elif (d.get("moved") or {}).get("bytes_per_token"):
                per_token = d["moved"]["bytes_per_token"]
            else:
                continue
            d["bytes_per_token"] = round(per_token)
            d["link_bound_tok_s"] = round(gbs * 1e9 / per_token, 1) if per_token else None
            d["x_link_bound"] = round(d["link_bound_tok_s"] / d["tok_s"], 3) if per_token else None


def uva_args(all_expert_bytes: int) -> list[str]:
    """vLLM's own expert offload of every expert (``vllm_uva``): it offloads parameters until this is reached."""
    return [
        "--cpu-offload-gb",
        f"{all_expert_bytes / GiB + 0.01:.2f}",
        "--cpu-offload-params",
        "experts",
        "--offload-backend",
        "uva",
    ]


def build_parser() -> argparse.ArgumentParser:
    """This bench's options; ``Engine`` reads its engine settings from the parsed namespace."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/gpu-moe-graphs-out")))
    parser.add_argument("--work", type=Path, default=Path("/tmp/gpu-moe-graphs"))
    parser.add_argument("--config", type=Path, default=FIXTURE, help="a Qwen3-MoE config.json (tests: a tiny one)")
    parser.add_argument("--layers", type=int, default=12, help="layers of the model (Qwen3-30B-A3B has 48)")
    parser.add_argument("--cache-fraction", type=float, default=0.25, help="GPU expert cache of offload_graphs")
    parser.add_argument(
        "--cases", nargs="*", default=["offload_25", "vllm_uva", "resident", "offload_10", "offload_50"]
    )
    parser.add_argument("--routing", choices=["zipf", "model"], default="zipf", help="the stand-in, or the model's own")
    parser.add_argument("--utilization", type=float, default=0.85)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--batches", type=int, nargs="*", default=[1, 8, 64])
    parser.add_argument("--short", type=int, default=16)
    parser.add_argument("--long", type=int, default=144)
    parser.add_argument("--short-big", type=int, default=8, help="short length at batches of 32 and more")
    parser.add_argument("--long-big", type=int, default=40, help="long length at batches of 32 and more")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--greedy-tokens", type=int, default=32)
    parser.add_argument("--start-timeout", type=float, default=240)
    parser.add_argument("--name", default="gpu_moe_graphs", help="the JSON's file name under --out, without .json")
    parser.add_argument("--engine-args", nargs="*", default=[], help="more vLLM flags for every engine")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="GPUs 0..N-1 per engine, as a config's")
    parser.add_argument(
        "--guess-accuracy",
        type=float,
        default=0.8,
        help="offload_NN_ahead cases: how often the stand-in's guess at the next layer's experts is right",
    )
    parser.add_argument(
        "--stream-below-hit-rate",
        type=float,
        default=0.0,
        help="the plugin's moe_stream_below_hit_rate for the offload cases (0: off, as by default)",
    )
    return parser


def main() -> int:
    args = build_parser().parse_args()
    # `timeout` ends a run with SIGTERM: the engine in hand is then stopped as at a normal end (it runs in
    # its own session, so nothing else would stop it, and the next check would find its GPU full).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)

    cfg = make_model(args.work / "model", args.layers, args.config)
    all_experts = expert_bytes(cfg)
    args.uva_args = uva_args(all_experts)
    results: dict[str, Any] = {
        "model": f"{cfg['model_type']} {args.config.stem} shape, {args.layers} layers, dummy weights, bf16",
        "routing": "stand-in: Zipf(1.0) per layer, reuse 0.5" if args.routing == "zipf" else "the model's own",
        "expert_gib": round(all_experts / GiB, 3),
        "max_num_seqs": args.max_num_seqs,
        "cases": {},
    }
    with contextlib.suppress(Exception):
        results["pinned_gb_s"] = round(pinned_bandwidth(), 2)
    print(f"pinned host-to-GPU: {results.get('pinned_gb_s')} GB/s", flush=True)

    def save() -> None:
        results["greedy"] = compare(results["cases"])
        link_bounds(results, cfg, args)
        (args.out / f"{args.name}.json").write_text(json.dumps(results, indent=1))

    for i, case in enumerate(args.cases):
        fraction = cache_fraction(case, args.cache_fraction)
        gib = round(fraction * all_experts / GiB, 4) if fraction is not None else None
        print(f"== {case} at {time.strftime('%H:%M:%S')}", flush=True)
        results["cases"][case] = run_case(case, args.work / "model", gib, 8500 + i, args)
        results["cases"][case]["cache_gib"] = gib
        save()

    print(f"{'case':18} {'start s':>8} {'KV tokens':>10}  batch: tok/s (x link bound)")
    for case, r in results["cases"].items():
        cells = []
        for b in args.batches:
            d = r.get("decode", {}).get(str(b), {})
            cells.append(f"b{b} {d.get('tok_s', '-')} ({d.get('x_link_bound', '-')})")
        print(f"{case:18} {r.get('start_s', '-'):>8} {r.get('kv_cache_tokens') or '-':>10}  " + "  ".join(cells))
        if "error" in r:
            print(f"   error: {r['error'][-600:]}")
    print(json.dumps(results["greedy"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
