"""FastAPI dependencies: the database session, the settings, and the token check."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, Request
from sqlmodel import Session

from manager.db import session as open_session
from manager.errors import Unauthorized
from manager.services import tokens
from manager.settings import Settings

SAFE_METHODS = {"GET", "HEAD", "OPTIONS"}


def get_settings(request: Request) -> Settings:
    return request.app.state.settings


def get_db(request: Request) -> Iterator[Session]:
    with open_session(request.app.state.engine) as db:
        yield db


SettingsDep = Annotated[Settings, Depends(get_settings)]
SessionDep = Annotated[Session, Depends(get_db)]


def require_token_for_changes(request: Request, db: SessionDep, settings: SettingsDep) -> None:
    """Once any token exists, every call that changes something must carry one."""
    if request.method in SAFE_METHODS:
        return
    if not tokens.auth_required(db, settings.env_token):
        return
    scheme, _, value = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not value:
        raise Unauthorized("this call changes state and needs 'Authorization: Bearer <token>'")
    if not tokens.token_is_valid(db, value.strip(), settings.env_token):
        raise Unauthorized("the bearer token is not valid")
