"""LoRA adapters: the registry, and loading them into running workers. HTTP only."""

from __future__ import annotations

import httpx
from fastapi import APIRouter, Request, Response
from pydantic import BaseModel

from manager.deps import SessionDep
from manager.lora import registry, workers
from manager.lora.pin_keeper import PinKeeper
from manager.lora.records import LoraAdapterCreate, LoraAdapterPublic
from manager.supervisor.supervisor import Supervisor

router = APIRouter(prefix="/api", tags=["loras"])


class Pin(BaseModel):
    pinned: bool = True


def _sup(request: Request) -> Supervisor:
    return request.app.state.supervisor


def pin_keeper(request: Request) -> PinKeeper:
    """The app's keeper of pinned adapters (app.state.lora_pin_keeper, started by the app's
    lifespan); made and started on first use when the app did not."""
    keeper = getattr(request.app.state, "lora_pin_keeper", None)
    if keeper is None:
        keeper = PinKeeper(request.app.state.engine, _sup(request))
        request.app.state.lora_pin_keeper = keeper
    keeper.start()
    return keeper


def _http(request: Request) -> httpx.AsyncClient:
    return pin_keeper(request).http


@router.get("/loras")
async def list_loras(db: SessionDep, request: Request, base_config: str | None = None) -> list[LoraAdapterPublic]:
    pin_keeper(request)
    return [registry.to_public(a) for a in registry.list_adapters(db, base_config)]


@router.post("/loras", status_code=201)
async def add_lora(body: LoraAdapterCreate, db: SessionDep, request: Request) -> dict:
    adapter, check = registry.add_adapter(db, body)
    loaded: list[str] = []
    if adapter.pinned:
        loaded = await pin_keeper(request).sweep()
    return {**registry.to_public(adapter).model_dump(mode="json"), "note": check.note, "loaded_now": loaded}


@router.get("/loras/{name}")
def get_lora(name: str, db: SessionDep) -> LoraAdapterPublic:
    return registry.to_public(registry.get_adapter(db, name))


@router.delete("/loras/{name}", status_code=204)
def delete_lora(name: str, db: SessionDep) -> Response:
    registry.remove_adapter(db, name)
    return Response(status_code=204)


@router.post("/loras/{name}/pin")
async def pin_lora(name: str, db: SessionDep, request: Request, body: Pin | None = None) -> dict:
    adapter = registry.set_pinned(db, name, (body or Pin()).pinned)
    loaded = await pin_keeper(request).sweep() if adapter.pinned else []
    return {**registry.to_public(adapter).model_dump(mode="json"), "loaded_now": loaded}


@router.get("/workers/{worker_id}/loras")
async def worker_loras(worker_id: int, db: SessionDep, request: Request) -> dict:
    result = await workers.worker_loras(db, _sup(request), _http(request), worker_id)
    return result.as_dict()


@router.post("/workers/{worker_id}/loras/{name}/load")
async def load_lora(worker_id: int, name: str, db: SessionDep, request: Request) -> dict:
    return await workers.load_on_worker(db, _sup(request), _http(request), worker_id, name)


@router.post("/workers/{worker_id}/loras/{name}/unload")
async def unload_lora(worker_id: int, name: str, db: SessionDep, request: Request) -> dict:
    return await workers.unload_from_worker(db, _sup(request), _http(request), worker_id, name)
