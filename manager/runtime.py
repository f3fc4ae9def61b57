"""The running manager's parts, built and closed in one place.

The store, the HTTP client to the engines, the supervisor (with the planner's pre-start check), the
metrics collector and the views of it that the pages stream, the keeper of pinned LoRA adapters, the
front door (/v1: the scheduler and the proxy) and the recorder of its usage, the audit log's retention,
and the limit on wrong tokens (browser sessions live in the store: manager.auth.sessions).
The app's lifespan opens one ``Runtime``; routes reach its parts through ``manager.deps``.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import httpx
from sqlalchemy.engine import Engine
from sqlmodel import select

from manager.audit.retention import AuditRetention
from manager.auth import sessions
from manager.auth.throttle import ADMIN_TOKEN, INFERENCE_KEY, WrongTokenThrottle
from manager.cluster.ray_cluster import RayCluster
from manager.db import make_engine, migrate, session
from manager.frontdoor.front_door import FrontDoor
from manager.frontdoor.metrics import FrontDoorMetrics
from manager.frontdoor.usage import UsageRecorder
from manager.hub.downloads import Downloads
from manager.launch.preflight import refuse_if_it_cannot_fit
from manager.lora.pin_keeper import PinKeeper
from manager.metrics import HistoryStore, ManagerExposition, MetricsCollector, WorkerInfo
from manager.schemas.common import expand_home, utcnow
from manager.schemas.model_config import ModelConfig
from manager.services import inference_keys, tokens
from manager.settings import Settings, is_loopback
from manager.supervisor.supervisor import Supervisor
from manager.supervisor.view import WorkerView

log = logging.getLogger("vllm_manager")


@dataclass
class Runtime:
    settings: Settings
    engine: Engine
    http: httpx.AsyncClient  # to the engines: probes, metrics, LoRA endpoints
    supervisor: Supervisor
    metrics: MetricsCollector
    exposition: ManagerExposition
    pin_keeper: PinKeeper
    front_door: FrontDoor
    wrong_tokens: WrongTokenThrottle  # guesses at the admin token, wherever they are sent
    wrong_keys: WrongTokenThrottle  # inference keys that are not (any more), sent anywhere
    usage: UsageRecorder
    downloads: Downloads
    audit_retention: AuditRetention

    @property
    def throttles(self) -> dict[str, WrongTokenThrottle]:
        """The limits on wrong secrets, by kind (manager.auth.throttle.KINDS)."""
        return {ADMIN_TOKEN: self.wrong_tokens, INFERENCE_KEY: self.wrong_keys}

    @classmethod
    async def open(cls, settings: Settings) -> Runtime:
        settings.ensure_dirs()
        engine = make_engine(settings.db_path)
        migrate(engine)
        end_sessions_of_tokens_gone(settings, engine)
        # Probes, scrapes and control calls to every engine (what /v1 forwards has its own pool).
        http = httpx.AsyncClient(limits=httpx.Limits(max_connections=256, max_keepalive_connections=64))
        cluster = open_cluster(settings)
        downloads = Downloads(engine, settings.logs_dir, record=lambda *a, **k: supervisor.events.record(*a, **k))
        supervisor = Supervisor(
            settings, engine, http, preflight=refuse_if_it_cannot_fit, cluster=cluster, fetcher=downloads
        )
        await downloads.open()
        await supervisor.start_up()
        if cluster is not None:
            cluster.start()
        collector = MetricsCollector(
            lambda: [worker_info(v) for v in supervisor.views()],
            remote=cluster.remote_readings if cluster is not None else None,
            disks=watched_disks(settings, engine),
            history=HistoryStore(engine, retention_days=settings.metrics_retention_days),
        )

        exposition = ManagerExposition(lambda: collector.latest)
        usage = UsageRecorder(engine)
        runtime = cls(
            settings=settings,
            engine=engine,
            http=http,
            supervisor=supervisor,
            metrics=collector,
            exposition=exposition,
            pin_keeper=PinKeeper(engine, supervisor, http),
            front_door=FrontDoor(settings, engine, supervisor, http, FrontDoorMetrics(exposition.registry), usage),
            usage=usage,
            downloads=downloads,
            wrong_tokens=WrongTokenThrottle(),
            wrong_keys=WrongTokenThrottle(),
            audit_retention=AuditRetention(engine, settings.audit_retention_days),
        )
        collector.start()
        runtime.pin_keeper.start()
        runtime.front_door.start()
        usage.start()
        runtime.audit_retention.start()
        log_inference_access(settings, engine)
        if settings.open_reads and not is_loopback(settings.host):
            log.warning("pages and reads are open to anyone who reaches %s (VLLM_MANAGER_OPEN_READS)", settings.host)
        return runtime

    async def close(self) -> None:
        cluster = self.supervisor.cluster
        if cluster is not None:
            await cluster.stop()
        await self.front_door.stop()
        await self.downloads.close()
        await self.usage.stop()
        await self.audit_retention.stop()
        await self.pin_keeper.stop()
        await self.metrics.stop()
        await self.supervisor.shut_down()
        await self.http.aclose()
        self.engine.dispose()
        if cluster is not None:
            cluster.close()


def open_cluster(settings: Settings) -> RayCluster | None:
    """The Ray cluster the manager runs workers on, joined now unless ``serve`` already did; None
    without a Ray address (Ray is then never imported)."""
    if not settings.ray_address:
        return None
    import ray

    from manager.cluster.ray_cluster import RayCluster, connect

    if not ray.is_initialized():
        connect(settings.ray_address)
    return RayCluster(settings.ray_address)


def end_sessions_of_tokens_gone(settings: Settings, engine: Engine) -> None:
    """Browser sessions whose token is no longer valid (VLLM_MANAGER_API_TOKEN changed since they
    logged in) end now, and expired ones are deleted."""
    with session(engine) as db:
        sessions.remove_expired(db, utcnow())
        ended = sessions.end_unless_made_with(db, tokens.valid_digests(db, settings.env_token))
    if ended:
        log.info("%d browser sessions ended: the token they logged in with is no longer valid", ended)


def log_inference_access(settings: Settings, engine: Engine) -> None:
    """Say at start who may use /v1 when that is not the safe default."""
    if not settings.open_inference or is_loopback(settings.host):
        return
    with session(engine) as db:
        keys = inference_keys.needs_key(db)
    if keys:
        log.warning(
            "VLLM_MANAGER_OPEN_INFERENCE is set, but inference keys were made: /v1 on %s still needs one "
            "(`vllm-manager keys list` says why)",
            settings.host,
        )
    else:
        log.warning("/v1 is open to anyone who reaches %s (VLLM_MANAGER_OPEN_INFERENCE is set)", settings.host)


def worker_info(view: WorkerView) -> WorkerInfo:
    """One worker as the metrics collector sees it."""
    started_at = view.started_at.timestamp() if view.started_at and view.ready else None
    return WorkerInfo(
        id=str(view.id),
        model=view.model,
        state=view.state.value,
        port=view.port,
        root_pid=view.pid,
        run_dir=view.run_path,
        restarts=view.restart_count,
        started_at=started_at,
        address=view.address,
        node=view.node if view.address != "127.0.0.1" else None,
        last_error=view.last_error,
        download=view.download.state_line() if view.download else None,
        download_percent=view.download.percent if view.download else None,
    )


def watched_disks(settings: Settings, engine: Engine) -> list[tuple[str, Path]]:
    """The data dir, the Hugging Face cache and the local model folders, one per filesystem."""
    candidates: list[tuple[str, Path]] = [("data", settings.data_dir)]
    hf_home = Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface"))
    candidates.append(("hf cache", hf_home))
    with session(engine) as db:
        for config in db.exec(select(ModelConfig)):
            if config.model.startswith(("/", "~", ".")):
                candidates.append((f"model {config.name}", Path(config.model)))
    seen: set[int] = set()
    disks = []
    for label, path in candidates:
        try:
            folder = expand_home(str(path))
            device = folder.stat().st_dev
        except (OSError, ValueError):
            continue  # a folder that is not there (or under a home this machine lacks) has no disk to watch
        if device not in seen:  # one card per filesystem, not one per folder on it
            seen.add(device)
            disks.append((label, folder))
    return disks
