"""The front door as one part of the running manager: names from the store, the scheduler, forwarding.

``FrontDoor.forward_json`` and ``forward_multipart`` take a request from the route and forward it
(``manager.frontdoor.forwarding``). Its leases come from here: the scheduler's lease on a ready
worker (starting or swapping it in as needed), with a LoRA adapter the request names loaded into it
if the worker lacks it. Every outcome is counted here too, the forwarder processes' included: in the
proxy metrics, errors included, each forwarded request's added latency (the manager's own time,
waiting for the model left out), and each request that reached a model in the usage per key and
model (with the tokens its answer says it used).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import httpx
import psutil
from sqlalchemy.engine import Engine
from sqlmodel import select
from starlette.requests import Request
from starlette.responses import Response

from manager.cluster.nodes import NodeState
from manager.db import session
from manager.errors import Conflict, Invalid, ManagerError
from manager.frontdoor import names
from manager.frontdoor.access import ANYONE, Caller
from manager.frontdoor.catalog import Catalog
from manager.frontdoor.errors import ModelUnavailable, OverKeyLimit
from manager.frontdoor.forwarding import Forwarding, Held, Outcome
from manager.frontdoor.limits import Limited, Limiter
from manager.frontdoor.metrics import FrontDoorMetrics
from manager.frontdoor.placements import Placement
from manager.frontdoor.replica_scale import Scaling
from manager.frontdoor.scheduler import Lease, ModelStatus, Scheduler, SchedulerOptions
from manager.frontdoor.upstream import Upstream
from manager.frontdoor.usage import UsageRecorder
from manager.launch.command import sleep_pool_on
from manager.launch.preflight import sleeper_host_bytes
from manager.lora import workers as lora_workers
from manager.metrics.gpu import GpuReport
from manager.planner.gpus import GPU, NoGPU, detect_gpu
from manager.planner.scheduling import default_max_num_seqs
from manager.schemas.common import MAX_GPU_ID
from manager.schemas.engine_values import engine_gpus
from manager.schemas.model_config import ModelConfig
from manager.schemas.offload_profile import OffloadProfile
from manager.services import models
from manager.settings import Settings
from manager.supervisor.supervisor import Supervisor

log = logging.getLogger("vllm_manager.frontdoor")


def placement_of(
    config: ModelConfig, gpu: GPU | NoGPU, sleep_bytes: int | None = None, *, pooled: bool = False
) -> Placement:
    """A stored config in the scheduler's terms. Without gpu_ids a worker gets vLLM's default devices
    (0 .. its GPU count - 1, of those this machine has); it takes gpu_memory_utilization of each GPU it uses."""
    gpus = tuple(config.gpu_ids) or _default_devices(config, gpu)
    gpu_bytes = int(config.gpu_memory_utilization * gpu.memory_bytes) if isinstance(gpu, GPU) else None
    return Placement(
        config=config.name,
        gpus=gpus,
        gpu_bytes=gpu_bytes,
        gpu_share=config.gpu_memory_utilization,
        start_timeout_s=float(config.start_timeout_s),
        idle_timeout_s=float(config.idle_timeout_s) if config.idle_timeout_s else None,
        persistent=config.persistent,
        sleep_level=config.sleep_level,
        sleep_host_bytes=sleep_bytes,
        sleep_pooled=pooled,
        wait_for_download=config.wait_for_download,
        gpus_pinned=bool(config.gpu_ids),
        at_once=config.max_num_seqs or default_max_num_seqs(gpu if isinstance(gpu, GPU) else None),
        scaling=_scaling(config),
        min_residency_s=config.min_residency_s,
    )


def _scaling(config: ModelConfig) -> Scaling | None:
    if config.max_replicas is None:
        return None
    return Scaling(
        least=config.min_replicas or 1,
        most=config.max_replicas,
        up_after_s=float(config.scale_up_after_s),
        down_after_s=float(config.scale_down_after_s),
    )


def _node_gpus(report: GpuReport | None) -> dict[int, int] | None:
    """A node's GPUs by id with their total bytes, from its latest reading; None where not all are known."""
    if report is None or not report.available or not report.gpus:
        return None
    sizes = {g.index: g.memory_total_bytes for g in report.gpus}
    if any(size is None for size in sizes.values()):
        return None
    return {index: size for index, size in sizes.items() if size is not None}


def _default_devices(config: ModelConfig, gpu: GPU | NoGPU) -> tuple[int, ...]:
    # As many as this machine has at most (without GPUs: as many as GPU ids go): the parallel sizes are
    # the user's, and a stored one may be any number.
    here = gpu.count if isinstance(gpu, GPU) else MAX_GPU_ID + 1
    return tuple(range(min(engine_gpus(config.tensor_parallel_size, config.extra_args), here)))


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
        self._detect_gpu = gpu
        self._gpu: GPU | NoGPU | None = None
        self.catalog = Catalog(engine)
        self.scheduler = Scheduler(
            supervisor,
            self.placements,
            self.gpu_capacity,
            SchedulerOptions(
                max_queue=settings.proxy_max_queue,
                max_queue_per_key=settings.max_queue_per_key,
                queue_timeout_s=settings.queue_timeout_s,
                retry_after_s=settings.proxy_retry_after_s,
                drain_timeout_s=settings.proxy_drain_timeout_s,
                idle_check_s=settings.idle_check_s,
            ),
            metrics,
            host_available=self.host_available,
            sleep_pool_held=supervisor.sleep_pool_held,
            max_concurrent=self.catalog.max_concurrent,
        )
        # What each config's sleep keeps in host RAM, by (config, when it was last changed).
        self._sleep_bytes: dict[tuple[str, object, object, bool], int | None] = {}
        # Adapters known to be loaded, per engine process (worker id, pid): a restart forgets them.
        self._adapters: dict[tuple[int, int | None], set[str]] = {}
        self._adapter_locks: dict[tuple[int, str], asyncio.Lock] = {}
        self.limiter = Limiter(usage.tokens_since)
        self.forwarding = Forwarding(
            self.upstream,
            settings.proxy_max_body_bytes,
            self.catalog.resolve,
            leases=self,
            tally=self,
            admissions=self,
            loading_progress=self.catalog.loading_progress,
        )

    def start(self) -> None:
        self.scheduler.start()

    async def stop(self) -> None:
        await self.scheduler.stop()
        await self.upstream.close()
        self.catalog.close()

    # ---- what the store says ------------------------------------------------------------------------
    def gpu(self) -> GPU | NoGPU:
        if self._gpu is None:
            self._gpu = self._detect_gpu()
        return self._gpu

    def gpu_capacity(self) -> dict[str | None, dict[int, int] | None] | None:
        """Each node's GPUs and their total bytes: the live nodes of the cluster from their latest
        readings (this node first), else this box's GPU; None where they are not known."""
        cluster = self.supervisor.cluster
        if cluster is None:
            gpu = self.gpu()
            return {None: {index: gpu.memory_bytes for index in range(gpu.count)}} if isinstance(gpu, GPU) else None
        return {
            s.name: _node_gpus(s.sample.gpu if s.sample else None)
            for s in cluster.statuses()
            if s.state == NodeState.ALIVE
        }

    def host_available(self, node: str | None) -> int | None:
        """Host RAM available on ``node``: this box's now, another node's from its latest reading."""
        cluster = self.supervisor.cluster
        if cluster is None or node is None or cluster.is_local(node):
            return psutil.virtual_memory().available
        status = next((s for s in cluster.statuses() if s.name == node and s.state == NodeState.ALIVE), None)
        return status.sample.host.ram_available_bytes if status is not None and status.sample else None

    def placements(self) -> dict[str, Placement]:
        gpu = self.gpu()
        with session(self.engine) as db:
            configs = [(c, models.profile_of(db, c)) for c in db.exec(select(ModelConfig))]
        out = {}
        for c, profile in configs:
            pooled = sleep_pool_on(c, profile)
            placement = placement_of(c, gpu, self._sleep_bytes_of(c, profile, pooled), pooled=pooled)
            if self.supervisor.cluster is not None:
                # Each node's GPUs size the share there: this box's GPU (if any) says nothing of theirs.
                placement = replace(placement, gpu_bytes=None, nodes=self._nodes_of(c))
            out[c.name] = placement
        return out

    def _nodes_of(self, config: ModelConfig) -> tuple[str | None, ...] | None:
        """The live nodes a config's ``node`` picks (none: it names a lost or unknown node); None: any."""
        cluster = self.supervisor.cluster
        if cluster is None or not config.node:
            return None
        try:
            return tuple(cluster.resolve(config.node))
        except Invalid:
            return ()

    def _sleep_bytes_of(self, config: ModelConfig, profile: OffloadProfile | None, pooled: bool) -> int | None:
        key = (config.name, config.updated_at, profile.updated_at if profile else None, pooled)
        if key not in self._sleep_bytes:
            on = config.sleep_level is not None
            self._sleep_bytes[key] = sleeper_host_bytes(config, profile, pooled=pooled) if on else None
        return self._sleep_bytes[key]

    def name_table(self, caller: Caller = ANYONE) -> names.NameTable:
        return self.catalog.name_table(caller)

    def caller(self, bearer: str | None, settings: Settings) -> Caller:
        return self.catalog.caller(bearer, settings)

    def snapshot(self) -> list[ModelStatus]:
        """Every model config's state, requests in flight and waiting, and last swap (the dashboard's)."""
        return self.scheduler.snapshot()

    def listing(self, caller: Caller = ANYONE) -> dict[str, Any]:
        return names.listing(self.name_table(caller), self.supervisor.views())

    def resolve(self, requested: str, caller: Caller = ANYONE) -> names.Target:
        return self.catalog.resolve(requested, caller)

    # ---- forwarding -----------------------------------------------------------------------------------
    async def forward_json(self, request: Request, path: str, caller: Caller = ANYONE) -> Response:
        return await self.forwarding.forward_json(request, path, caller)

    async def forward_multipart(self, request: Request, path: str, caller: Caller = ANYONE) -> Response:
        return await self.forwarding.forward_multipart(request, path, caller)

    # ---- leases, and what each request is counted as (LeaseSource and Tally, for this process and the
    # forwarders': manager.frontdoor.lease_channel) ---------------------------------------------------------
    async def acquire(
        self,
        config: str,
        adapter: str | None,
        affinity: str | None = None,
        avoid: tuple[int, ...] = (),
        caller: Caller = ANYONE,
    ) -> Lease:
        """A lease on a ready worker of ``config`` with ``adapter`` loaded into it (of its replicas, the
        one ``affinity`` and the load say, passing over ``avoid``); ``caller``'s key and priority set its
        place among the requests that wait for it."""
        lease = await self.scheduler.acquire(config, affinity, avoid, caller.key_id, caller.priority)
        if adapter:
            try:
                if await self._ensure_adapter(lease, adapter):
                    lease.queued = True
            except BaseException:
                lease.release()
                raise
        return lease

    async def loading(self, config: str) -> str:
        return self.scheduler.loading(config)

    def adapter_missing(self, lease: Held, adapter: str) -> None:
        assert isinstance(lease, Lease)
        self._adapters.get((lease.worker_id, lease.pid), set()).discard(adapter)

    # ---- keys' limits (Admissions, for this process and the forwarders') -------------------------------
    async def admit(self, caller: Caller, asked_tokens: int) -> dict[str, str]:
        if caller.limits is None:
            return {}
        try:
            return self.limiter.admit(caller.key_id, caller.key_name or "", caller.limits, asked_tokens, time.time())
        except Limited as exc:
            self.metrics.refused_by_limit(caller.key_name, exc.limit)
            raise OverKeyLimit(exc.message, exc.limit, exc.headers) from None

    def let_go(self, key_id: int) -> None:
        self.limiter.ended(key_id, None, time.time())

    def record(self, outcome: Outcome, lease: Held | None = None) -> None:
        if lease is not None:
            lease.release()
        ok = outcome.status < 400
        tokens = outcome.tokens if ok else None
        if outcome.admitted:
            self.limiter.ended(outcome.key_id, tokens.prompt + tokens.completion if tokens else None, time.time())
        if outcome.queue_full:
            self.metrics.refused_by_limit(outcome.key_name, "queue")
        if tokens is not None and outcome.config is not None:
            self.metrics.used_tokens(outcome.key_name, outcome.config, tokens.prompt, tokens.completion)
        self.usage.key_used(outcome.key_id)
        self.metrics.answered(outcome.config, outcome.status)
        if outcome.added_s is not None:
            self.metrics.added_latency.observe(outcome.added_s)
        # A name that matched no model is not counted: clients choose those, and would grow the table.
        if outcome.config is not None:
            self.usage.count(outcome.key_id, outcome.config, tokens, error=not ok)

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
