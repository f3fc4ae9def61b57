from fastapi import APIRouter, Depends, Request, Response
from fastapi.concurrency import run_in_threadpool

from manager.deps import SessionDep, SettingsDep, require_token
from manager.errors import UnsupportedMediaType
from manager.openapi import errors
from manager.services import transfer
from manager.services.models import WriteRules

router = APIRouter(prefix="/api", tags=["export and import"])


IMPORT_TYPES = ("application/yaml", "application/x-yaml", "text/yaml", "text/x-yaml", "application/json")
EXPORT_FILE = {"$ref": "#/components/schemas/ExportFile"}


class YamlResponse(Response):
    media_type = "application/yaml"


@router.get(
    "/export",
    response_class=YamlResponse,
    dependencies=[Depends(require_token)],
    responses={200: {"description": "The export file", "content": {YamlResponse.media_type: {"schema": EXPORT_FILE}}}},
)
def export_all(db: SessionDep) -> YamlResponse:
    """Every config and profile, secrets (environment values) included: needs the token once one exists."""
    return YamlResponse(
        transfer.export_yaml(db),
        headers={"Content-Disposition": 'attachment; filename="vllm-manager-export.yaml"'},
    )


@router.post(
    "/import",
    responses=errors(409, 415, 422),
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {media_type: {"schema": EXPORT_FILE} for media_type in IMPORT_TYPES},
        }
    },
)
async def import_all(
    request: Request, db: SessionDep, settings: SettingsDep, overwrite: bool = True
) -> dict[str, list[str]]:
    """Body: the YAML (or JSON) that GET /api/export produced, sent as application/yaml or application/json."""
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type not in IMPORT_TYPES:
        raise UnsupportedMediaType(f"send the file as one of {', '.join(IMPORT_TYPES)} (got {content_type or 'none'})")
    body = await request.body()  # at most VLLM_MANAGER_MAX_IMPORT_BYTES (manager.middleware.BodyLimit)
    # Off the event loop: parsing megabytes of YAML takes seconds, and health checks, live streams and
    # worker supervision must not wait for it.
    return await run_in_threadpool(transfer.import_file, db, body, overwrite=overwrite, rules=WriteRules.of(settings))
