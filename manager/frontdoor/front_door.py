"""The front door as one part of the running manager: names from the store, the scheduler, forwarding.

``FrontDoor.forward_json`` and ``forward_multipart`` take a request from the route, find the model it
names among those its caller may use, get a lease on a ready worker from the scheduler (starting or
swapping it in as needed), load a LoRA adapter the request names if the worker lacks it, and return
the engine's streamed answer. Every outcome is counted in the proxy metrics, errors included, each
forwarded request's added latency (the manager's own time, waiting for the model left out), and each
request that reached a model in the usage per key and model (with the tokens its answer says it used).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
import psutil
from sqlalchemy.engine import Engine
from sqlmodel import select
from starlette.requests import Request

from manager.db import CommitWatch, ReadAfterCommits, session
from manager.errors import Conflict, ManagerError
from manager.frontdoor import names, proxy
from manager.frontdoor.access import ANYONE, Caller, Credentials, caller_for, read_credentials
from manager.frontdoor.errors import FrontDoorError, ModelNotFound, ModelUnavailable
from manager.frontdoor.metering import Meter, stream_options_to_send
from manager.frontdoor.metrics import FrontDoorMetrics
from manager.frontdoor.scheduler import Lease, ModelStatus, Placement, Scheduler, SchedulerOptions
from manager.frontdoor.upstream import Upstream
from manager.frontdoor.usage import UsageRecorder
from manager.launch.command import sleep_pool_on
from manager.launch.preflight import sleep_host_bytes
from manager.lora import workers as lora_workers
from manager.lora.records import LoraAdapter
from manager.planner.gpus import GPU, NoGPU, detect_gpu
from manager.schemas.model_config import ModelConfig
from manager.schemas.offload_profile import OffloadProfile
from manager.services import models
from manager.settings import Settings
from manager.supervisor.supervisor import Supervisor

log = logging.getLogger("vllm_manager.frontdoor")


@dataclass(frozen=True)
class Limits:
    max_body_bytes: int


def placement_of(
    config: ModelConfig, gpu: GPU | NoGPU, sleep_bytes: int | None = None, *, pooled: bool = False
) -> Placement:
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
        sleep_pooled=pooled,
    )


class FrontDoor:
    def __init__(
        self,
        settings: Settings,
        engine: Engine,
        supervisor: Supervisor,
        http: httpx.AsyncClient,
        metrics: FrontDoorMetrics,
        usage: UsageRecorder,
        gpu: Callable[[], GPU | NoGPU] = detect_gpu,
    ) -> None:
        self.engine = engine
        self.supervisor = supervisor
        self.http = http  # control calls to engines (loading LoRA adapters)
        self.upstream = Upstream()  # the requests /v1 forwards
        self.metrics = metrics
        self.usage = usage
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
            sleep_pool_held=supervisor.sleep_pool_held,
        )
        # What each config's sleep keeps in host RAM, by (config, when it was last changed).
        self._sleep_bytes: dict[tuple[str, object, object, bool], int | None] = {}
        # Adapters known to be loaded, per engine process (worker id, pid): a restart forgets them.
        self._adapters: dict[tuple[int, int | None], set[str]] = {}
        self._adapter_locks: dict[tuple[int, str], asyncio.Lock] = {}
        # Every request resolves its model name and its caller: both are read from the store again only
        # once something was committed to it, not on every request.
        self._commits = CommitWatch(engine)
        self._names = ReadAfterCommits(self._commits, self._read_names)
        self._credentials = ReadAfterCommits(self._commits, self._read_credentials)

    def start(self) -> None:
        self.scheduler.start()

    async def stop(self) -> None:
        await self.scheduler.stop()
        await self.upstream.close()
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
            configs = [(c, models.profile_of(db, c)) for c in db.exec(select(ModelConfig))]
        out = {}
        for c, profile in configs:
            pooled = sleep_pool_on(c, profile)
            out[c.name] = placement_of(c, gpu, self._sleep_bytes_of(c, profile, pooled), pooled=pooled)
        return out

    def _sleep_bytes_of(self, config: ModelConfig, profile: OffloadProfile | None, pooled: bool) -> int | None:
        key = (config.name, config.updated_at, profile.updated_at if profile else None, pooled)
        if key not in self._sleep_bytes:
            self._sleep_bytes[key] = sleep_host_bytes(config, pooled=pooled, profile=profile)
        return self._sleep_bytes[key]

    def name_table(self, caller: Caller = ANYONE) -> names.NameTable:
        """The names ``caller`` may use: every name, or those of the model configs its key names."""
        table = self._names.get()
        return table if caller.models is None else table.only(caller.models)

    def caller(self, bearer: str | None, settings: Settings) -> Caller:
        """Who a /v1 request with this bearer token comes from (NoCredentials: a 401 saying what to send)."""
        return caller_for(self._credentials.get(), bearer, settings)

    def _read_credentials(self) -> Credentials:
        with session(self.engine) as db:
            return read_credentials(db)

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

    def snapshot(self) -> list[ModelStatus]:
        """Every model config's state, requests in flight and waiting, and last swap (the dashboard's)."""
        return self.scheduler.snapshot()

    def listing(self, caller: Caller = ANYONE) -> dict[str, Any]:
        return names.listing(self.name_table(caller), self.supervisor.views())

    def resolve(self, requested: str, caller: Caller = ANYONE) -> names.Target:
        try:
            return self.name_table(caller).resolve(requested)
        except names.UnknownModel as exc:
            raise ModelNotFound(str(exc), param="model") from None

    # ---- forwarding -----------------------------------------------------------------------------------
    async def forward_json(self, request: Request, path: str, caller: Caller = ANYONE) -> proxy.UpstreamResponse:
        added = proxy.AddedTime()
        config: str | None = None
        self.usage.key_used(caller.key_id)
        try:
            body = await proxy.read_body(request, self.limits.max_body_bytes)
            payload, requested = proxy.json_model(body)
            target = self.resolve(requested, caller)
            config = target.config
            changes: dict[str, Any] = {}
            if target.upstream_model != requested:
                changes["model"] = target.upstream_model
            # Streams end with their token counts only when asked: ask, and take them out again.
            options = stream_options_to_send(path, payload)
            if options is not None:
                changes["stream_options"] = options
            forwarded = proxy.with_changes(payload, body, changes)
            content_type = request.headers.get("content-type") or "application/json"
            meter = Meter(take_usage_event=options is not None)
            return await self._forward(request, path, target, lambda: (forwarded, content_type), caller, meter, added)
        except FrontDoorError as exc:
            self._answered_with_error(caller, config, exc)
            raise

    async def forward_multipart(self, request: Request, path: str, caller: Caller = ANYONE) -> proxy.UpstreamResponse:
        added = proxy.AddedTime()
        config: str | None = None
        self.usage.key_used(caller.key_id)
        try:
            body = await proxy.read_body(request, self.limits.max_body_bytes)
            requested, rewrite = await proxy.multipart_model(request, body)
            target = self.resolve(requested, caller)
            config = target.config
            return await self._forward(
                request, path, target, lambda: rewrite(target.upstream_model), caller, Meter(), added
            )
        except FrontDoorError as exc:
            self._answered_with_error(caller, config, exc)
            raise

    def _answered_with_error(self, caller: Caller, config: str | None, exc: FrontDoorError) -> None:
        self.metrics.answered(config, exc.status)
        # A name that matched no model is not counted: clients choose those, and would grow the table.
        if config is not None:
            self.usage.count(caller.key_id, config, None, error=True)

    async def _forward(
        self,
        request: Request,
        path: str,
        target: names.Target,
        encoded: Callable[[], tuple[bytes, str]],
        caller: Caller,
        meter: Meter,
        added: proxy.AddedTime,
    ) -> proxy.UpstreamResponse:
        asked = time.perf_counter()
        lease = await self.scheduler.acquire(target.config)
        if lease.queued:
            added.waited += time.perf_counter() - asked
        try:
            if target.adapter:
                asked = time.perf_counter()
                if await self._ensure_adapter(lease, target.adapter):
                    added.waited += time.perf_counter() - asked
            body, content_type = encoded()
            upstream = await proxy.send_upstream(
                self.upstream, lease.port, request.method, path, body, request, content_type, added, lease.address
            )
        except BaseException:
            lease.release()
            raise
        try:
            self.metrics.answered(target.config, upstream.status_code)
            if target.adapter and upstream.status_code == 404:
                # The engine no longer knows the adapter (unloaded by hand): load it again next time.
                self._adapters.get((lease.worker_id, lease.pid), set()).discard(target.adapter)
            ok = upstream.status_code < 400
            before_engine = added.before_engine() or 0.0

            def ended(after_engine: float | None) -> None:
                lease.release()
                self.metrics.added_latency.observe(before_engine + (after_engine or 0.0))
                self.usage.count(caller.key_id, target.config, meter.tokens if ok else None, error=not ok)

            # Only a successful answer is read for its usage (an error passes on as the engine wrote it).
            content = meter.watch(upstream.chunks()) if ok and meter.readable(upstream.headers) else None
            return proxy.UpstreamResponse(upstream, ended, content)
        except BaseException:  # the response that would end the lease and the answer was not made
            upstream.close()
            lease.release()
            raise

    async def _ensure_adapter(self, lease: Lease, adapter: str) -> bool:
        """Load the adapter into the lease's worker unless it is there (one load, however many ask);
        True when this request waited for a load."""
        loaded = self._adapters.setdefault((lease.worker_id, lease.pid), set())
        if adapter in loaded:
            return False
        lock = self._adapter_locks.setdefault((lease.worker_id, adapter), asyncio.Lock())
        async with lock:
            if adapter in loaded:
                return True
            try:
                # Conflict: loaded already (by the pin keeper, or by hand).
                with session(self.engine) as db, contextlib.suppress(Conflict):
                    await lora_workers.load_on_worker(db, self.supervisor, self.http, lease.worker_id, adapter)
            except ManagerError as exc:
                raise ModelUnavailable(
                    f"LoRA adapter {adapter!r} could not be loaded into the worker of {lease.config}: {exc.message}"
                ) from exc
            loaded.add(adapter)
        return True
