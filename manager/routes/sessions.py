"""Browser sessions from the login page, for the admin: who is logged in, and ending sessions. HTTP only."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Response

from manager.auth import sessions
from manager.deps import MAX_ROW_ID, SessionDep
from manager.openapi import errors
from manager.schemas.browser_session import BrowserSessionPublic, SessionsEnded
from manager.schemas.common import utcnow
from manager.services import tokens

router = APIRouter(prefix="/api", tags=["browser sessions"])

SessionId = Annotated[int, Path(ge=1, le=MAX_ROW_ID, description="The session's id")]


@router.get("/sessions")
def list_sessions(db: SessionDep) -> list[BrowserSessionPublic]:
    """Sessions not yet expired, the most recently used first: which token logged in, from where, with
    which browser. Never the session's secret."""
    names = tokens.names_by_digest(db)
    return [sessions.to_public(row, names) for row in sessions.live(db, utcnow())]


@router.delete("/sessions/{session_id}", status_code=204, responses=errors(404))
def end_session(session_id: SessionId, db: SessionDep) -> Response:
    """End one session: its browser must log in again."""
    sessions.end_by_id(db, session_id)
    return Response(status_code=204)


@router.delete("/sessions")
def end_all_sessions(db: SessionDep) -> SessionsEnded:
    """End every session, this browser's included."""
    return SessionsEnded(ended=sessions.end_all(db))
