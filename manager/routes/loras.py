"""LoRA adapters: the registry, and loading them into running workers. HTTP only."""

from __future__ import annotations

from fastapi import APIRouter, Response
from pydantic import BaseModel, field_validator

from manager.deps import EngineHttpDep, PinKeeperDep, SessionDep, SupervisorDep, WorkerId
from manager.lora import registry, workers
from manager.openapi import errors
from manager.schemas.common import keep_bools_and_numbers_apart
from manager.schemas.lora_adapter import LoraAdapterCreate, LoraAdapterPublic

router = APIRouter(prefix="/api", tags=["loras"])

NOT_READY = "The worker is not ready (starting, sleeping, stopped): adapters are loaded into a serving worker"


class Pin(BaseModel):
    pinned: bool = True

    _json_types = field_validator("*", mode="before")(keep_bools_and_numbers_apart)


@router.get("/loras")
def list_loras(db: SessionDep, base_config: str | None = None) -> list[LoraAdapterPublic]:
    return [registry.to_public(a) for a in registry.list_adapters(db, base_config)]


@router.post("/loras", status_code=201, responses=errors(404, 409, 422, _404="No model config of that name"))
async def add_lora(body: LoraAdapterCreate, db: SessionDep, keeper: PinKeeperDep) -> dict:
    adapter, check = registry.add_adapter(db, body)
    loaded: list[str] = []
    if adapter.pinned:
        loaded = await keeper.sweep()
    return {**registry.to_public(adapter).model_dump(mode="json"), "note": check.note, "loaded_now": loaded}


@router.get("/loras/{name}", responses=errors(404))
def get_lora(name: str, db: SessionDep) -> LoraAdapterPublic:
    return registry.to_public(registry.get_adapter(db, name))


@router.delete("/loras/{name}", status_code=204, responses=errors(404))
def delete_lora(name: str, db: SessionDep) -> Response:
    registry.remove_adapter(db, name)
    return Response(status_code=204)


@router.post("/loras/{name}/pin", responses=errors(404))
async def pin_lora(name: str, db: SessionDep, keeper: PinKeeperDep, body: Pin | None = None) -> dict:
    adapter = registry.set_pinned(db, name, (body or Pin()).pinned)
    loaded = await keeper.sweep() if adapter.pinned else []
    return {**registry.to_public(adapter).model_dump(mode="json"), "loaded_now": loaded}


@router.get("/workers/{worker_id:int}/loras", responses=errors(404, 409, 502, _409=NOT_READY))
async def worker_loras(worker_id: WorkerId, db: SessionDep, sup: SupervisorDep, http: EngineHttpDep) -> dict:
    result = await workers.worker_loras(db, sup, http, worker_id)
    return result.as_dict()


@router.post(
    "/workers/{worker_id:int}/loras/{name}/load",
    responses=errors(404, 409, 422, 502, _409=NOT_READY + ", or the adapter is registered for another model config"),
)
async def load_lora(worker_id: WorkerId, name: str, db: SessionDep, sup: SupervisorDep, http: EngineHttpDep) -> dict:
    return await workers.load_on_worker(db, sup, http, worker_id, name)


@router.post("/workers/{worker_id:int}/loras/{name}/unload", responses=errors(404, 409, 422, 502, _409=NOT_READY))
async def unload_lora(worker_id: WorkerId, name: str, db: SessionDep, sup: SupervisorDep, http: EngineHttpDep) -> dict:
    return await workers.unload_from_worker(db, sup, http, worker_id, name)
