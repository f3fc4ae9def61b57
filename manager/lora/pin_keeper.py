"""Keeps pinned adapters loaded: whenever a worker becomes ready, its pinned adapters go back in.

A restarted vLLM process has forgotten every runtime-loaded adapter. The keeper listens to the
supervisor's event log for "ready" and loads the pinned adapters of that worker's model config;
it also sweeps all ready workers when it starts and when an adapter is pinned.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import httpx
from sqlalchemy.engine import Engine

from manager.db import session
from manager.errors import ManagerError
from manager.lora import engine_api, registry
from manager.supervisor.supervisor import Supervisor

log = logging.getLogger("vllm_manager.lora")


class PinKeeper:
    def __init__(self, engine: Engine, supervisor: Supervisor, http: httpx.AsyncClient) -> None:
        self.engine = engine
        self.supervisor = supervisor
        self.http = http
        self._task: asyncio.Task | None = None
        self._lock = asyncio.Lock()

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def start(self) -> None:
        if not self.running:
            self._task = asyncio.create_task(self._run(), name="lora-pin-keeper")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None

    async def sweep(self, worker_id: int | None = None) -> list[str]:
        """Load missing pinned adapters into ready workers (one, or all); returns what it loaded."""
        done: list[str] = []
        async with self._lock:  # a "ready" event and a pin may sweep at once: load once
            views = self.supervisor.views()
            for view in views:
                if (worker_id is not None and view.id != worker_id) or not view.ready or not view.port:
                    continue
                done += await self._restore(view.id, view.port, view.model, view.address)
        return done

    async def _restore(self, worker_id: int, port: int, model_config: str, address: str) -> list[str]:
        with session(self.engine) as db:
            pinned = [a for a in registry.list_adapters(db, model_config) if a.pinned]
        if not pinned:
            return []
        key = self.supervisor.engine_key(worker_id)
        try:
            present = {a.name for a in await engine_api.loaded(self.http, port, address=address, key=key)}
        except ManagerError as exc:
            log.warning("worker %s: cannot list its adapters (%s)", worker_id, exc.message)
            return []
        done = []
        for adapter in pinned:
            if adapter.name in present:
                continue
            try:
                seconds = await engine_api.load(self.http, port, adapter.name, adapter.path, address=address, key=key)
            except ManagerError as exc:
                self.supervisor.events.record(
                    "lora_pin_failed",
                    f"pinned LoRA adapter {adapter.name} did not load: {exc.message}",
                    worker_id,
                    adapter=adapter.name,
                )
                continue
            with session(self.engine) as db:
                registry.record_load(db, adapter.name, seconds)
            self.supervisor.events.record(
                "lora_loaded",
                f"pinned LoRA adapter {adapter.name} loaded in {seconds:.2f}s",
                worker_id,
                adapter=adapter.name,
                seconds=round(seconds, 3),
                pinned=True,
            )
            done.append(adapter.name)
        return done

    async def _run(self) -> None:
        queue = self.supervisor.events.listen()
        try:
            await self.sweep()
            while True:
                event = await queue.get()
                if event.get("kind") == "ready" and event.get("worker_id") is not None:
                    try:
                        await self.sweep(int(event["worker_id"]))
                    except Exception:  # one bad sweep must not end the keeper
                        log.exception("re-loading pinned LoRA adapters failed")
        finally:
            self.supervisor.events.unlisten(queue)
