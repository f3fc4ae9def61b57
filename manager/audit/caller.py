"""Who asked for a change, noted on the request while it is served: the token check names the token or
the browser session, the login page the session it made, and the trail writes the note with the row.

A note exists only on requests the trail records (writes), so a read costs nothing here.
"""

from __future__ import annotations

import hmac
from collections.abc import MutableMapping
from dataclasses import dataclass, field
from typing import Any

from sqlmodel import Session, select

from manager.schemas.audit import ANONYMOUS, ENV_TOKEN, UNAUTHENTICATED
from manager.schemas.browser_session import BrowserSession
from manager.schemas.token import ApiToken
from manager.services.tokens import digest

NOTE = "vllm_manager.audit"  # the key of the note in the request's ASGI scope


@dataclass
class Note:
    who: str = UNAUTHENTICATED
    token: str | None = None  # the admin token behind ``who``: token:<id> or env-token
    token_name: str | None = None
    message: str | None = None  # what went wrong, where the answer is a page rather than an error body
    # A change a page refused while answering 200 (htmx swaps only those): the status the API answers it with.
    refused_status: int | None = None
    changed: set[str] = field(default_factory=set)  # stored fields whose value it changed (manager.audit.changes)


def note_of(scope: MutableMapping[str, Any]) -> Note | None:
    note = scope.get(NOTE)
    return note if isinstance(note, Note) else None


def anonymous(scope: MutableMapping[str, Any]) -> None:
    """No token is configured: whoever reaches the manager may change it."""
    note = note_of(scope)
    if note is not None:
        note.who = ANONYMOUS


def by_token(scope: MutableMapping[str, Any], db: Session, secret: str, env_token: str | None) -> None:
    """The call came with this valid bearer token."""
    note = note_of(scope)
    if note is not None:
        note.token, note.token_name = token_behind(db, digest(secret), env_token)
        note.who = note.token or UNAUTHENTICATED


def by_session(scope: MutableMapping[str, Any], db: Session, row: BrowserSession, env_token: str | None) -> None:
    """The call came with this browser session's cookie (or made it, at the login page)."""
    note = note_of(scope)
    if note is not None:
        note.who = f"session:{row.id}"
        note.token, note.token_name = token_behind(db, row.token_sha256, env_token)


def failed(scope: MutableMapping[str, Any], message: str) -> None:
    note = note_of(scope)
    if note is not None:
        note.message = message


def token_behind(db: Session, token_digest: str, env_token: str | None) -> tuple[str | None, str | None]:
    """The token with this digest, as the audit log names it (its id, never the token), and its name."""
    if env_token and hmac.compare_digest(token_digest, digest(env_token)):
        return ENV_TOKEN, None
    stored = db.exec(select(ApiToken).where(ApiToken.sha256 == token_digest)).first()
    if stored is None:
        return None, None
    return f"token:{stored.id}", stored.name
