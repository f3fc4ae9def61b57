from __future__ import annotations

import asyncio
import json

from fastapi import APIRouter, Request, Response
from pydantic import BaseModel, Field
from sse_starlette.sse import EventSourceResponse

from manager.deps import SessionDep
from manager.launch.preflight import worker_kv_check
from manager.supervisor.supervisor import Supervisor

router = APIRouter(prefix="/api", tags=["workers"])


def _sup(request: Request) -> Supervisor:
    return request.app.state.supervisor


class WorkerStart(BaseModel):
    model: str = Field(description="Name of a stored model config")
    gpus: list[int] | None = Field(default=None, description="GPU ids; default the config's gpu_ids")
    port: int | None = Field(default=None, ge=1, le=65535)
    force: bool = Field(default=False, description="Start even if the memory plan says it will not fit")


class WorkerSwitch(BaseModel):
    model: str
    force: bool = False


class Adopt(BaseModel):
    model: str = Field(description="The model config the hand-started server corresponds to")


@router.get("/workers")
def list_workers(request: Request) -> list[dict]:
    return _sup(request).list()


@router.post("/workers", status_code=201)
async def start_worker(body: WorkerStart, request: Request, response: Response) -> dict:
    snapshot, created = await _sup(request).create_worker(body.model, body.gpus, body.port, body.force)
    if not created:
        response.status_code = 200
    return snapshot


@router.get("/workers/unmanaged")
def unmanaged(request: Request) -> list[dict]:
    """vLLM servers on this machine that the manager did not start."""
    return _sup(request).unmanaged()


@router.post("/workers/unmanaged/{pid}/adopt", status_code=201)
async def adopt_unmanaged(pid: int, body: Adopt, request: Request) -> dict:
    return await _sup(request).adopt_unmanaged(pid, body.model)


@router.post("/workers/unmanaged/{pid}/stop")
async def stop_unmanaged(pid: int, request: Request) -> dict:
    return await _sup(request).stop_unmanaged(pid)


@router.get("/workers/{worker_id}")
def get_worker(worker_id: int, request: Request) -> dict:
    return _sup(request).runner(worker_id).snapshot()


@router.post("/workers/{worker_id}/start")
async def start(worker_id: int, request: Request, force: bool = False) -> dict:
    return await _sup(request).command(worker_id, "start", force=force)


@router.post("/workers/{worker_id}/stop")
async def stop(worker_id: int, request: Request) -> dict:
    return await _sup(request).command(worker_id, "stop")


@router.post("/workers/{worker_id}/restart")
async def restart(worker_id: int, request: Request, force: bool = False) -> dict:
    return await _sup(request).command(worker_id, "restart", force=force)


@router.post("/workers/{worker_id}/switch")
async def switch(worker_id: int, body: WorkerSwitch, request: Request) -> dict:
    return await _sup(request).command(worker_id, "switch", body.model, body.force)


@router.delete("/workers/{worker_id}", status_code=204)
async def delete(worker_id: int, request: Request) -> Response:
    await _sup(request).command(worker_id, "delete")
    return Response(status_code=204)


@router.get("/workers/{worker_id}/logs")
def logs(worker_id: int, request: Request, tail: int = 200) -> dict:
    runner = _sup(request).runner(worker_id)
    runner.logs.poll()
    return {"worker": worker_id, "file": runner.snapshot()["log_file"], "lines": runner.logs.tail(min(tail, 5000))}


@router.get("/workers/{worker_id}/logs/stream")
async def logs_stream(worker_id: int, request: Request, tail: int = 100) -> EventSourceResponse:
    runner = _sup(request).runner(worker_id)

    async def lines():
        queue = runner.logs.subscribe()
        try:
            for line in runner.logs.tail(tail):
                yield {"event": "log", "data": line}
            while True:
                try:
                    line = await asyncio.wait_for(queue.get(), timeout=1.0)
                except TimeoutError:
                    runner.logs.poll()  # a stopped worker has no owner tick reading its file
                    continue
                yield {"event": "log", "data": line}
        finally:
            runner.logs.unsubscribe(queue)

    return EventSourceResponse(lines(), ping=15)


@router.get("/workers/{worker_id}/kv-check")
def kv_check(worker_id: int, request: Request, db: SessionDep) -> dict:
    """vLLM's own KV cache figures (from the engine log) beside the planner's prediction."""
    runner = _sup(request).runner(worker_id)
    return worker_kv_check(db, runner.row.model_name, runner.logs.path)


@router.get("/events")
def events(request: Request, worker_id: int | None = None, limit: int = 100) -> list[dict]:
    return _sup(request).events.recent(worker_id, min(max(limit, 1), 1000))


@router.get("/events/stream")
async def events_stream(request: Request) -> EventSourceResponse:
    log = _sup(request).events

    async def stream():
        queue = log.listen()
        try:
            while True:
                event = await queue.get()
                yield {"event": "event", "data": json.dumps(event)}
        finally:
            log.unlisten(queue)

    return EventSourceResponse(stream(), ping=15)
