from fastapi import APIRouter, Request, Response
from fastapi.concurrency import run_in_threadpool

from manager.deps import SessionDep, SettingsDep, is_authorized
from manager.errors import Invalid
from manager.launch.command import preview_command
from manager.launch.validation import validate_engine_argv
from manager.schemas.model_config import ModelConfigCreate, ModelConfigPublic, ModelConfigUpdate
from manager.services import models

router = APIRouter(prefix="/api/models", tags=["model configs"])


HIDDEN = "<hidden: send the API token to see it>"


def _shown(request: Request, db, settings, public: ModelConfigPublic) -> ModelConfigPublic:
    """Environment values often hold secrets (HF_TOKEN): once a token exists, only its holders see them."""
    if public.env and not is_authorized(request, db, settings):
        return public.model_copy(update={"env": {k: HIDDEN for k in public.env}})
    return public


@router.get("", response_model=list[ModelConfigPublic])
def list_models(request: Request, db: SessionDep, settings: SettingsDep):
    return [_shown(request, db, settings, models.to_public(db, m)) for m in models.list_models(db)]


@router.post("", response_model=ModelConfigPublic, status_code=201)
def create_model(data: ModelConfigCreate, db: SessionDep, settings: SettingsDep):
    config = models.create_model(db, data, allow_code_flags=settings.allow_code_flags)
    return models.to_public(db, config)


@router.get("/{name}", response_model=ModelConfigPublic)
def get_model(name: str, request: Request, db: SessionDep, settings: SettingsDep):
    return _shown(request, db, settings, models.to_public(db, models.get_model(db, name)))


@router.put("/{name}", response_model=ModelConfigPublic)
def replace_model(name: str, data: ModelConfigUpdate, db: SessionDep, settings: SettingsDep):
    config = models.replace_model(db, name, data, allow_code_flags=settings.allow_code_flags)
    return models.to_public(db, config)


@router.delete("/{name}", status_code=204)
def delete_model(name: str, db: SessionDep) -> Response:
    models.delete_model(db, name)
    return Response(status_code=204)


@router.get("/{name}/command")
async def command(name: str, request: Request, db: SessionDep, settings: SettingsDep, validate: bool = True) -> dict:
    """The argv and environment this config launches, checked by the engine's own vLLM parser."""
    config = models.get_model(db, name)
    cmd = preview_command(config, models.profile_of(db, config), settings)
    shown_env = (
        cmd.env
        if is_authorized(request, db, settings)
        else {k: (HIDDEN if k in config.env else v) for k, v in cmd.env.items()}
    )
    body = {"argv": cmd.argv, "env": shown_env, "notes": cmd.notes}
    if not validate:
        return {**body, "validation": {"status": "skipped", "message": "not asked for"}}
    result = await run_in_threadpool(
        validate_engine_argv, settings.engine_python, cmd.engine_argv, cmd.env, settings.validation_timeout_s
    )
    if result.status == "rejected":
        raise Invalid(
            f"vLLM {result.vllm_version or ''} rejects this command: {result.message}".replace("  ", " "),
            argv=cmd.argv,
            vllm_message=result.message,
        )
    return {**body, "validation": result.__dict__}
