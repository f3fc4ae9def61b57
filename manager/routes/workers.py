from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import asdict
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Query, Response
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from sse_starlette.sse import EventSourceResponse

from manager.deps import MAX_EVENTS, MAX_ROW_ID, LogTail, Pid, SessionDep, SupervisorDep, WorkerId
from manager.launch.secrets import hide_flag_values
from manager.openapi import EVENT_STREAM, errors
from manager.schemas.common import (
    MAX_GPUS,
    UNIQUE_ITEMS,
    GpuId,
    Name,
    ShortText,
    keep_bools_and_numbers_apart,
    refuse_unknown_fields,
)
from manager.services.kv_check import worker_kv_check
from manager.supervisor.view import WorkerView

router = APIRouter(prefix="/api", tags=["workers"])

NODE_SILENT = "Its node of the Ray cluster does not answer: try again"

SleepLevel = Annotated[int, Query(ge=1, le=2, description="1 keeps the weights in host RAM, 2 drops them")]


class Body(BaseModel):
    """A request body that refuses a field it does not have, naming the closest real one."""

    # Said in the schema too (additionalProperties: false); the validator names the closest field.
    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _known_fields(cls, data: Any) -> Any:
        return refuse_unknown_fields(cls, data)


class WorkerStart(Body):
    model: Name = Field(description="Name of a stored model config")
    gpus: list[GpuId] | None = Field(
        default=None,
        max_length=MAX_GPUS,
        description="GPU ids, each once; default the config's gpu_ids",
        json_schema_extra=UNIQUE_ITEMS,
    )
    port: int | None = Field(default=None, ge=1, le=65535)
    force: bool = Field(default=False, description="Start even if the memory plan says it will not fit")
    node: ShortText | None = Field(
        default=None,
        description="With a Ray cluster: the node this start runs on (default the config's node, else the first "
        "that fits); a worker whose config names no node may later move if that node is lost",
    )

    _json_types = field_validator("*", mode="before")(keep_bools_and_numbers_apart)

    @field_validator("gpus")
    @classmethod
    def _distinct(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and len(set(v)) != len(v):
            raise ValueError("GPU ids repeat: give each GPU once")
        return v


class WorkerSwitch(Body):
    model: Name
    force: bool = False

    _json_types = field_validator("*", mode="before")(keep_bools_and_numbers_apart)


class Adopt(Body):
    model: Name = Field(description="The model config the hand-started server corresponds to")


@router.get("/workers")
def list_workers(sup: SupervisorDep) -> list[WorkerView]:
    return sup.views()


@router.post(
    "/workers",
    status_code=201,
    responses={
        200: {
            "model": WorkerView,
            "description": "Workers of this config already run (or start): the first of them, with any replicas "
            "missing started beside it; or its stopped or failed worker was started again: that one",
        },
        **errors(404, 409, 422, _404="No model config of that name"),
    },
)
async def start_worker(body: WorkerStart, sup: SupervisorDep, response: Response) -> WorkerView:
    """Start a model config's workers: as many as its ``replicas`` (each placed in free room), the first
    of them in the answer (201). While they run or start, the answer is the first (200), and replicas
    missing are started beside it; a stopped or failed worker of the config is started again (200).
    Asked for particular GPUs, a port or a node: one worker, created unless one already runs."""
    view, created = await sup.create_worker(body.model, body.gpus, body.port, body.force, body.node)
    if not created:
        response.status_code = 200
    return view


@router.get("/workers/unmanaged")
def unmanaged(sup: SupervisorDep) -> list[dict]:
    """vLLM servers on this machine that the manager did not start (their --api-key and the like hidden)."""
    return [{**asdict(u), "cmdline": hide_flag_values(u.cmdline)} for u in sup.unmanaged()]


@router.post("/workers/unmanaged/{pid}/adopt", status_code=201, responses=errors(404, 409))
async def adopt_unmanaged(pid: Pid, body: Adopt, sup: SupervisorDep) -> WorkerView:
    return await sup.adopt_unmanaged(pid, body.model)


@router.post("/workers/unmanaged/{pid}/stop", responses=errors(404))
async def stop_unmanaged(pid: Pid, sup: SupervisorDep) -> dict:
    return await sup.stop_unmanaged(pid)


@router.get("/workers/{worker_id:int}", responses=errors(404))
def get_worker(worker_id: WorkerId, sup: SupervisorDep) -> WorkerView:
    return sup.view(worker_id)


@router.post("/workers/{worker_id:int}/start", responses=errors(404, 409, 422, 503, _503=NODE_SILENT))
async def start(worker_id: WorkerId, sup: SupervisorDep, force: bool = False) -> WorkerView:
    return await sup.command(worker_id, "start", force=force)


@router.post("/workers/{worker_id:int}/stop", responses=errors(404, 409, 503, _503=NODE_SILENT))
async def stop(worker_id: WorkerId, sup: SupervisorDep) -> WorkerView:
    return await sup.command(worker_id, "stop")


@router.post("/workers/{worker_id:int}/restart", responses=errors(404, 409, 422, 503, _503=NODE_SILENT))
async def restart(worker_id: WorkerId, sup: SupervisorDep, force: bool = False) -> WorkerView:
    return await sup.command(worker_id, "restart", force=force)


@router.post("/workers/{worker_id:int}/switch", responses=errors(404, 409, 422, 503, _503=NODE_SILENT))
async def switch(worker_id: WorkerId, body: WorkerSwitch, sup: SupervisorDep) -> WorkerView:
    return await sup.command(worker_id, "switch", body.model, body.force)


@router.post("/workers/{worker_id:int}/sleep", responses=errors(404, 409, 503, _503=NODE_SILENT))
async def sleep(worker_id: WorkerId, sup: SupervisorDep, level: SleepLevel = 1) -> WorkerView:
    """vLLM sleep mode (the config needs sleep_level): level 1 keeps the weights in host RAM, 2 drops them."""
    return await sup.command(worker_id, "sleep", level=level)


@router.post("/workers/{worker_id:int}/wake", responses=errors(404, 409, 503, _503=NODE_SILENT))
async def wake(worker_id: WorkerId, sup: SupervisorDep) -> WorkerView:
    return await sup.command(worker_id, "wake")


@router.delete("/workers/{worker_id:int}", status_code=204, responses=errors(404, 409, 503, _503=NODE_SILENT))
async def delete(worker_id: WorkerId, sup: SupervisorDep) -> Response:
    await sup.command(worker_id, "delete")
    return Response(status_code=204)


@router.get("/workers/{worker_id:int}/logs", responses=errors(404))
def logs(worker_id: WorkerId, sup: SupervisorDep, tail: LogTail = 200) -> dict:
    lines = sup.log_lines(worker_id, tail)
    return {"worker": worker_id, "file": sup.view(worker_id).log_file, "lines": lines}


@router.get(
    "/workers/{worker_id:int}/logs/stream",
    response_class=EventSourceResponse,
    responses={**EVENT_STREAM, **errors(404)},
)
async def logs_stream(worker_id: WorkerId, sup: SupervisorDep, tail: LogTail = 100) -> EventSourceResponse:
    source = sup.log_stream(worker_id, tail)

    async def lines() -> AsyncIterator[dict[str, str]]:
        async for line in source:
            yield {"event": "log", "data": line}

    return EventSourceResponse(lines(), ping=15)


@router.get("/workers/{worker_id:int}/kv-check", responses=errors(404))
def kv_check(worker_id: WorkerId, sup: SupervisorDep, db: SessionDep) -> dict:
    """vLLM's own KV cache figures (from the engine log) beside the planner's prediction."""
    view = sup.view(worker_id)
    return worker_kv_check(db, view.model, Path(view.log_file) if view.log_file else None)


@router.get("/events")
def events(
    sup: SupervisorDep,
    worker_id: Annotated[int | None, Query(ge=1, le=MAX_ROW_ID, description="Only this worker's events")] = None,
    limit: Annotated[int, Query(ge=1, le=MAX_EVENTS, description="The newest this many")] = 100,
) -> list[dict]:
    return sup.events.recent(worker_id, limit)


@router.get("/events/stream", response_class=EventSourceResponse, responses=EVENT_STREAM)
async def events_stream(sup: SupervisorDep) -> EventSourceResponse:
    log = sup.events

    async def stream() -> AsyncIterator[dict[str, str]]:
        queue = log.listen()
        try:
            while True:
                event = await queue.get()
                yield {"event": "event", "data": json.dumps(event)}
        finally:
            log.unlisten(queue)

    return EventSourceResponse(stream(), ping=15)
