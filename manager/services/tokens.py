"""API tokens: created once, stored as a SHA-256 hash, checked in constant time."""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Iterable

from sqlmodel import Session, select

from manager.schemas.token import ApiToken


def digest(secret: str) -> str:
    """The SHA-256 hex digest a token or an inference key is stored as."""
    return hashlib.sha256(secret.encode()).hexdigest()


def matches(token: str, env_token: str | None, stored_digests: Iterable[str]) -> bool:
    """Whether ``token`` is the environment's token or one of the stored ones (constant-time compares)."""
    if env_token and hmac.compare_digest(token.encode(), env_token.encode()):
        return True
    given = digest(token)
    return any(hmac.compare_digest(given, stored) for stored in stored_digests)


def create_token(db: Session, name: str = "default") -> str:
    token = "vmt_" + secrets.token_urlsafe(32)
    db.add(ApiToken(name=name, sha256=digest(token)))
    db.commit()
    return token


def stored_token_count(db: Session) -> int:
    return len(db.exec(select(ApiToken.id)).all())


def auth_required(db: Session, env_token: str | None) -> bool:
    return bool(env_token) or stored_token_count(db) > 0


def token_is_valid(db: Session, token: str, env_token: str | None) -> bool:
    return matches(token, env_token, db.exec(select(ApiToken.sha256)))


def digest_if_valid(db: Session, token: str, env_token: str | None) -> str | None:
    """The digest that stands for this token in a browser session, or None when it is not valid."""
    return digest(token) if token_is_valid(db, token, env_token) else None


def valid_digests(db: Session, env_token: str | None) -> list[str]:
    """The digests of every token that is valid now: the environment's and the stored ones."""
    digests = list(db.exec(select(ApiToken.sha256)))
    return [digest(env_token), *digests] if env_token else digests
