from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse

from manager.deps import SessionDep, SettingsDep
from manager.services import transfer

router = APIRouter(prefix="/api", tags=["export and import"])


@router.get("/export", response_class=PlainTextResponse)
def export_all(db: SessionDep) -> PlainTextResponse:
    return PlainTextResponse(
        transfer.export_yaml(db),
        media_type="application/yaml",
        headers={"Content-Disposition": 'attachment; filename="vllm-manager-export.yaml"'},
    )


@router.post("/import")
async def import_all(request: Request, db: SessionDep, settings: SettingsDep, overwrite: bool = True) -> dict:
    """Body: the YAML (or JSON) that GET /api/export produced."""
    data = transfer.parse_yaml((await request.body()).decode("utf-8", errors="replace"))
    return transfer.import_data(db, data, overwrite=overwrite, allow_code_flags=settings.allow_code_flags)
