"""The API's description: the OpenAPI schema and the pages that show it.

Served as ordinary routes rather than FastAPI's built-in ones, so that the token rule covers them:
they are reads, open or closed as every other read is. Swagger UI and ReDoc load from the manager's
own /static/vendor, as the dashboard's libraries do: the pages work on a machine without internet.
"""

from fastapi import APIRouter, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse

router = APIRouter(include_in_schema=False)

OPENAPI_PATH = "/openapi.json"
VENDOR = "/static/vendor"


def _root(request: Request) -> str:
    return request.scope.get("root_path", "")


@router.get(OPENAPI_PATH)
def openapi(request: Request) -> JSONResponse:
    return JSONResponse(request.app.openapi())


@router.get("/docs")
def swagger_ui(request: Request) -> HTMLResponse:
    root = _root(request)
    return get_swagger_ui_html(
        openapi_url=root + OPENAPI_PATH,
        title=f"{request.app.title} - Swagger UI",
        swagger_js_url=f"{root}{VENDOR}/swagger-ui-bundle.js",
        swagger_css_url=f"{root}{VENDOR}/swagger-ui.css",
        swagger_favicon_url=f"{root}{VENDOR}/swagger-ui-favicon-32x32.png",
    )


@router.get("/redoc")
def redoc(request: Request) -> HTMLResponse:
    root = _root(request)
    return get_redoc_html(
        openapi_url=root + OPENAPI_PATH,
        title=f"{request.app.title} - ReDoc",
        redoc_js_url=f"{root}{VENDOR}/redoc.standalone.js",
        redoc_favicon_url=f"{root}{VENDOR}/swagger-ui-favicon-32x32.png",
        with_google_fonts=False,
    )
