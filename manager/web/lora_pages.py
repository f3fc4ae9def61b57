"""LoRA adapters on the dashboard: the list and register form on the Models page, and a worker's
adapters (load, unload, running/waiting, the CPU LoRA pool) on its Worker page.

Routes only translate. They call the functions /api/loras calls (manager.lora), so a form shows
the API's own messages, next to the field each is about. Every change answers with the
``loras-changed`` trigger; the lists on the page listen for it and redraw themselves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse

from manager.deps import EngineHttpDep, PinKeeperDep, SessionDep, SupervisorDep, WorkerId
from manager.errors import Conflict, Invalid, ManagerError, NotFound
from manager.lora import engine_api, registry, workers
from manager.lora.workers import WorkerLoras
from manager.metrics.pools import PoolsReader
from manager.schemas.lora_adapter import LoraAdapterCreate
from manager.services import models
from manager.web.forms import FORM_LEVEL, FormErrors, parse_form, refusal, validate
from manager.web.render import latency, render

router = APIRouter(include_in_schema=False)

CHANGED = {"HX-Trigger": "loras-changed"}
HELP = {
    "name": "what requests put in \"model\" to use it (vLLM's lora_name); lowercase letters, digits, '.', '_' and '-'",
    "path": "the adapter folder on the manager's machine: adapter_config.json and the weights",
    "base_config": "the model config it was trained for; that config needs enable_lora on",
    "pinned": "keep it loaded: it is loaded again whenever a worker of that config becomes ready",
}


def _html(template: str, headers: dict[str, str] | None = None, **context: Any) -> HTMLResponse:
    return HTMLResponse(render(template, **context), headers=headers)


# ---- Models page: the registry ----------------------------------------------------------------


def error_field(exc: ManagerError) -> str:
    """The form field a registry refusal is about. The registry says it in words, not by field:
    a name clash is a Conflict, an unknown config a NotFound, and the adapter checks are Invalid
    about the folder, except the one that says the config has enable_lora off."""
    if isinstance(exc, Conflict):
        return "name"
    if isinstance(exc, NotFound):
        return "base_config"
    if isinstance(exc, Invalid):
        return "base_config" if "enable_lora" in exc.message else "path"
    return FORM_LEVEL


def _form(db, values: dict, errors: FormErrors, message: str | None = None, note: str | None = None) -> str:
    return render(
        "fragments/lora_form.html",
        values=values,
        errors=errors,
        form_errors=errors.get(FORM_LEVEL),
        configs=models.list_models(db),
        help=HELP,
        message=message,
        note=note,
    )


def _loaded_text(loaded: list[str]) -> str:
    return f" Loaded now into ready workers: {', '.join(loaded)}." if loaded else ""


@router.get("/ui/loras/form", response_class=HTMLResponse)
def register_form(db: SessionDep) -> HTMLResponse:
    return HTMLResponse(_form(db, {}, FormErrors()))


@router.post("/ui/loras", response_class=HTMLResponse)
async def register(request: Request, db: SessionDep, keeper: PinKeeperDep) -> HTMLResponse:
    form = dict(await request.form())
    errors = FormErrors()
    data = validate(LoraAdapterCreate, parse_form(form, LoraAdapterCreate, errors), errors)
    if data is None:
        return HTMLResponse(_form(db, form, errors))
    try:
        adapter, check = registry.add_adapter(db, data)
    except ManagerError as exc:
        db.rollback()
        errors.add(error_field(exc), exc.message, exc.status)
        return HTMLResponse(_form(db, form, errors))
    loaded = await keeper.sweep() if adapter.pinned else []
    message = f"Registered {adapter.name} (rank {adapter.rank}) for {adapter.base_config}." + _loaded_text(loaded)
    return HTMLResponse(_form(db, {}, FormErrors(), message, check.note), headers=CHANGED)


def _list(db, message: str | None = None, error: str | None = None) -> HTMLResponse:
    adapters = [registry.to_public(a) for a in registry.list_adapters(db)]
    return _html("fragments/lora_list.html", adapters=adapters, message=message, error=error)


@router.get("/ui/loras/list", response_class=HTMLResponse)
def adapter_list(db: SessionDep) -> HTMLResponse:
    return _list(db)


@router.post("/ui/loras/{name}/pin", response_class=HTMLResponse)
async def pin(name: str, request: Request, db: SessionDep, keeper: PinKeeperDep) -> HTMLResponse:
    pinned = (await request.form()).get("pinned", "true") == "true"
    try:
        adapter = registry.set_pinned(db, name, pinned)
    except ManagerError as exc:
        return _list(db, error=refusal(exc))
    if not adapter.pinned:
        return _list(db, f"Unpinned {name}: a worker restart no longer loads it again.")
    loaded = await keeper.sweep()
    return _list(
        db,
        f"Pinned {name}: loaded again whenever a worker of {adapter.base_config} becomes ready." + _loaded_text(loaded),
    )


@router.post("/ui/loras/{name}/remove", response_class=HTMLResponse)
def remove(name: str, db: SessionDep) -> HTMLResponse:
    try:
        registry.remove_adapter(db, name)
    except ManagerError as exc:
        return _list(db, error=refusal(exc))
    # The registry does not reach into workers: say what still holds the adapter.
    return _list(
        db,
        f"Removed {name} from the registry. Workers that loaded it still serve it "
        f"until it is unloaded on their Worker page or they restart.",
    )


# ---- Worker page: adapters on one running worker ------------------------------------------------


@dataclass(frozen=True)
class LoadedRow:
    """One adapter the worker serves, joined with the registry and the engine's request info."""

    name: str
    path: str
    registered: bool
    pinned: bool
    rank: int | None
    last_load_s: float | None  # the manager's timing of its last load call
    requests: str  # "running", "waiting" or "idle"; "n/a" when the engine did not say


def loaded_rows(result: WorkerLoras) -> list[LoadedRow]:
    by_name = {r["name"]: r for r in result.registered}
    rows = []
    for adapter in sorted(result.loaded, key=lambda a: a.name):
        reg = by_name.get(adapter.name, {})
        if result.running is None:
            requests = "n/a"
        elif adapter.name in result.running:
            requests = "running"
        elif adapter.name in (result.waiting or []):
            requests = "waiting"
        else:
            requests = "idle"
        rows.append(
            LoadedRow(
                adapter.name,
                adapter.path,
                bool(reg),
                bool(reg.get("pinned")),
                reg.get("rank"),
                reg.get("last_load_s"),
                requests,
            )
        )
    return rows


def pool_load_seconds(reader: PoolsReader, run_dir: str | None) -> dict[str, float]:
    """Seconds the CPU LoRA pool took for each adapter's last load, keyed by vLLM's adapter id
    (the pool sees lora_int_id, not names); this includes reloads a request caused after an
    eviction, which the manager's own load timing never sees."""
    report = reader.sample(run_dir)
    found: dict[str, float] = {}
    for proc in report.processes:
        values = proc.sections.get("lora_pool", {}).get("load_seconds")
        if isinstance(values, dict):
            found.update({str(k): float(v) for k, v in values.items() if isinstance(v, (int, float))})
    return dict(sorted(found.items(), key=lambda kv: int(kv[0]) if kv[0].isdigit() else 0))


@router.get("/ui/workers/{worker_id}/loras", response_class=HTMLResponse)
def worker_section(worker_id: WorkerId, sup: SupervisorDep, db: SessionDep) -> HTMLResponse:
    """The LoRA section of a Worker page; nothing when the worker's config has LoRA off."""
    try:
        config = models.get_model(db, sup.view(worker_id).model)
    except NotFound:
        return HTMLResponse("")
    if not config.enable_lora:
        return HTMLResponse("")
    return _html("fragments/lora_worker.html", wid=worker_id, config=config)


@router.get("/ui/workers/{worker_id}/loras/load-form", response_class=HTMLResponse)
async def load_form(worker_id: WorkerId, sup: SupervisorDep, http: EngineHttpDep, db: SessionDep) -> HTMLResponse:
    model_config = sup.view(worker_id).model
    registered = registry.list_adapters(db, model_config)
    loaded: set[str] = set()
    why = None
    try:
        target = workers.ready_worker(sup, worker_id)
        loaded = {a.name for a in await engine_api.loaded(http, target.port, address=target.address, key=target.key)}
    except ManagerError as exc:
        why = exc.message
    return _html(
        "fragments/lora_load_form.html",
        wid=worker_id,
        model_config=model_config,
        choices=[a for a in registered if a.name not in loaded],
        any_registered=bool(registered),
        why=why,
    )


@router.post("/ui/workers/{worker_id}/loras/load", response_class=HTMLResponse)
async def load(
    worker_id: WorkerId, request: Request, sup: SupervisorDep, http: EngineHttpDep, db: SessionDep
) -> HTMLResponse:
    name = str((await request.form()).get("name") or "")
    if not name:
        return _html("fragments/lora_message.html", error=refusal(Invalid("Choose an adapter to load.")))
    try:
        done = await workers.load_on_worker(db, sup, http, worker_id, name)
    except ManagerError as exc:
        return _html("fragments/lora_message.html", headers=CHANGED, error=refusal(exc))
    return _html("fragments/lora_message.html", headers=CHANGED, ok=f"Loaded {name} in {latency(done['load_s'])}.")


@router.post("/ui/workers/{worker_id}/loras/{name}/unload", response_class=HTMLResponse)
async def unload(
    worker_id: WorkerId, name: str, sup: SupervisorDep, http: EngineHttpDep, db: SessionDep
) -> HTMLResponse:
    try:
        done = await workers.unload_from_worker(db, sup, http, worker_id, name)
    except ManagerError as exc:
        return _html("fragments/lora_message.html", headers=CHANGED, error=refusal(exc))
    return _html("fragments/lora_message.html", headers=CHANGED, ok=f"Unloaded {name}.", note=done.get("note"))


@router.get("/ui/workers/{worker_id}/loras/live", response_class=HTMLResponse)
async def live(worker_id: WorkerId, sup: SupervisorDep, http: EngineHttpDep, db: SessionDep) -> HTMLResponse:
    """Polled every few seconds: what the worker serves now and its CPU LoRA pool."""
    try:
        result = await workers.worker_loras(db, sup, http, worker_id)
    except ManagerError as exc:
        return _html("fragments/lora_worker_live.html", error=exc.message)
    run_dir = sup.view(worker_id).run_dir
    return _html(
        "fragments/lora_worker_live.html",
        wid=worker_id,
        result=result,
        rows=loaded_rows(result),
        pool=result.pool,
        pool_loads=pool_load_seconds(PoolsReader.from_plugin(), run_dir) if result.pool else {},
    )
