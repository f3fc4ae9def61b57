"""API tokens: created once, stored as a SHA-256 hash, checked in constant time; revoked or rotated,
they take the browser sessions they made with them."""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Iterable

from sqlmodel import Session, col, select

from manager.auth import sessions
from manager.errors import Conflict, NotFound
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


def digest_is_valid(db: Session, token_digest: str, env_token: str | None) -> bool:
    """Whether the token with this digest is valid now (a browser session's token): one index lookup."""
    if env_token and hmac.compare_digest(token_digest.encode(), digest(env_token).encode()):
        return True
    return db.exec(select(ApiToken.id).where(ApiToken.sha256 == token_digest)).first() is not None


def list_tokens(db: Session) -> list[ApiToken]:
    return list(db.exec(select(ApiToken).order_by(col(ApiToken.id))))


def names_by_digest(db: Session) -> dict[str, str]:
    return {t.sha256: t.name for t in list_tokens(db)}


def find_token(db: Session, which: str) -> ApiToken:
    """A stored token by its id (``token list``) or its name, when only one has it."""
    if which.isascii() and which.isdigit() and len(which) < 19:
        found = db.get(ApiToken, int(which))
        if found is not None:
            return found
    named = list(db.exec(select(ApiToken).where(ApiToken.name == which)))
    if len(named) > 1:
        ids = ", ".join(str(t.id) for t in named)
        raise Conflict(f"{len(named)} tokens are named {which!r} (ids {ids}): name one by its id")
    if not named:
        raise NotFound(f"no stored token with the id or name {which!r} (`vllm-manager token list` shows them)")
    return named[0]


def revoke_token(db: Session, which: str, last: bool = False) -> tuple[ApiToken, int]:
    """Delete a stored token; every browser session it made ends with it. The last stored token is
    kept unless ``last``: without any token the manager is open to anyone who reaches it. Returns the
    token and how many sessions ended."""
    token = find_token(db, which)
    if not last and stored_token_count(db) == 1:
        raise Conflict(
            f"{token.name!r} is the last stored token: without it the manager needs no token at all (unless "
            "VLLM_MANAGER_API_TOKEN is set where it runs). Rotate it instead (`vllm-manager token rotate "
            f"{token.id}`), or pass --last to revoke it anyway"
        )
    ended = sessions.end_made_with(db, token.sha256)
    db.delete(token)
    db.commit()
    return token, ended


def rotate_token(db: Session, which: str) -> tuple[str, ApiToken, int]:
    """A new token in place of a stored one, under the same name, in one commit: the old one stops
    working and its browser sessions end. Returns the new token itself (shown once), the old token's
    record and how many sessions ended."""
    old = find_token(db, which)
    token = "vmt_" + secrets.token_urlsafe(32)
    ended = sessions.end_made_with(db, old.sha256)
    db.delete(old)
    db.add(ApiToken(name=old.name, sha256=digest(token)))
    db.commit()
    return token, old, ended
