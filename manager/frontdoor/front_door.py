"""The front door as one part of the running manager: names from the store, the scheduler, forwarding.

``FrontDoor.forward_json`` and ``forward_multipart`` take a request from the route, find the model it
names, get a lease on a ready worker from the scheduler (starting or swapping it in as needed), load
a LoRA adapter the request names if the worker lacks it, and return the engine's streamed answer.
Every outcome is counted in the proxy metrics, errors included.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
import psutil
from sqlalchemy.engine import Engine
from sqlmodel import select
from starlette.requests import Request

from manager.db import CommitWatch, session
from manager.errors import Conflict, ManagerError
from manager.frontdoor import names, proxy
from manager.frontdoor.errors import FrontDoorError, ModelNotFound, ModelUnavailable
from manager.frontdoor.metrics import FrontDoorMetrics
from manager.frontdoor.scheduler import Lease, Placement, Scheduler, SchedulerOptions
from manager.lora import workers as lora_workers
from manager.lora.records import LoraAdapter
from manager.planner import model_files
from manager.planner.gpus import GPU, NoGPU, detect_gpu
from manager.planner.weights import estimate_weights
from manager.schemas.model_config import ModelConfig
from manager.settings import Settings
from manager.supervisor.supervisor import Supervisor

log = logging.getLogger("vllm_manager.frontdoor")


@dataclass(frozen=True)
class Limits:
    max_body_bytes: int


# vLLM keeps a level-1 sleeper's weights in pinned host memory, which PyTorch's caching host
# allocator rounds up to a power of two: count up to twice the weights (see the vLLM notes).
PINNED_ROUNDING = 2.0


def sleep_host_bytes(config: ModelConfig) -> int | None:
    """Host RAM the config's sleep keeps: level 1 its weights (pinned), level 2 nothing; None: unknown."""
    if config.sleep_level is None:
        return None
    if config.sleep_level >= 2:
        return 0
    try:
        found = model_files.read_model(config.model)
        weights = estimate_weights(found.config, found.weights, config.dtype)
    except (model_files.ModelNotFound, OSError, ValueError, KeyError):
        return None
    return int(weights.total_bytes * PINNED_ROUNDING)


def placement_of(config: ModelConfig, gpu: GPU | NoGPU, sleep_bytes: int | None = None) -> Placement:
    """A stored config in the scheduler's terms. Without gpu_ids a worker gets vLLM's default devices
    (0 .. tensor_parallel_size-1); it takes gpu_memory_utilization of each GPU it uses."""
    gpus = tuple(config.gpu_ids) or tuple(range(config.tensor_parallel_size))
    gpu_bytes = int(config.gpu_memory_utilization * gpu.memory_bytes) if isinstance(gpu, GPU) else None
    return Placement(
        config=config.name,
        gpus=gpus,
        gpu_bytes=gpu_bytes,
        start_timeout_s=float(config.start_timeout_s),
        idle_timeout_s=float(config.idle_timeout_s) if config.idle_timeout_s else None,
        persistent=config.persistent,
        sleep_level=config.sleep_level,
        sleep_host_bytes=sleep_bytes,
    )


class FrontDoor:
    def __init__(
        self,
        settings: Settings,
        engine: Engine,
        supervisor: Supervisor,
        http: httpx.AsyncClient,
        metrics: FrontDoorMetrics,
        gpu: Callable[[], GPU | NoGPU] = detect_gpu,
    ) -> None:
        self.engine = engine
        self.supervisor = supervisor
        self.http = http
        self.metrics = metrics
        self.limits = Limits(max_body_bytes=settings.proxy_max_body_bytes)
        self._detect_gpu = gpu
        self._gpu: GPU | NoGPU | None = None
        self.scheduler = Scheduler(
            supervisor,
            self.placements,
            self.gpu_capacity,
            SchedulerOptions(
                max_queue=settings.proxy_max_queue,
                retry_after_s=settings.proxy_retry_after_s,
                drain_timeout_s=settings.proxy_drain_timeout_s,
                idle_check_s=settings.idle_check_s,
            ),
            metrics,
            host_available=lambda: psutil.virtual_memory().available,
        )
        # What each config's sleep keeps in host RAM, by (config, when it was last changed).
        self._sleep_bytes: dict[tuple[str, object], int | None] = {}
        # Adapters known to be loaded, per engine process (worker id, pid): a restart forgets them.
        self._adapters: dict[tuple[int, int | None], set[str]] = {}
        self._adapter_locks: dict[tuple[int, str], asyncio.Lock] = {}
        # Every request resolves its model name: the names are read from the store again only once
        # something was committed to it, not on every request.
        self._commits = CommitWatch(engine)
        self._names: tuple[int, names.NameTable] | None = None

    def start(self) -> None:
        self.scheduler.start()

    async def stop(self) -> None:
        await self.scheduler.stop()
        self._commits.close()

    # ---- what the store says ------------------------------------------------------------------------
    def gpu(self) -> GPU | NoGPU:
        if self._gpu is None:
            self._gpu = self._detect_gpu()
        return self._gpu

    def gpu_capacity(self) -> dict[int, int] | None:
        gpu = self.gpu()
        if not isinstance(gpu, GPU):
            return None
        return {index: gpu.memory_bytes for index in range(gpu.count)}

    def placements(self) -> dict[str, Placement]:
        gpu = self.gpu()
        with session(self.engine) as db:
            configs = list(db.exec(select(ModelConfig)))
        return {c.name: placement_of(c, gpu, self._sleep_bytes_of(c)) for c in configs}

    def _sleep_bytes_of(self, config: ModelConfig) -> int | None:
        key = (config.name, config.updated_at)
        if key not in self._sleep_bytes:
            self._sleep_bytes[key] = sleep_host_bytes(config)
        return self._sleep_bytes[key]

    def name_table(self) -> names.NameTable:
        version = self._commits.version()
        kept = self._names
        if version is not None and kept is not None and kept[0] == version:
            return kept[1]
        table = self._read_names()
        if version is not None:
            self._names = (version, table)
        return table

    def _read_names(self) -> names.NameTable:
        with session(self.engine) as db:
            configs = [
                names.ConfigNames(c.name, c.served_model_name, tuple(c.aliases), int(c.created_at.timestamp()))
                for c in db.exec(select(ModelConfig))
            ]
            adapters = [
                names.AdapterNames(a.name, a.base_config, int(a.created_at.timestamp()))
                for a in db.exec(select(LoraAdapter))
            ]
        return names.NameTable(configs, adapters)

    def listing(self) -> dict[str, Any]:
        return names.listing(self.name_table(), self.supervisor.views())

    def resolve(self, requested: str) -> names.Target:
        try:
            return self.name_table().resolve(requested)
        except names.UnknownModel as exc:
            raise ModelNotFound(str(exc), param="model") from None

    # ---- forwarding -----------------------------------------------------------------------------------
    async def forward_json(self, request: Request, path: str) -> proxy.UpstreamResponse:
        config: str | None = None
        try:
            body = await proxy.read_body(request, self.limits.max_body_bytes)
            payload, requested = proxy.json_model(body)
            target = self.resolve(requested)
            config = target.config
            forwarded = proxy.with_model(payload, body, requested, target.upstream_model)
            content_type = request.headers.get("content-type") or "application/json"
            return await self._forward(request, path, target, lambda: (forwarded, content_type))
        except FrontDoorError as exc:
            self.metrics.answered(config, exc.status)
            raise

    async def forward_multipart(self, request: Request, path: str) -> proxy.UpstreamResponse:
        config: str | None = None
        try:
            body = await proxy.read_body(request, self.limits.max_body_bytes)
            requested, rewrite = await proxy.multipart_model(request, body)
            target = self.resolve(requested)
            config = target.config
            return await self._forward(request, path, target, lambda: rewrite(target.upstream_model))
        except FrontDoorError as exc:
            self.metrics.answered(config, exc.status)
            raise

    async def _forward(
        self, request: Request, path: str, target: names.Target, encoded: Callable[[], tuple[bytes, str]]
    ) -> proxy.UpstreamResponse:
        lease = await self.scheduler.acquire(target.config)
        try:
            if target.adapter:
                await self._ensure_adapter(lease, target.adapter)
            body, content_type = encoded()
            upstream = await proxy.send_upstream(
                self.http, lease.port, request.method, path, body, request, content_type
            )
        except BaseException:
            lease.release()
            raise
        self.metrics.answered(target.config, upstream.status_code)
        if target.adapter and upstream.status_code == 404:
            # The engine no longer knows the adapter (unloaded by hand): load it again next time.
            self._adapters.get((lease.worker_id, lease.pid), set()).discard(target.adapter)
        return proxy.UpstreamResponse(upstream, lease.release)

    async def _ensure_adapter(self, lease: Lease, adapter: str) -> None:
        """Load the adapter into the lease's worker unless it is there (one load, however many ask)."""
        loaded = self._adapters.setdefault((lease.worker_id, lease.pid), set())
        if adapter in loaded:
            return
        lock = self._adapter_locks.setdefault((lease.worker_id, adapter), asyncio.Lock())
        async with lock:
            if adapter in loaded:
                return
            try:
                # Conflict: loaded already (by the pin keeper, or by hand).
                with session(self.engine) as db, contextlib.suppress(Conflict):
                    await lora_workers.load_on_worker(db, self.supervisor, self.http, lease.worker_id, adapter)
            except ManagerError as exc:
                raise ModelUnavailable(
                    f"LoRA adapter {adapter!r} could not be loaded into the worker of {lease.config}: {exc.message}"
                ) from exc
            loaded.add(adapter)
