"""HTTP guards the whole app shares, as plain ASGI middleware (they see every request, pages and API)."""

from __future__ import annotations

from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send


def _size(n: int) -> str:
    return f"{n / 1024**2:g} MiB" if n >= 1024**2 else f"{n / 1024:g} KiB"


class BodyLimit:
    """A request body over its limit is a 413, decided from Content-Length before anything is read, or
    while a body without one streams in. ``by_path`` gives some paths (the import) a limit of their own."""

    def __init__(self, app: ASGIApp, default: int, by_path: dict[str, tuple[int, str]] | None = None) -> None:
        self.app = app
        self.default = default
        self.by_path = by_path or {}

    def _limit(self, path: str) -> tuple[int, str]:
        return self.by_path.get(path, (self.default, "VLLM_MANAGER_MAX_BODY_BYTES"))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit, setting = self._limit(scope["path"])
        too_large = HTTPException(
            413, f"the request body is larger than {_size(limit)}, the most this manager takes here ({setting})"
        )
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await JSONResponse({"detail": too_large.detail}, 413)(scope, receive, send)
            return
        received = 0

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    # FastAPI re-raises an HTTPException met while it reads the body; the app's
                    # exception handling turns it into the JSON 413.
                    raise too_large
            return message

        await self.app(scope, counted, send)
