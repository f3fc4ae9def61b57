"""Browser sessions: what the login page gives a browser instead of keeping the API token in it.

The cookie holds ``<id>.<secret>``, a random secret the manager made; the store keeps, per session,
a SHA-256 digest of that secret and of the token that logged in, when it was made, when it ends,
when it was last used, and the address and User-Agent it logged in from (never the secret or the
token). A session ends at its expiry, when its browser logs out, when the admin ends it
(``vllm-manager sessions revoke``), or when its token is revoked, rotated, or (VLLM_MANAGER_API_TOKEN)
changed. Checking a cookie is one primary-key lookup; ended and expired rows are deleted.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Mapping
from datetime import datetime, timedelta

from sqlmodel import Session, col, delete, func, select

from manager.errors import ManagerError, NotFound
from manager.schemas.browser_session import MAX_USER_AGENT, BrowserSession, BrowserSessionPublic

SESSION_LIFETIME = timedelta(days=7)
# How stale a session's last-seen time may get: writing it on every request would make each page
# and API call a database write.
LAST_SEEN_EVERY = timedelta(minutes=1)
# Sessions kept at most; past this the least recently used go first. Only token holders make them.
MAX_SESSIONS = 1000
MAX_ADDRESS = 64
MAX_ID_DIGITS = 19  # SQLite's INTEGER: a longer id is no session's


def start(db: Session, token_digest: str, address: str, user_agent: str, now: datetime) -> str:
    """A new session for whoever showed the token with this digest; the cookie's value."""
    remove_expired(db, now)
    secret = secrets.token_urlsafe(32)
    row = BrowserSession(
        secret_sha256=_digest(secret),
        token_sha256=token_digest,
        created_at=now,
        expires_at=now + SESSION_LIFETIME,
        last_seen_at=now,
        client_address=address[:MAX_ADDRESS],
        user_agent=user_agent[:MAX_USER_AGENT],
    )
    db.add(row)
    db.flush()  # its id, for the cookie
    _keep_at_most(db, MAX_SESSIONS)
    db.commit()
    return f"{row.id}.{secret}"


def find(db: Session, value: str, now: datetime) -> BrowserSession | None:
    """The live session a cookie value stands for, or None; an expired one is deleted on the way."""
    row = _row_of(db, value)
    if row is None:
        return None
    if row.expires_at <= now:
        db.delete(row)
        _commit_if_it_can(db)
        return None
    if now - row.last_seen_at >= LAST_SEEN_EVERY:
        row.last_seen_at = now
        db.add(row)
        _commit_if_it_can(db)
    return row


def end(db: Session, value: str) -> bool:
    """Log out: the session this cookie value stands for ends (False when there was none)."""
    row = _row_of(db, value)
    if row is None:
        return False
    _delete(db, row)
    return True


def end_by_id(db: Session, session_id: int) -> None:
    """The admin ends one session (NotFound when no session has this id)."""
    row = db.get(BrowserSession, session_id)
    if row is None:
        raise NotFound(f"no browser session with id {session_id} (`vllm-manager sessions list` shows them)")
    db.delete(row)
    db.commit()


def end_all(db: Session) -> int:
    """Every session ends; how many there were."""
    ended = _count(db)
    db.exec(delete(BrowserSession))
    db.commit()
    return ended


def end_made_with(db: Session, token_digest: str) -> int:
    """Every session the token with this digest made ends (the caller commits); how many."""
    where = col(BrowserSession.token_sha256) == token_digest
    ended = db.exec(select(func.count()).select_from(BrowserSession).where(where)).one()
    db.exec(delete(BrowserSession).where(where))
    return int(ended)


def end_unless_made_with(db: Session, token_digests: list[str]) -> int:
    """Every session whose token is not among these ends: at start, after VLLM_MANAGER_API_TOKEN
    changed or a token was deleted by other means. How many ended."""
    where = col(BrowserSession.token_sha256).not_in(token_digests)
    ended = db.exec(select(func.count()).select_from(BrowserSession).where(where)).one()
    db.exec(delete(BrowserSession).where(where))
    db.commit()
    return int(ended)


def remove_expired(db: Session, now: datetime) -> None:
    """Expired sessions are deleted (the caller commits)."""
    db.exec(delete(BrowserSession).where(col(BrowserSession.expires_at) <= now))


def live(db: Session, now: datetime) -> list[BrowserSession]:
    """The sessions not yet expired, the most recently used first."""
    query = select(BrowserSession).where(col(BrowserSession.expires_at) > now)
    return list(db.exec(query.order_by(col(BrowserSession.last_seen_at).desc(), col(BrowserSession.id).desc())))


def ends_at(row: BrowserSession) -> datetime:
    return row.expires_at


def to_public(row: BrowserSession, token_names: Mapping[str, str]) -> BrowserSessionPublic:
    """``token_names``: the stored tokens' names by digest; a session of no stored token was made with
    VLLM_MANAGER_API_TOKEN."""
    assert row.id is not None
    return BrowserSessionPublic(
        id=row.id,
        token=token_names.get(row.token_sha256, "VLLM_MANAGER_API_TOKEN"),
        client_address=row.client_address,
        user_agent=row.user_agent,
        created_at=row.created_at,
        last_seen_at=row.last_seen_at,
        expires_at=row.expires_at,
    )


def _row_of(db: Session, value: str) -> BrowserSession | None:
    session_id, _, secret = value.partition(".")
    if not session_id.isascii() or not session_id.isdigit() or len(session_id) > MAX_ID_DIGITS or not secret:
        return None
    row = db.get(BrowserSession, int(session_id))
    given = _digest(secret).encode()
    if row is None or not hmac.compare_digest(given, row.secret_sha256.encode()):
        return None
    return row


def _digest(secret: str) -> str:
    return hashlib.sha256(secret.encode("utf-8", "replace")).hexdigest()  # a cookie may hold any character


def _delete(db: Session, row: BrowserSession) -> None:
    db.delete(row)
    db.commit()


def _commit_if_it_can(db: Session) -> None:
    """A last-seen time or an expired row that cannot be written now (the database busy) does not
    refuse the request: the one is written, the other deleted, on a later one."""
    try:
        db.commit()
    except ManagerError:
        db.rollback()


def _count(db: Session) -> int:
    return int(db.exec(select(func.count()).select_from(BrowserSession)).one())


def _keep_at_most(db: Session, limit: int) -> None:
    over = _count(db) - limit
    if over > 0:
        oldest = select(BrowserSession.id).order_by(col(BrowserSession.last_seen_at), col(BrowserSession.id))
        db.exec(delete(BrowserSession).where(col(BrowserSession.id).in_(oldest.limit(over).scalar_subquery())))
