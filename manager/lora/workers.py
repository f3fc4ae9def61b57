"""Loading, unloading and listing adapters on a running worker, with what it reports about them."""

from __future__ import annotations

import contextlib
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx
from sqlmodel import Session

from manager.errors import Conflict, NotFound
from manager.lora import engine_api, registry
from manager.lora.records import LoadedAdapter
from manager.metrics.engine import parse_metrics
from manager.metrics.pools import PoolsReader
from manager.supervisor.supervisor import Supervisor

# vLLM 0.32's /v1/unload_lora_adapter only drops the name in the API server (serving.py); the
# engine keeps the weights in its CPU LoRA cache until that cache or the CPU pool evicts them.
UNLOAD_KEEPS_WEIGHTS = (
    "Requests can no longer name it; vLLM 0.32 keeps its weights in the "
    "worker's CPU LoRA cache until evicted (max_cpu_loras, or the CPU LoRA "
    "pool when it needs the room)."
)


@dataclass(frozen=True)
class WorkerTarget:
    id: int
    port: int
    model_config: str
    run_dir: str | None
    address: str = "127.0.0.1"
    key: str | None = field(default=None, repr=False)  # the engine's API key, which its /v1 endpoints ask for


@dataclass
class WorkerLoras:
    """One worker's adapters: what vLLM serves, what the registry has for its model config, the
    engine's running/waiting adapters (``vllm:lora_requests_info``) and the CPU LoRA pool."""

    worker: int
    model_config: str
    loaded: list[LoadedAdapter]
    registered: list[dict[str, Any]]
    running: list[str] | None = None  # None: the engine did not report it
    waiting: list[str] | None = None
    max_loras: int | None = None
    pool: dict[str, float] | None = None  # None: no pool stats (pooling off, or no plugin)
    pool_note: str | None = None
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def ready_worker(supervisor: Supervisor, worker_id: int) -> WorkerTarget:
    view = supervisor.view(worker_id)
    if not view.ready or not view.port:
        raise Conflict(
            f"worker {worker_id} is {view.state}, not ready: adapters load into a "
            f"serving worker (start it, or wait until it is ready)"
        )
    return WorkerTarget(worker_id, view.port, view.model, view.run_dir, view.address, supervisor.engine_key(worker_id))


def _check_base(adapter_config: str, target: WorkerTarget, name: str) -> None:
    if adapter_config != target.model_config:
        raise Conflict(
            f"adapter {name!r} is registered for model config {adapter_config!r}, but "
            f"worker {target.id} runs {target.model_config!r}"
        )


async def load_on_worker(
    db: Session, supervisor: Supervisor, http: httpx.AsyncClient, worker_id: int, name: str
) -> dict[str, Any]:
    adapter = registry.get_adapter(db, name)
    target = ready_worker(supervisor, worker_id)
    _check_base(adapter.base_config, target, name)
    seconds = await engine_api.load(
        http, target.port, adapter.name, adapter.path, address=target.address, key=target.key
    )
    registry.record_load(db, adapter.name, seconds)
    supervisor.events.record(
        "lora_loaded",
        f"LoRA adapter {name} loaded in {seconds:.2f}s",
        worker_id,
        adapter=name,
        seconds=round(seconds, 3),
    )
    return {"worker": worker_id, "adapter": name, "load_s": seconds}


async def unload_from_worker(
    db: Session, supervisor: Supervisor, http: httpx.AsyncClient, worker_id: int, name: str
) -> dict[str, Any]:
    target = ready_worker(supervisor, worker_id)
    await engine_api.unload(http, target.port, name, address=target.address, key=target.key)
    pinned = False
    with contextlib.suppress(NotFound):  # loaded by hand, never registered: unloading it is still fine
        pinned = registry.get_adapter(db, name).pinned
    supervisor.events.record("lora_unloaded", f"LoRA adapter {name} unloaded", worker_id, adapter=name)
    notes = [UNLOAD_KEEPS_WEIGHTS]
    if pinned:
        notes.append(f"{name} is pinned: it is loaded again when this worker restarts; unpin it to keep it unloaded")
    return {"worker": worker_id, "adapter": name, "unloaded": True, "note": " ".join(notes)}


async def worker_loras(
    db: Session, supervisor: Supervisor, http: httpx.AsyncClient, worker_id: int, pools: PoolsReader | None = None
) -> WorkerLoras:
    target = ready_worker(supervisor, worker_id)
    loaded = await engine_api.loaded(http, target.port, address=target.address, key=target.key)
    registered = [
        {
            "name": a.name,
            "pinned": a.pinned,
            "rank": a.rank,
            "last_load_s": a.last_load_s,
            "loaded": any(item.name == a.name for item in loaded),
        }
        for a in registry.list_adapters(db, target.model_config)
    ]
    result = WorkerLoras(worker_id, target.model_config, loaded, registered)
    try:
        resp = await http.get(f"http://{target.address}:{target.port}/metrics", timeout=10)
        lora = parse_metrics(resp.text, time.monotonic()).lora
        if lora is not None:
            result.running, result.waiting = list(lora.running), list(lora.waiting)
            result.max_loras = lora.max_loras
    except (httpx.HTTPError, ValueError) as exc:
        result.notes.append(f"engine metrics not available ({exc})")
    report = (pools or PoolsReader.from_plugin()).sample(target.run_dir)
    result.pool = report.totals.get("lora_pool") if report.available else None
    if result.pool is None:
        result.pool_note = report.reason or (
            "not available: the CPU LoRA pool is off for this worker (lora_cpu_pooling in its offload profile)"
        )
    return result
