from fastapi import APIRouter, Request, Response
from fastapi.concurrency import run_in_threadpool

from manager.deps import SessionDep, SettingsDep, SupervisorDep, is_authorized
from manager.errors import Invalid
from manager.launch.command import preview_command
from manager.launch.secrets import Redactor, without_secrets
from manager.launch.validation import validate_engine_argv
from manager.openapi import errors
from manager.schemas.model_config import ModelConfigCreate, ModelConfigPublic, ModelConfigUpdate
from manager.services import models

router = APIRouter(prefix="/api/models", tags=["model configs"])


def _shown(request: Request, db, settings, public: ModelConfigPublic) -> ModelConfigPublic:
    """Environment values and credential flags (HF_TOKEN, --api-key): once a token exists, only its
    holders see them; the others see a marker, which a PUT may send back to keep the stored value."""
    return public if is_authorized(request, db, settings) else without_secrets(public)


@router.get("", response_model=list[ModelConfigPublic])
def list_models(request: Request, db: SessionDep, settings: SettingsDep):
    return [_shown(request, db, settings, models.to_public(db, m)) for m in models.list_models(db)]


@router.post(
    "",
    response_model=ModelConfigPublic,
    status_code=201,
    responses=errors(404, 409, 422, _404="No offload profile of that name", _422="Also: a node the Ray cluster lacks"),
)
def create_model(data: ModelConfigCreate, db: SessionDep, settings: SettingsDep, supervisor: SupervisorDep):
    config = models.create_model(db, data, rules=models.WriteRules.of(settings), check_node=supervisor.check_node)
    return models.to_public(db, config)


@router.get("/{name}", response_model=ModelConfigPublic, responses=errors(404))
def get_model(name: str, request: Request, db: SessionDep, settings: SettingsDep):
    return _shown(request, db, settings, models.to_public(db, models.get_model(db, name)))


@router.put("/{name}", response_model=ModelConfigPublic, responses=errors(404, 409, 422))
def replace_model(name: str, data: ModelConfigUpdate, db: SessionDep, settings: SettingsDep, supervisor: SupervisorDep):
    config = models.replace_model(
        db, name, data, rules=models.WriteRules.of(settings), check_node=supervisor.check_node
    )
    return models.to_public(db, config)


@router.delete("/{name}", status_code=204, responses=errors(404, 409))
def delete_model(name: str, db: SessionDep) -> Response:
    models.delete_model(db, name)
    return Response(status_code=204)


@router.get("/{name}/command", responses=errors(404, 422, _422="vLLM's parser rejects the command"))
async def command(
    name: str,
    request: Request,
    db: SessionDep,
    settings: SettingsDep,
    supervisor: SupervisorDep,
    validate: bool = True,
) -> dict:
    """The argv and environment this config launches, checked by the engine's own vLLM parser."""
    config = models.get_model(db, name)
    cmd = preview_command(config, models.profile_of(db, config), settings, supervisor.fetcher)
    secrets = Redactor.of_config(config)
    authorized = is_authorized(request, db, settings)
    shown = cmd if authorized else secrets.command(cmd)
    body = {"argv": shown.argv, "env": shown.env, "notes": shown.notes}
    if not validate:
        return {**body, "validation": {"status": "skipped", "message": "not asked for"}}
    result = await run_in_threadpool(
        validate_engine_argv, settings.engine_python, cmd.engine_argv, cmd.env, settings.validation_timeout_s
    )
    message = result.message if authorized else secrets.text(result.message)
    if result.status == "rejected":
        raise Invalid(
            f"vLLM {result.vllm_version or ''} rejects this command: {message}".replace("  ", " "),
            argv=shown.argv,
            vllm_message=message,
        )
    return {**body, "validation": {**result.__dict__, "message": message}}
