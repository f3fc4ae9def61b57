"""Sleep and wake through the sleep pool against vLLM's own path, on the GPU machine with real vLLM.

Runs there after ``source bench/gpu/env.sh`` (bench/README.md has the calls). Cases, each its own
engine, one after the other in one call:

- ``default``: vLLM 0.32.0 as shipped (no plugin): start, answer, sleep level 1, wake, answer,
  sleep, wake, answer.
- ``pool``: the same with the plugin's sleep pool on (``VLLM_MANAGER_PATCHES={"sleep_pool": true}``);
  the engine is left asleep for the swap.
- ``swap``: a second model B with the pool starts while A sleeps, then swaps back and forth: one
  sleeps, the other wakes and answers, timed from the sleep call to the answer.

Each step records wall time of the HTTP call (``POST /sleep?level=1``, ``POST /wake_up``), the engine
tree's host RSS before, while asleep and after, the weights vLLM reports ("Model loading took"),
the pool's own figures (its stats file) and the greedy answers, which must not change across a
sleep. Results go to ``OUT/gpu_sleep.json`` as each case ends.
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
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_planner import make_model

GiB = 1024**3
WEIGHTS = re.compile(r"Model loading took ([\d.]+) GiB")
PROMPT = "The capital of France is"


def http(method: str, url: str, body: dict[str, Any] | None = None, timeout: float = 300) -> tuple[float, Any]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        raw = resp.read()
    seconds = time.perf_counter() - t0
    try:
        return seconds, json.loads(raw) if raw else None
    except json.JSONDecodeError:
        return seconds, raw.decode(errors="replace")


def tree_rss(pid: int) -> int:
    """Resident bytes of ``pid`` and every process below it (from /proc, nothing installed)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                stat = (entry / "stat").read_text()
                ppid = int(stat.rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(entry.name))
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        todo.extend(children.get(p, []))
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
    return total


class Engine:
    def __init__(self, name: str, folder: Path, port: int, pool: bool, args: argparse.Namespace) -> None:
        self.name, self.port, self.pool = name, port, pool
        self.run_dir = args.work / f"run-{name}"
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.log = args.work / f"{name}.log"
        argv = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(folder), "--served-model-name", name, "--load-format", "dummy",
            "--dtype", "bfloat16", "--max-model-len", str(args.max_model_len),
            "--gpu-memory-utilization", str(args.utilization), "--port", str(port),
            "--enable-sleep-mode",
        ] + (["--enforce-eager"] if args.eager else [])  # fmt: skip
        env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}
        if pool:
            env["VLLM_PLUGINS"] = "offload_patches"
            env["VLLM_MANAGER_PATCHES"] = json.dumps({"sleep_pool": True, "run_dir": str(self.run_dir)})
        else:
            env["VLLM_PLUGINS"] = ""  # vLLM as shipped
        self.t0 = time.perf_counter()
        with self.log.open("w") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.base = f"http://127.0.0.1:{port}"

    def wait_ready(self, timeout: float) -> float:
        deadline = time.perf_counter() + timeout
        while time.perf_counter() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited: {self.tail()}")
            with contextlib.suppress(OSError):
                if urllib.request.urlopen(self.base + "/health", timeout=2).status == 200:
                    return time.perf_counter() - self.t0
            time.sleep(1)
        raise RuntimeError(f"{self.name} not ready in {timeout:.0f} s: {self.tail()}")

    def tail(self) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-15:])

    def answer(self) -> tuple[float, str]:
        seconds, body = http(
            "POST",
            self.base + "/v1/completions",
            {"model": self.name, "prompt": PROMPT, "max_tokens": 12, "temperature": 0},
        )
        return seconds, body["choices"][0]["text"]

    def sleep(self) -> float:
        return http("POST", self.base + "/sleep?level=1")[0]

    def wake(self) -> float:
        return http("POST", self.base + "/wake_up")[0]

    def rss(self) -> int:
        return tree_rss(self.proc.pid)

    def weights_gib(self) -> float | None:
        m = WEIGHTS.search(self.log.read_text(errors="replace"))
        return float(m.group(1)) if m else None

    def pool_stats(self) -> list[dict[str, Any]]:
        out = []
        for f in sorted(self.run_dir.glob("stats-*.json")):
            with contextlib.suppress(OSError, json.JSONDecodeError):
                doc = json.loads(f.read_text())
                if "sleep_pool" in doc:
                    out.append({"pid": doc.get("pid"), "role": doc.get("role"), **doc["sleep_pool"]})
        return out

    def log_lines(self, *needles: str) -> list[str]:
        text = self.log.read_text(errors="replace").splitlines()
        return [line[-300:] for line in text if any(n in line for n in needles)]

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(60)
        time.sleep(4)  # the GPU memory of the killed engine is released


def cycles(engine: Engine, n: int) -> dict[str, Any]:
    """Answer, then n times: sleep, wake, answer. RSS around the first sleep."""
    case: dict[str, Any] = {"weights_gib": engine.weights_gib()}
    _, case["answer"] = engine.answer()
    case["rss_awake_gib"] = round(engine.rss() / GiB, 2)
    steps = []
    for i in range(n):
        step: dict[str, Any] = {"sleep_s": round(engine.sleep(), 3)}
        time.sleep(1.5)  # stats files are written at most once a second
        step["rss_asleep_gib"] = round(engine.rss() / GiB, 2)
        step["wake_s"] = round(engine.wake(), 3)
        t, text = engine.answer()
        step["answer_s"], step["same_answer"] = round(t, 3), text == case["answer"]
        step["rss_after_wake_gib"] = round(engine.rss() / GiB, 2)
        steps.append(step)
        print(json.dumps({"engine": engine.name, "cycle": i + 1, **step}), flush=True)
    case["cycles"] = steps
    if case["weights_gib"]:
        case["rss_asleep_over_weights"] = [
            round((s["rss_asleep_gib"] - case["rss_awake_gib"]) / case["weights_gib"], 3) for s in steps
        ]
    return case


def swap(a: Engine, a_answer: str, args: argparse.Namespace) -> dict[str, Any]:
    """B starts while A sleeps; then each in turn sleeps while the other wakes and answers."""
    out: dict[str, Any] = {"a_sleep_s": round(a.sleep(), 3)}
    folder_b = make_model(args.work / args.model_b, args.model_b)
    b = Engine("b-pool", folder_b, 8401, pool=True, args=args)
    try:
        out["b_start_s"] = round(b.wait_ready(400), 1)
        out["b_weights_gib"] = b.weights_gib()
        _, b_answer = b.answer()
        rounds = []
        for i in range(args.swaps):
            for sleeper, waker, expected in ((b, a, a_answer), (a, b, b_answer)):
                t0 = time.perf_counter()
                s = sleeper.sleep()
                w = waker.wake()
                t, text = waker.answer()
                r = {
                    "round": i + 1,
                    "to": waker.name,
                    "sleep_s": round(s, 3),
                    "wake_s": round(w, 3),
                    "answer_s": round(t, 3),
                    "swap_s": round(time.perf_counter() - t0, 3),
                    "same_answer": text == expected,
                }
                rounds.append(r)
                print(json.dumps(r), flush=True)
        out["rounds"] = rounds
        out["rss_gib"] = {"a": round(a.rss() / GiB, 2), "b": round(b.rss() / GiB, 2)}
        out["pool_stats"] = {"a": a.pool_stats(), "b": b.pool_stats()}
    except Exception as exc:
        out["error"] = str(exc)[-2000:]
    finally:
        b.stop()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/gpu-sleep-out")))
    parser.add_argument("--work", type=Path, default=Path("/tmp/gpu-sleep"))
    parser.add_argument("--cases", nargs="*", default=["default", "pool", "swap"])
    parser.add_argument("--model-a", default="Qwen3-30B-A3B")
    parser.add_argument("--model-b", default="Llama-3.1-8B-Instruct")
    parser.add_argument("--utilization", type=float, default=0.85)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--eager", action="store_true", help="no CUDA graphs (faster starts)")
    parser.add_argument("--cycles", type=int, default=2)
    parser.add_argument("--swaps", type=int, default=2)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {
        "model_a": args.model_a,
        "model_b": args.model_b,
        "eager": args.eager,
        "utilization": args.utilization,
        "cases": {},
    }

    def save() -> None:
        (args.out / "gpu_sleep.json").write_text(json.dumps(results, indent=1))

    folder_a = make_model(args.work / args.model_a, args.model_a)
    # The pool first, and the swap on its engine A, so a failure there still leaves vLLM's own
    # figures from the last case.
    for name in ("pool", "default"):
        if name not in args.cases and not (name == "pool" and "swap" in args.cases):
            continue
        engine = Engine(f"a-{name}", folder_a, 8400, pool=name == "pool", args=args)
        try:
            case: dict[str, Any] = {"start_s": round(engine.wait_ready(400), 1)}
            case.update(cycles(engine, args.cycles))
            if engine.pool:
                case["pool_stats"] = engine.pool_stats()
            case["log"] = engine.log_lines("fall asleep", "sleep pool", "Sleep mode freed", "CuMemAllocator")
            results["cases"][name] = case
            save()
            if name == "pool" and "swap" in args.cases:
                results["cases"]["swap"] = swap(engine, case["answer"], args)
        except Exception as exc:
            results["cases"].setdefault(name, {})["error"] = str(exc)[-2000:]
        finally:
            engine.stop()
            save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
