"""The Models page: model configs and offload profiles in forms, and the command preview.

Forms post to /ui/... routes that validate with the same schemas and services as /api/models and
/api/profiles; on an error the form comes back with each message next to its field.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import HTMLResponse
from pydantic import BaseModel

from manager.deps import SessionDep, SettingsDep, SupervisorDep, is_authorized
from manager.errors import ManagerError, NotFound
from manager.launch.command import preview_command
from manager.launch.secrets import Redactor, without_secrets
from manager.launch.validation import validate_engine_argv
from manager.schemas.common import MARKER
from manager.schemas.model_config import ModelConfigCreate, ModelConfigUpdate
from manager.schemas.offload_profile import (
    EVICTION_POLICIES,
    OffloadProfileCreate,
    OffloadProfileUpdate,
)
from manager.services import models, profiles
from manager.web.forms import FORM_LEVEL, FormErrors, parse_form, to_text, validate
from manager.web.render import render

router = APIRouter(include_in_schema=False)

# Shown under a field; the offload ones say what the memory is for, never "more context".
HELP = {
    "name": "letters, digits, '-', '_' and '.'; used in URLs and the CLI",
    "model": "a local folder or a Hugging Face id (downloaded into the cache at the first start when missing)",
    "gpu_ids": "comma separated, e.g. 0, 1; empty: the GPUs the worker is started with",
    "gpu_memory_utilization": "share of each GPU's memory vLLM may take (0-1]",
    "extra_args": f"more vLLM flags as a shell line, e.g. --load-format dummy; {MARKER} keeps the stored value",
    "env": f"one KEY=VALUE per line; {MARKER} keeps the stored value",
    "enable_prefix_caching": "true or false; empty: vLLM's default",
    "offload_profile": "host-memory settings for this model",
    "kv_offload_gib": "host RAM for a CPU prefix-cache tier; it does not raise max_model_len",
    "kv_offload_num_cpu_blocks": "the same size in KV blocks (instead of GiB)",
    "lora_pool_gib": "pinned host memory kept for LoRA adapters",
    "moe_gpu_cache_gib": "GPU memory for the hottest experts when experts live in host RAM",
    "pinned_budget_gib": "cap on pinned host buffers of the engine_patches plugin",
    "aliases": "other names requests to /v1 may use, separated by spaces",
    "idle_timeout_s": "stop (or put to sleep) after this many seconds without a /v1 request; empty: never",
    "persistent": "never stopped or put to sleep to make room for another model",
    "sleep_level": "1: sleep keeps the weights in host RAM, 2: drops them; empty: sleep mode off",
    "replicas": "how many workers run this model; /v1 spreads requests over them",
    "min_replicas": "with max replicas: the fewest that scaling down keeps (empty: 1)",
    "max_replicas": "add replicas up to this many while requests queue; empty: no scaling",
    "scale_up_after_s": "seconds requests must queue before a replica is added",
    "scale_down_after_s": "seconds without a request before a replica above min replicas is stopped",
    "max_concurrent": "the most /v1 requests it answers at once (all replicas); more wait their turn, "
    "taking turns between keys; empty: no limit",
    "min_residency_s": "once swapped in for /v1, stay this many seconds before a model sharing its GPUs may "
    "evict it, unless idle; 0: off; empty: its last swap-in time + 5 s",
    "loading_progress": "streamed /v1 requests that wait for its start get progress lines (SSE comments) "
    "until the first chunk, so proxies do not time them out",
}
TEXTAREAS = {"extra_args", "env", "description"}


def _fields(schema: type[BaseModel], values: dict[str, Any], choices: dict[str, list[str]], posted: bool):
    """The form's fields in schema order, with their text, input kind and help. ``posted``:
    ``values`` is the submitted form itself, where an unticked checkbox is simply absent."""
    out = []
    for name, info in schema.model_fields.items():
        default = None if info.is_required() else info.get_default(call_default_factory=True)
        value = values.get(name, default)
        if posted and info.annotation is bool:
            value = name in values
        kind = "checkbox" if info.annotation is bool else "text"
        if name in TEXTAREAS:
            kind = "textarea"
        if name in choices:
            kind = "select"
        out.append(
            {
                "name": name,
                "label": name.replace("_", " "),
                "kind": kind,
                "text": to_text(value, info.annotation),
                "checked": bool(value) if kind == "checkbox" else False,
                "choices": choices.get(name, []),
                "help": HELP.get(name, info.description or ""),
            }
        )
    return out


def _model_form(
    db, *, name: str | None, values: dict, errors: FormErrors, saved: bool = False, posted: bool = False
) -> str:
    schema = ModelConfigCreate if name is None else ModelConfigUpdate
    choices = {"offload_profile": [""] + [p.name for p in profiles.list_profiles(db)]}
    return _config_form("model", "models", schema, choices, name, values, errors, saved, posted)


def _profile_form(
    *, name: str | None, values: dict, errors: FormErrors, saved: bool = False, posted: bool = False
) -> str:
    schema = OffloadProfileCreate if name is None else OffloadProfileUpdate
    choices = {"kv_eviction_policy": list(EVICTION_POLICIES)}
    return _config_form("profile", "profiles", schema, choices, name, values, errors, saved, posted)


def _config_form(
    kind: str,
    plural: str,
    schema,
    choices: dict,
    name: str | None,
    values: dict,
    errors: FormErrors,
    saved: bool,
    posted: bool,
) -> str:
    """The shared create/edit form of a model config or an offload profile."""
    return render(
        "fragments/config_form.html",
        kind=kind,
        name=name,
        fields=_fields(schema, values, choices, posted),
        errors=errors,
        form_errors=errors.get(FORM_LEVEL),
        saved=saved,
        action=f"/ui/{plural}/new" if name is None else f"/ui/{plural}/{name}",
    )


def _service_error(exc: ManagerError, errors: FormErrors, creating: bool, on_config: bool = True) -> None:
    """Put a service's refusal on the field it is about (``on_config``: the config form, which has the
    offload profile field; a profile's own form shows a missing profile above its fields)."""
    where = exc.detail.get("field")
    if where is None and on_config and isinstance(exc, NotFound) and "offload profile" in exc.message:
        where = "offload_profile"
    if where is None and creating and "already exists" in exc.message:
        where = "name"
    errors.add(str(where or FORM_LEVEL).split("[")[0], exc.message, exc.status)


def _page(template: str, **context: Any) -> HTMLResponse:
    return HTMLResponse(render(template, **context))


@router.get("/models", response_class=HTMLResponse)
def models_page(db: SessionDep) -> HTMLResponse:
    return _page(
        "models.html",
        page="models",
        configs=[models.to_public(db, m) for m in models.list_models(db)],
        profiles=[profiles.to_public(p) for p in profiles.list_profiles(db)],
    )


@router.get("/models/new", response_class=HTMLResponse)
def new_model_page(db: SessionDep) -> HTMLResponse:
    form = _model_form(db, name=None, values={}, errors=FormErrors())
    return _page("config_edit.html", page="models", title="New model config", form=form, preview=None)


@router.get("/models/{name}", response_class=HTMLResponse)
def edit_model_page(name: str, request: Request, db: SessionDep, settings: SettingsDep) -> HTMLResponse:
    try:
        config = models.to_public(db, models.get_model(db, name))
    except NotFound as exc:
        return HTMLResponse(render("error.html", page="models", message=exc.message), 404)
    if not is_authorized(request, db, settings):
        config = without_secrets(config)  # saving it back keeps the stored values
    form = _model_form(db, name=name, values=config.model_dump(), errors=FormErrors())
    return _page("config_edit.html", page="models", title=f"Model config {name}", form=form, preview=name)


async def _save_model(request: Request, db, settings, supervisor, name: str | None) -> HTMLResponse:
    form = dict(await request.form())
    errors = FormErrors()
    schema: type[ModelConfigCreate | ModelConfigUpdate] = ModelConfigCreate if name is None else ModelConfigUpdate
    data = validate(schema, parse_form(form, schema, errors), errors)
    if data is not None:
        try:
            if isinstance(data, ModelConfigCreate):
                config = models.create_model(
                    db, data, rules=models.WriteRules.of(settings), check_node=supervisor.check_node
                )
            else:
                assert name is not None
                config = models.replace_model(
                    db, name, data, rules=models.WriteRules.of(settings), check_node=supervisor.check_node
                )
        except ManagerError as exc:
            db.rollback()
            _service_error(exc, errors, creating=name is None)
        else:
            if name is None:  # a new config gets its own page, with the command preview
                return HTMLResponse("", headers={"HX-Redirect": f"/models/{config.name}"})
            public = models.to_public(db, config)
            values = (public if is_authorized(request, db, settings) else without_secrets(public)).model_dump()
            form_html = _model_form(db, name=name, values=values, errors=errors, saved=True)
            # The command preview beside the form listens for this and redraws itself.
            return HTMLResponse(form_html, headers={"HX-Trigger": "config-saved"})
    return HTMLResponse(_model_form(db, name=name, values=form, errors=errors, posted=True))


@router.post("/ui/models/new", response_class=HTMLResponse)
async def create_model(
    request: Request, db: SessionDep, settings: SettingsDep, supervisor: SupervisorDep
) -> HTMLResponse:
    return await _save_model(request, db, settings, supervisor, None)


@router.post("/ui/models/{name}", response_class=HTMLResponse)
async def update_model(
    name: str, request: Request, db: SessionDep, settings: SettingsDep, supervisor: SupervisorDep
) -> HTMLResponse:
    return await _save_model(request, db, settings, supervisor, name)


@router.get("/ui/models/{name}/command", response_class=HTMLResponse)
async def command_preview(
    name: str, request: Request, db: SessionDep, settings: SettingsDep, supervisor: SupervisorDep, check: bool = False
):
    """The argv and environment a start would use; with check=1, also vLLM's own verdict."""
    config = models.get_model(db, name)
    try:
        cmd = preview_command(config, models.profile_of(db, config), settings, supervisor.fetcher)
    except ManagerError as exc:
        return HTMLResponse(render("fragments/command.html", error=exc.message, name=name))
    secrets = Redactor.of_config(config)
    authorized = is_authorized(request, db, settings)
    result = None
    if check:
        result = await run_in_threadpool(
            validate_engine_argv,
            settings.engine_python,
            cmd.engine_argv,
            cmd.env,
            settings.validation_timeout_s,
        )
        if not authorized:
            result = replace(result, message=secrets.text(result.message))
    shown = cmd if authorized else secrets.command(cmd)
    return HTMLResponse(render("fragments/command.html", cmd=shown, result=result, name=name))


@router.get("/profiles/new", response_class=HTMLResponse)
def new_profile_page() -> HTMLResponse:
    form = _profile_form(name=None, values={}, errors=FormErrors())
    return _page("config_edit.html", page="models", title="New offload profile", form=form, preview=None)


@router.get("/profiles/{name}", response_class=HTMLResponse)
def edit_profile_page(name: str, db: SessionDep) -> HTMLResponse:
    try:
        profile = profiles.to_public(profiles.get_profile(db, name))
    except NotFound as exc:
        return HTMLResponse(render("error.html", page="models", message=exc.message), 404)
    form = _profile_form(name=name, values=profile.model_dump(), errors=FormErrors())
    return _page("config_edit.html", page="models", title=f"Offload profile {name}", form=form, preview=None)


async def _save_profile(request: Request, db, name: str | None) -> HTMLResponse:
    form = dict(await request.form())
    errors = FormErrors()
    schema: type[OffloadProfileCreate | OffloadProfileUpdate] = (
        OffloadProfileCreate if name is None else OffloadProfileUpdate
    )
    data = validate(schema, parse_form(form, schema, errors), errors)
    if data is not None:
        try:
            if isinstance(data, OffloadProfileCreate):
                profiles.create_profile(db, data)
            else:
                assert name is not None
                profile = profiles.replace_profile(db, name, data)
        except ManagerError as exc:
            db.rollback()
            _service_error(exc, errors, creating=name is None, on_config=False)
        else:
            if name is None:
                return HTMLResponse("", headers={"HX-Redirect": "/models"})
            values = profiles.to_public(profile).model_dump()
            return HTMLResponse(_profile_form(name=name, values=values, errors=errors, saved=True))
    return HTMLResponse(_profile_form(name=name, values=form, errors=errors, posted=True))


@router.post("/ui/profiles/new", response_class=HTMLResponse)
async def create_profile(request: Request, db: SessionDep) -> HTMLResponse:
    return await _save_profile(request, db, None)


@router.post("/ui/profiles/{name}", response_class=HTMLResponse)
async def update_profile(name: str, request: Request, db: SessionDep) -> HTMLResponse:
    return await _save_profile(request, db, name)
