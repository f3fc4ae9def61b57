"""Models from the Hugging Face Hub, on a hub on loopback: a pull by the manager against huggingface_hub's
own ``snapshot_download`` of the same files, and the time from a plan request to the answer for a model
that is not downloaded.

    ~/.cache/vllm-manager/test-venv/bin/python bench/download.py --out bench/results

The hub is the tests' ``TestHub`` (``tests/support/hub_server.py``, a ``ThreadingHTTPServer``: the API
on one port, the weights from a "CDN" on a second one after a 302, as on the real hub), run in a
process of its own so that its threads share no interpreter lock with the clients; its CPU is read
around every run. Its files are files on disk, read in 64 KiB pieces per request.

Pull: a repo of ``--shards`` safetensors shards of ``--shard-mib`` MiB (a valid header, one F32 tensor
of zeros), their index and a config.json. Every round pulls it the first two ways below, the first
``--ceiling-repeats`` rounds the four, in an order that turns by one each round, each into a fresh
folder that is removed (and the disk synced) after it, untimed; one untimed snapshot_download goes first:

- **manager**: ``Downloads.start`` + ``wait`` in this process (a migrated SQLite store), as the
  manager runs a pull: the plan of the download (one model-info call and the index), its rows, then
  ``python -m manager.hub.fetch_process``, whose progress lines (at most 4 a second) the event loop
  reads;
- **snapshot_download**: huggingface_hub's own call with the same files in a fresh ``python -c``
  child, so that both pay a process start and write through the same code (8 workers, the
  default, as the manager's child uses); its tqdm bars go to a pipe;
- **plain GET**: the same files fetched at once by httpx in this process, the bytes thrown away: the
  hub's and loopback's ceiling, without a process start, a disk or a model-info call;
- **disk write**: the same number of bytes written in 10 MiB pieces into a new file of the cache's
  disk (no fsync, as huggingface_hub does not): the other ceiling.

Plan: a 10-file repo (config, generation config, tokenizer files, the index and 4 safetensors shards of
a 32-layer Llama shape: 291 tensors, headers of about 8.6 kB each) and ``make_plan(...,
read_files=manager.hub.source.read_model)`` in this process, each time with a new empty cache; the first call, which opens the
connections, is counted apart. The hub's request log says what each plan asked and how many bytes went
out. Then ``vllm-manager plan REPO`` as a process (Python's start and the CLI's imports included, and
measured alone with ``vllm-manager --help``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import resource
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MiB = 1024**2
MB = 1e6
CHUNK = 10 * MiB  # huggingface_hub's DOWNLOAD_CHUNK_SIZE
PULL_REPO = "acme/pull"
PLAN_REPO = "acme/plan-from-headers"
SNAPSHOT_DOWNLOAD = (
    "import json, sys\n"
    "from huggingface_hub import snapshot_download\n"
    "a = json.loads(sys.argv[1])\n"
    "snapshot_download(a['repo'], cache_dir=a['cache'], allow_patterns=a['files'], endpoint=a['endpoint'])\n"
)


# ---- the repos -------------------------------------------------------------------------------------------
def write_safetensors(path: Path, tensors: dict[str, tuple[str, list[int]]]) -> None:
    """A valid safetensors file of zeros: ``tensors`` is name -> (dtype, shape)."""
    width = {"F32": 4, "BF16": 2}
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, (dtype, shape) in tensors.items():
        size = width[dtype]
        for dim in shape:
            size *= dim
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    zeros = bytes(min(CHUNK, offset))
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for start in range(0, offset, CHUNK):
            f.write(zeros[: min(CHUNK, offset - start)])


def _config(layers: int, hidden: int, intermediate: int, vocab: int) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": hidden // 32,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "vocab_size": vocab,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
    }


def _write_json(path: Path, data: object) -> Path:
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path


def make_pull_repo(folder: Path, shards: int, shard_mib: int) -> dict[str, Path]:
    """``shards`` shards of one F32 tensor each, the index naming them, and a config.json."""
    folder.mkdir(parents=True)
    files = {"config.json": _write_json(folder / "config.json", _config(32, 4096, 14336, 128256))}
    weight_map = {}
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        count = (shard_mib * MiB - 256) // 4  # the header takes the rest of the MiB
        write_safetensors(folder / name, {f"w{i}": ("F32", [count])})
        weight_map[f"w{i}"] = name
        files[name] = folder / name
    index = {"metadata": {"total_size": sum(p.stat().st_size for p in files.values())}, "weight_map": weight_map}
    files["model.safetensors.index.json"] = _write_json(folder / "model.safetensors.index.json", index)
    return files


def make_plan_repo(folder: Path) -> dict[str, Path]:
    """Ten files as a Llama repo has them; the shards' headers hold the 291 tensors of 32 layers (the
    dimensions are small, so the files are too: the plan reads headers only)."""
    folder.mkdir(parents=True)
    layers, hidden, intermediate, kv, vocab = 32, 256, 768, 64, 32000
    config = _config(layers, hidden, intermediate, vocab)
    files = {
        "config.json": _write_json(folder / "config.json", config),
        "generation_config.json": _write_json(folder / "generation_config.json", {"bos_token_id": 1}),
        "tokenizer.json": _write_json(
            folder / "tokenizer.json", {"model": {"vocab": {f"w{i}": i for i in range(vocab)}}}
        ),
        "tokenizer_config.json": _write_json(folder / "tokenizer_config.json", {"model_max_length": 8192}),
        "special_tokens_map.json": _write_json(folder / "special_tokens_map.json", {"bos_token": "<s>"}),
    }
    tensors: list[tuple[str, tuple[str, list[int]]]] = [("model.embed_tokens.weight", ("BF16", [vocab, hidden]))]
    for i in range(layers):
        p = f"model.layers.{i}"
        tensors += [
            (f"{p}.self_attn.q_proj.weight", ("BF16", [hidden, hidden])),
            (f"{p}.self_attn.k_proj.weight", ("BF16", [kv, hidden])),
            (f"{p}.self_attn.v_proj.weight", ("BF16", [kv, hidden])),
            (f"{p}.self_attn.o_proj.weight", ("BF16", [hidden, hidden])),
            (f"{p}.mlp.gate_proj.weight", ("BF16", [intermediate, hidden])),
            (f"{p}.mlp.up_proj.weight", ("BF16", [intermediate, hidden])),
            (f"{p}.mlp.down_proj.weight", ("BF16", [hidden, intermediate])),
            (f"{p}.input_layernorm.weight", ("BF16", [hidden])),
            (f"{p}.post_attention_layernorm.weight", ("BF16", [hidden])),
        ]
    tensors += [("model.norm.weight", ("BF16", [hidden])), ("lm_head.weight", ("BF16", [vocab, hidden]))]
    per_shard = -(-len(tensors) // 4)
    weight_map: dict[str, str] = {}
    for s in range(4):
        name = f"model-{s + 1:05d}-of-00004.safetensors"
        part = dict(tensors[s * per_shard : (s + 1) * per_shard])
        write_safetensors(folder / name, part)
        weight_map |= dict.fromkeys(part, name)
        files[name] = folder / name
    files["model.safetensors.index.json"] = _write_json(
        folder / "model.safetensors.index.json", {"metadata": {}, "weight_map": weight_map}
    )
    return files


# ---- the hub, in a process of its own --------------------------------------------------------------------
def serve_hub() -> None:
    """Reads {"repos": {repo: {path: file}}, "nagle": bool}, serves them and prints {"url": ...}; then
    answers every "log" line with the requests since the last one and the bytes served so far, until
    stdin closes."""
    from tests.support import hub_server
    from tests.support.hub_server import TestHub

    asked = json.loads(sys.stdin.readline())
    repos = asked["repos"]
    # The test hub writes an answer's headers and body in two sends, with TCP_NODELAY as the hub's real
    # servers do. "nagle" turns Nagle's algorithm back on to show what it costs: a small body then waits
    # for the client's delayed ACK (about 40 ms on Linux).
    hub_server._Handler.disable_nagle_algorithm = not asked["nagle"]
    with TestHub() as hub:
        for repo, files in repos.items():
            hub.add_repo(repo, {path: Path(src) for path, src in files.items()})
        print(json.dumps({"url": hub.url}), flush=True)
        for _ in sys.stdin:
            requests = hub.requests
            hub.clear_requests()
            served = {repo: sum(hub.bytes_served(repo, path) for path in files) for repo, files in repos.items()}
            print(json.dumps({"requests": [list(r) for r in requests], "served": served}), flush=True)


class HubProcess:
    def __init__(self, repos: dict[str, dict[str, Path]], nagle: bool = False) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.popen = subprocess.Popen(
            [sys.executable, __file__, "--serve-hub"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True
        )
        assert self.popen.stdin is not None and self.popen.stdout is not None
        files = {repo: {path: str(src) for path, src in f.items()} for repo, f in repos.items()}
        self.popen.stdin.write(json.dumps({"repos": files, "nagle": nagle}) + "\n")
        self.popen.stdin.flush()
        self.url = json.loads(self.popen.stdout.readline())["url"]  # after hashing every file
        self.process = psutil.Process(self.popen.pid)

    def log(self) -> tuple[list[list[str | None]], dict[str, int]]:
        """The requests since the last call, and each repo's bytes served so far."""
        assert self.popen.stdin is not None and self.popen.stdout is not None
        self.popen.stdin.write("log\n")
        self.popen.stdin.flush()
        answer = json.loads(self.popen.stdout.readline())
        return answer["requests"], answer["served"]

    def cpu_s(self) -> float:
        t = self.process.cpu_times()
        return t.user + t.system

    def close(self) -> None:
        assert self.popen.stdin is not None
        self.popen.stdin.close()
        self.popen.wait(timeout=30)


# ---- the pull --------------------------------------------------------------------------------------------
@dataclass
class Run:
    way: str
    repeat: int
    seconds: float
    bytes: int
    mb_per_s: float
    this_cpu_s: float  # this process: the manager's loop and store, or the httpx client
    child_cpu_s: float  # the download process
    hub_cpu_s: float
    hub_requests: int
    page_updates: int  # the manager's: progress lines read and its row's changes


def _cpu() -> tuple[float, float]:
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


class Pull:
    def __init__(self, hub: HubProcess, files: dict[str, Path], scratch: Path) -> None:
        from manager.db import make_engine, migrate
        from manager.hub.downloads import Downloads

        self.hub = hub
        self.files = files
        self.bytes = sum(p.stat().st_size for p in files.values())
        self.scratch = scratch
        engine = make_engine(scratch / "manager.db")
        migrate(engine)
        self.downloads = Downloads(engine, scratch / "logs")
        self.loop = asyncio.new_event_loop()
        self.child_env = {**os.environ, "HF_HUB_DISABLE_TELEMETRY": "1", "PYTHONUNBUFFERED": "1"}

    def ways(self) -> dict[str, Callable[[Path], None]]:
        return {
            "manager": self.manager,
            "snapshot_download": self.snapshot_download,
            "plain GET": self.plain_get,
            "disk write": self.disk_write,
        }

    def measure(self, way: str, repeat: int) -> Run:
        folder = self.scratch / f"cache-{way.replace(' ', '-')}-{repeat}"
        self.hub.log()
        own, children = _cpu()
        hub = self.hub.cpu_s()
        version = self.downloads.version
        started = time.perf_counter()
        self.ways()[way](folder)
        seconds = time.perf_counter() - started
        own_after, children_after = _cpu()
        hub_cpu = self.hub.cpu_s() - hub
        requests, _ = self.hub.log()
        if way in ("manager", "snapshot_download"):
            self._check(folder)
        shutil.rmtree(folder, ignore_errors=True)
        os.sync()  # the next run starts with no dirty pages of this one left to write
        return Run(
            way, repeat, seconds, self.bytes, self.bytes / seconds / MB,
            own_after - own, children_after - children, hub_cpu, len(requests), self.downloads.version - version,
        )  # fmt: skip

    def manager(self, cache: Path) -> None:
        from manager.schemas.download import DownloadState

        os.environ["HF_HUB_CACHE"] = str(cache)  # where Downloads.start puts the model, as for the manager

        async def pull():
            row = await self.downloads.start(PULL_REPO)
            assert row.id is not None
            return await self.downloads.wait(row.id)

        done = self.loop.run_until_complete(pull())
        if done.state != DownloadState.DONE:
            raise SystemExit(f"the manager's pull ended {done.state.value}: {done.error}")

    def snapshot_download(self, cache: Path) -> None:
        request = {"repo": PULL_REPO, "cache": str(cache), "files": sorted(self.files), "endpoint": self.hub.url}
        done = subprocess.run(
            [sys.executable, "-c", SNAPSHOT_DOWNLOAD, json.dumps(request)],
            env=self.child_env,
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            raise SystemExit(f"snapshot_download failed: {done.stderr[-2000:]}")

    def plain_get(self, cache: Path) -> None:
        import httpx

        def get(client: httpx.Client, name: str) -> int:
            got = 0
            with client.stream("GET", f"{self.hub.url}/{PULL_REPO}/resolve/main/{name}") as answer:
                answer.raise_for_status()
                for chunk in answer.iter_bytes(CHUNK):
                    got += len(chunk)
            return got

        with httpx.Client(follow_redirects=True, timeout=60) as client, ThreadPoolExecutor(8) as pool:
            got = sum(pool.map(lambda name: get(client, name), self.files))
        if got != self.bytes:
            raise SystemExit(f"plain GET: {got} bytes, not {self.bytes}")

    def disk_write(self, cache: Path) -> None:
        cache.mkdir(parents=True)
        piece = bytes(CHUNK)
        with (cache / "blob").open("wb") as f:
            for start in range(0, self.bytes, CHUNK):
                f.write(piece[: min(CHUNK, self.bytes - start)])

    def _check(self, cache: Path) -> None:
        snapshots = list((cache / ("models--" + PULL_REPO.replace("/", "--")) / "snapshots").iterdir())
        assert len(snapshots) == 1, snapshots
        for name, src in self.files.items():
            got = (snapshots[0] / name).stat().st_size
            if got != src.stat().st_size:
                raise SystemExit(f"{name}: {got} bytes in the cache, not {src.stat().st_size}")

    def close(self) -> None:
        self.loop.run_until_complete(self.downloads.close())
        self.loop.close()


def rotations(repeats: int, ceiling_repeats: int) -> Iterator[tuple[int, str]]:
    """The manager and snapshot_download every round, the two ceilings in the first rounds; the order
    turns by one each round."""
    for repeat in range(repeats):
        ways = ["manager", "snapshot_download"] + (["plain GET", "disk write"] if repeat < ceiling_repeats else [])
        for i in range(len(ways)):
            yield repeat, ways[(i + repeat) % len(ways)]


def spread(values: Sequence[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def summarise_pull(runs: list[Run]) -> dict[str, Any]:
    by_way: dict[str, list[Run]] = {}
    for r in runs:
        by_way.setdefault(r.way, []).append(r)
    out: dict[str, Any] = {
        way: {
            "seconds": spread([r.seconds for r in rs]),
            "mb_per_s": spread([r.mb_per_s for r in rs]),
            "this_cpu_s": statistics.median(r.this_cpu_s for r in rs),
            "child_cpu_s": statistics.median(r.child_cpu_s for r in rs),
            "hub_cpu_s": statistics.median(r.hub_cpu_s for r in rs),
            "hub_cpu_pct_of_core": statistics.median(100 * r.hub_cpu_s / r.seconds for r in rs),
            "hub_requests": statistics.median(r.hub_requests for r in rs),
            "page_updates": statistics.median(r.page_updates for r in rs),
        }
        for way, rs in by_way.items()
    }
    manager = {r.repeat: r.seconds for r in by_way["manager"]}
    paired = [manager[r.repeat] / r.seconds for r in by_way["snapshot_download"]]
    out["manager_over_snapshot_download"] = {
        "paired_ratio": spread(paired),
        "ratio_of_medians": out["manager"]["seconds"]["median"] / out["snapshot_download"]["seconds"]["median"],
    }
    return out


def time_download_plan(hub: HubProcess, scratch: Path, repeats: int) -> dict[str, Any]:
    """``plan_download`` alone: what ``Downloads.start`` asks the hub before the process starts."""
    from manager.hub.download_plan import plan_download

    seconds, cpu = [], []
    for _ in range(repeats):
        own, _ = _cpu()
        started = time.perf_counter()
        plan_download(PULL_REPO, None, {}, scratch / "no-cache")
        seconds.append(time.perf_counter() - started)
        cpu.append(_cpu()[0] - own)
    requests, _ = hub.log()
    return {"seconds": spread(seconds), "cpu_s": spread(cpu), "requests": len(requests) / repeats}


# ---- the plan --------------------------------------------------------------------------------------------
def time_plans(hub: HubProcess, scratch: Path, repeats: int, name: str) -> dict[str, Any]:
    from manager.hub import source
    from manager.planner import PlanRequest, make_plan

    calls: list[dict[str, Any]] = []
    _, served_before = hub.log()
    for i in range(1 + repeats):
        os.environ["HF_ENDPOINT"] = hub.url
        os.environ["HF_HUB_CACHE"] = str(scratch / f"plan-cache-{name}-{i}")
        started = time.perf_counter()
        plan = make_plan(PlanRequest(model=PLAN_REPO, gpu="h100-80", max_model_len=4096), read_files=source.read_model)
        seconds = time.perf_counter() - started
        requests, served = hub.log()
        if plan.source.kind != "hub":
            raise SystemExit(f"the plan read {plan.source.kind}, not the hub")
        calls.append(
            {
                "seconds": seconds,
                "requests": len(requests),
                "by_method": {m: sum(1 for r in requests if r[0] == m) for m in ("GET", "HEAD", "POST")},
                "ranged": sum(1 for r in requests if r[2]),
                "bytes_served": served[PLAN_REPO] - served_before[PLAN_REPO],
            }
        )
        served_before = served
    later = calls[1:]
    return {
        "first_call": calls[0],
        "seconds": spread([c["seconds"] for c in later]),
        "requests": spread([c["requests"] for c in later]),
        "bytes_served": spread([c["bytes_served"] for c in later]),
        "calls": calls,
        "example_requests": requests,
        "fits": plan.verdict.fits,
    }


def time_cli(hub: HubProcess, scratch: Path, repeats: int) -> dict[str, Any]:
    cli = str(Path(sys.executable).with_name("vllm-manager"))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_ENDPOINT": hub.url}

    def timed(argv: list[str], i: int) -> float:
        env["HF_HUB_CACHE"] = str(scratch / f"cli-cache-{i}")
        started = time.perf_counter()
        done = subprocess.run(argv, env=env, capture_output=True, text=True)
        seconds = time.perf_counter() - started
        if done.returncode != 0:
            raise SystemExit(f"{' '.join(argv)} exited {done.returncode}: {done.stderr[-2000:]}")
        return seconds

    plan = [cli, "plan", PLAN_REPO, "--gpu", "h100-80", "--max-model-len", "4096"]
    plans, helps, served = [], [], []
    hub.log()
    for i in range(repeats):
        plans.append(timed(plan, i))
        requests, _ = hub.log()
        served.append(len(requests))
        helps.append(timed([cli, "--help"], i))
    return {"plan_seconds": spread(plans), "help_seconds": spread(helps), "requests": spread(served)}


# ---- the run ---------------------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> dict[str, Any]:
    import httpx
    import huggingface_hub

    scratch = Path(tempfile.mkdtemp(prefix="bench-download-"))
    load_before = os.getloadavg()
    began = time.monotonic()
    try:
        pull_files = {} if args.plan_only else make_pull_repo(scratch / "pull-repo", args.shards, args.shard_mib)
        pull_sizes = {name: path.stat().st_size for name, path in pull_files.items()}
        plan_files = make_plan_repo(scratch / "plan-repo")
        hub = HubProcess({PULL_REPO: pull_files, PLAN_REPO: plan_files} if pull_files else {PLAN_REPO: plan_files})
        os.environ["HF_ENDPOINT"] = hub.url
        os.environ.pop("HF_HOME", None)
        os.environ.pop("HF_TOKEN", None)
        runs: list[Run] = []
        download_plan: dict[str, Any] | None = None
        try:
            if not args.plan_only:
                pull = Pull(hub, pull_files, scratch)
                try:
                    pull.measure("snapshot_download", -1)  # untimed: the disk's and the hub's first touch
                    for repeat, way in rotations(args.repeats, args.ceiling_repeats):
                        runs.append(pull.measure(way, repeat))
                        r = runs[-1]
                        print(f"pull {repeat} {way:>17}: {r.seconds:6.2f} s {r.mb_per_s:7.1f} MB/s", flush=True)
                    download_plan = time_download_plan(hub, scratch, args.plan_repeats)
                finally:
                    pull.close()
            plans = time_plans(hub, scratch, args.plan_repeats, "nodelay")
            print(f"plan: median {plans['seconds']['median'] * 1000:.0f} ms", flush=True)
            as_tests = HubProcess({PLAN_REPO: plan_files}, nagle=True)
            try:
                plans_nagle = time_plans(as_tests, scratch, args.plan_repeats, "nagle")
            finally:
                as_tests.close()
            print(f"plan, Nagle on: median {plans_nagle['seconds']['median'] * 1000:.0f} ms", flush=True)
            cli = time_cli(hub, scratch, args.cli_repeats)
            print(f"cli plan: median {cli['plan_seconds']['median']:.2f} s", flush=True)
        finally:
            hub.close()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return {
        "bench": "download",
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "commit": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip(),
        "host": {
            "cpus": psutil.cpu_count(),
            "ram_gib": round(psutil.virtual_memory().total / 2**30, 1),
            "python": platform.python_version(),
            "huggingface_hub": huggingface_hub.__version__,
            "httpx": httpx.__version__,
            "nice": os.nice(0),
            "load_average_before": load_before,
            "load_average_after": os.getloadavg(),
        },
        "wall_s": round(time.monotonic() - began, 1),
        "args": {k: v for k, v in vars(args).items() if k not in ("out", "serve_hub")},
        "pull": None
        if args.plan_only
        else {
            "files": {name: size for name, size in sorted(pull_sizes.items())},
            "bytes": sum(pull_sizes.values()),
            "summary": summarise_pull(runs),
            "plan_download": download_plan,
            "runs": [asdict(r) for r in runs],
        },
        "plan": {"repo_files": sorted(plan_files), "library": plans, "library_nagle_on": plans_nagle, "cli": cli},
    }


def tables(result: dict[str, Any]) -> str:
    plan_lines = plan_table(result["plan"])
    if result["pull"] is None:
        return plan_lines
    return pull_table(result["pull"]) + "\n\n" + plan_lines


def pull_table(result_pull: dict[str, Any]) -> str:
    pull = result_pull["summary"]
    lines = [
        "| way | s min / median / max | MB/s min / median / max | CPU s: this process / child / hub "
        "(hub % of a core) | hub requests |",
        "|---|---:|---:|---:|---:|",
    ]
    for way in ("manager", "snapshot_download", "plain GET", "disk write"):
        s = pull[way]
        t, m = s["seconds"], s["mb_per_s"]
        lines.append(
            f"| {way} | {t['min']:.2f} / {t['median']:.2f} / {t['max']:.2f} "
            f"| {m['min']:.0f} / {m['median']:.0f} / {m['max']:.0f} "
            f"| {s['this_cpu_s']:.2f} / {s['child_cpu_s']:.2f} / {s['hub_cpu_s']:.2f} ({s['hub_cpu_pct_of_core']:.0f} %) "
            f"| {s['hub_requests']:.0f} |"
        )
    ratio = pull["manager_over_snapshot_download"]
    p = ratio["paired_ratio"]
    before = result_pull["plan_download"]
    lines += [
        "",
        f"manager / snapshot_download time, paired per repeat: {p['min']:.3f} / {p['median']:.3f} / {p['max']:.3f}"
        f" (ratio of medians {ratio['ratio_of_medians']:.3f}); page updates per pull (median): "
        f"{pull['manager']['page_updates']:.0f}; plan_download alone (median): "
        f"{before['seconds']['median'] * 1000:.1f} ms, {before['cpu_s']['median'] * 1000:.1f} ms of CPU, "
        f"{before['requests']:.0f} requests",
    ]
    return "\n".join(lines)


def plan_table(plan: dict[str, Any]) -> str:
    lines = [
        "| plan of a model not downloaded | s min / median / max | hub requests | bytes served |",
        "|---|---:|---:|---:|",
    ]
    for key, label in (("library", ""), ("library_nagle_on", ", hub with Nagle on")):
        lib, first = plan[key], plan[key]["first_call"]
        t = lib["seconds"]
        lines += [
            f"| make_plan from the hub, first call{label} | {first['seconds']:.3f} | {first['requests']} "
            f"| {first['bytes_served']:,} |",
            f"| make_plan from the hub, later calls{label} | {t['min']:.3f} / {t['median']:.3f} / {t['max']:.3f} "
            f"| {lib['requests']['median']:.0f} | {lib['bytes_served']['median']:,.0f} |",
        ]
    cli = plan["cli"]
    c, h = cli["plan_seconds"], cli["help_seconds"]
    lines += [
        f"| vllm-manager plan (a process) | {c['min']:.2f} / {c['median']:.2f} / {c['max']:.2f} "
        f"| {cli['requests']['median']:.0f} | |",
        f"| vllm-manager --help (start-up alone) | {h['min']:.2f} / {h['median']:.2f} / {h['max']:.2f} | 0 | |",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shards", type=int, default=4, help="safetensors shards in the pulled repo")
    parser.add_argument("--shard-mib", type=int, default=256, help="size of each shard")
    parser.add_argument("--repeats", type=int, default=8, help="rounds of the manager and snapshot_download")
    parser.add_argument("--ceiling-repeats", type=int, default=3, help="of them, rounds with the two ceilings")
    parser.add_argument("--plan-repeats", type=int, default=10, help="timed make_plan calls (after a first)")
    parser.add_argument("--cli-repeats", type=int, default=5, help="vllm-manager plan processes")
    parser.add_argument("--plan-only", action="store_true", help="the plan's timings alone, no pull")
    parser.add_argument("--out", type=Path, help="folder for download_cpu_<date>.json (download_plan_cpu_...)")
    parser.add_argument("--serve-hub", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_hub:
        return serve_hub()
    result = run(args)
    print(tables(result))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        kind = "download_plan" if args.plan_only else "download"
        path = args.out / f"{kind}_cpu_{time.strftime('%Y-%m-%d')}.json"
        path.write_text(json.dumps(result, indent=2) + "\n")
        print(f"written: {path}")


if __name__ == "__main__":
    main()
