from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import PlainTextResponse

from manager.deps import SessionDep, SettingsDep, is_authorized
from manager.errors import Unauthorized, UnsupportedMediaType
from manager.services import transfer

router = APIRouter(prefix="/api", tags=["export and import"])


IMPORT_TYPES = ("application/yaml", "application/x-yaml", "text/yaml", "text/x-yaml", "application/json")


@router.get("/export", response_class=PlainTextResponse)
def export_all(request: Request, db: SessionDep, settings: SettingsDep) -> PlainTextResponse:
    """Every config and profile, secrets (environment values) included: needs the token once one exists."""
    if not is_authorized(request, db, settings):
        raise Unauthorized("the export holds environment values: send 'Authorization: Bearer <token>'")
    return PlainTextResponse(
        transfer.export_yaml(db),
        media_type="application/yaml",
        headers={"Content-Disposition": 'attachment; filename="vllm-manager-export.yaml"'},
    )


@router.post("/import")
async def import_all(request: Request, db: SessionDep, settings: SettingsDep, overwrite: bool = True) -> dict:
    """Body: the YAML (or JSON) that GET /api/export produced, sent as application/yaml or application/json."""
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type not in IMPORT_TYPES:
        raise UnsupportedMediaType(f"send the file as one of {', '.join(IMPORT_TYPES)} (got {content_type or 'none'})")
    body = await request.body()  # at most VLLM_MANAGER_MAX_IMPORT_BYTES (manager.middleware.BodyLimit)
    # Off the event loop: parsing megabytes of YAML takes seconds, and health checks, live streams and
    # worker supervision must not wait for it.
    return await run_in_threadpool(
        transfer.import_file, db, body, overwrite=overwrite, allow_code_flags=settings.allow_code_flags
    )
