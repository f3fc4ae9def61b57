"""HTTP for the planner: translate requests and errors, nothing else."""

from __future__ import annotations

from fastapi import APIRouter, HTTPException

from manager.planner import Plan, PlanError, PlanRequest, make_plan
from manager.planner.gpus import CATALOGUE, MiB, NoGPU, detect_gpu

router = APIRouter(tags=["plan"])


@router.post("/api/plan", response_model=Plan)
def plan(request: PlanRequest) -> Plan:
    """What fits for a model and settings, why, and what would extend it."""
    try:
        return make_plan(request)
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
