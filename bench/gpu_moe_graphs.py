"""MoE expert offload with CUDA graphs inside real vLLM 0.32.0, against resident and eager offload.

Runs on the GPU machine after ``source bench/gpu/env.sh`` (bench/README.md has the call). One model,
three engines, one after the other, each launched with the argv and environment the manager's own
``build_command`` makes (so the manager's CUDA graph limit for offload is what runs):

- ``offload_graphs``: MoE expert offload at a GPU cache of ``--cache-fraction`` of the expert bytes,
  CUDA graphs on; the manager adds ``--max-cudagraph-capture-size`` = slots per layer / top_k.
- ``resident``: every expert on the GPU, CUDA graphs on (vLLM's defaults).
- ``offload_eager``: the same offload with ``--enforce-eager`` (what the manager forced before).

Per engine: start time, the engine's own log lines (KV cache size, graph capture, the plugin's
offload line), greedy completions (one prompt alone, eight together), decode tokens/s at batch 1
and 8 (two lengths, so the prefill cancels out) and the expert cache's stats file. The model is
Qwen3-30B-A3B in shape (per layer) with ``--layers`` layers and dummy weights. Results go to
``OUT/gpu_moe_graphs.json`` after each engine.
"""

from __future__ import annotations

import argparse
import contextlib
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

FIXTURE = ROOT / "tests" / "fixtures" / "model_configs" / "Qwen3-30B-A3B.json"
GiB = 1024**3
PROMPTS = [
    f"The {w} of the city is" for w in ("river", "bridge", "market", "tower", "garden", "harbour", "wall", "gate")
]
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
        from manager.launch.command import build_command
        from manager.schemas.model_config import ModelConfig
        from manager.schemas.offload_profile import OffloadProfile

        self.case, self.port = case, port
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
            extra_args=["--load-format", "dummy", *args.engine_args],
        )
        profile = (
            OffloadProfile(name="moe", moe_expert_offload=True, moe_gpu_cache_gib=cache_gib)
            if cache_gib is not None
            else None
        )
        cmd = build_command(config, profile, engine_python=sys.executable, port=port, run_dir=self.run_dir)
        self.argv, self.notes = cmd.argv, cmd.notes
        env = {**os.environ, **cmd.env}
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
        dropped = 0
        for _ in range(repeats):
            t_short, _ = self.complete(prompts, short, ignore_eos=True)
            t_long, _ = self.complete(prompts, long, ignore_eos=True)
            if t_long <= t_short:  # a stall in the short run: no decode time to divide by
                dropped += 1
                continue
            rates.append(batch * (long - short) / (t_long - t_short))
        if not rates:
            return {"dropped": dropped}
        return {
            "tok_s": round(statistics.median(rates), 1),
            "per_seq_tok_s": round(statistics.median(rates) / batch, 1),
            "runs": [round(r, 1) for r in rates],
            "dropped": dropped,
        }

    def expert_stats(self) -> list[dict[str, Any]]:
        out = []
        for f in sorted(self.run_dir.glob("stats-*.json")):
            with contextlib.suppress(OSError, json.JSONDecodeError):
                doc = json.loads(f.read_text())
                if "expert_cache" in doc:
                    out.append(doc["expert_cache"])
        return out

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


def run_case(case: str, folder: Path, cache_gib: float | None, port: int, args: argparse.Namespace) -> dict[str, Any]:
    engine = Engine(case, folder, port, cache_gib, args)
    result: dict[str, Any] = {"argv": engine.argv[3:], "notes": engine.notes}
    try:
        result["start_s"] = round(engine.wait_ready(args.start_timeout), 1)
        _, result["greedy_1"] = engine.complete(PROMPTS[:1], args.greedy_tokens)
        _, result["greedy_8"] = engine.complete(PROMPTS, args.greedy_tokens)
        result["decode"] = {str(b): engine.decode_rate(b, args.short, args.long, args.repeats) for b in args.batches}
        result["expert_cache"] = engine.expert_stats()[-1:]
    except Exception as exc:
        result["error"] = str(exc)[-3000:]
    finally:
        result["log"] = engine.log_lines()
        result["kv_cache_tokens"] = kv_tokens(result["log"])
        engine.stop()
    return result


def compare(cases: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Greedy texts of every case against the resident engine's (and the two offload ones)."""
    out: dict[str, Any] = {}
    pairs = [("offload_graphs", "resident"), ("offload_eager", "resident"), ("offload_graphs", "offload_eager")]
    for a, b in pairs:
        if a not in cases or b not in cases or "greedy_8" not in cases[a] or "greedy_8" not in cases[b]:
            continue
        same_1 = cases[a]["greedy_1"] == cases[b]["greedy_1"]
        same_8 = [x == y for x, y in zip(cases[a]["greedy_8"], cases[b]["greedy_8"], strict=True)]
        out[f"{a}_vs_{b}"] = {"batch1_equal": same_1, "batch8_equal": same_8, "all_equal": same_1 and all(same_8)}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/gpu-moe-graphs-out")))
    parser.add_argument("--work", type=Path, default=Path("/tmp/gpu-moe-graphs"))
    parser.add_argument("--config", type=Path, default=FIXTURE, help="a Qwen3-MoE config.json (tests: a tiny one)")
    parser.add_argument("--layers", type=int, default=12, help="layers of the model (Qwen3-30B-A3B has 48)")
    parser.add_argument("--cache-fraction", type=float, default=0.25, help="GPU expert cache, share of expert bytes")
    parser.add_argument("--cases", nargs="*", default=["offload_graphs", "resident", "offload_eager"])
    parser.add_argument("--utilization", type=float, default=0.85)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--batches", type=int, nargs="*", default=[1, 8])
    parser.add_argument("--short", type=int, default=16)
    parser.add_argument("--long", type=int, default=144)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--greedy-tokens", type=int, default=32)
    parser.add_argument("--start-timeout", type=float, default=240)
    parser.add_argument("--engine-args", nargs="*", default=[], help="more vLLM flags for every engine")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)

    cfg = make_model(args.work / "model", args.layers, args.config)
    all_experts = expert_bytes(cfg)
    cache_gib = round(args.cache_fraction * all_experts / GiB, 4)
    results: dict[str, Any] = {
        "model": f"{cfg['model_type']} {args.config.stem} shape, {args.layers} layers, dummy weights, bf16",
        "expert_gib": round(all_experts / GiB, 3),
        "cache_fraction": args.cache_fraction,
        "cache_gib": cache_gib,
        "max_num_seqs": args.max_num_seqs,
        "cases": {},
    }

    def save() -> None:
        results["greedy"] = compare(results["cases"])
        (args.out / "gpu_moe_graphs.json").write_text(json.dumps(results, indent=1))

    for i, case in enumerate(args.cases):
        offload = case.startswith("offload")
        print(f"== {case} at {time.strftime('%H:%M:%S')}", flush=True)
        results["cases"][case] = run_case(case, args.work / "model", cache_gib if offload else None, 8500 + i, args)
        save()

    print(
        f"{'case':16} {'start s':>8} {'KV tokens':>10} "
        + " ".join(f"{'b' + str(b) + ' tok/s':>10}" for b in args.batches)
    )
    for case, r in results["cases"].items():
        rates = " ".join(f"{r.get('decode', {}).get(str(b), {}).get('tok_s', '-'):>10}" for b in args.batches)
        print(f"{case:16} {r.get('start_s', '-'):>8} {r.get('kv_cache_tokens') or '-':>10} {rates}")
        if "error" in r:
            print(f"   error: {r['error'][-600:]}")
    print(json.dumps(results["greedy"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
