"""The API's description: the OpenAPI schema and the pages that show it.

Served as ordinary routes rather than FastAPI's built-in ones, so that the token rule covers them:
they are reads, open or closed as every other read is.
"""

from fastapi import APIRouter, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse

router = APIRouter(include_in_schema=False)

OPENAPI_PATH = "/openapi.json"


@router.get(OPENAPI_PATH)
def openapi(request: Request) -> JSONResponse:
    return JSONResponse(request.app.openapi())


@router.get("/docs")
def swagger_ui(request: Request) -> HTMLResponse:
    url = request.scope.get("root_path", "") + OPENAPI_PATH
    return get_swagger_ui_html(openapi_url=url, title=f"{request.app.title} - Swagger UI")


@router.get("/redoc")
def redoc(request: Request) -> HTMLResponse:
    url = request.scope.get("root_path", "") + OPENAPI_PATH
    return get_redoc_html(openapi_url=url, title=f"{request.app.title} - ReDoc")
