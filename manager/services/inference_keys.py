"""Inference API keys: made once ("vmk_..."), stored as a SHA-256 hash, found by that hash.

``active_digests`` is what /v1 checks keys against (manager.frontdoor.access keeps it until the next
commit). ``allowed_models`` is what a key may use: the names of model configs, or None for all.
Once a key has been made, /v1 needs one until the admin opens it again (``open_without_keys``), so
that revoking the last key does not quietly let everyone in.
"""

from __future__ import annotations

import secrets
from datetime import UTC, datetime

from sqlmodel import Session, col, select

from manager.db import commit_or_conflict
from manager.errors import Conflict, Invalid, NotFound
from manager.schemas.common import utcnow
from manager.schemas.inference_key import (
    LIMIT_FIELDS,
    PREFIX_CHARS,
    InferenceAccess,
    InferenceAccessPublic,
    InferenceKey,
    InferenceKeyCreate,
    InferenceKeyCreated,
    InferenceKeyPublic,
    KeyLimitsUpdate,
)
from manager.schemas.model_config import ModelConfig
from manager.services import tokens

KEY_START = "vmk_"


def create_key(db: Session, data: InferenceKeyCreate) -> InferenceKeyCreated:
    """Make a key; the answer holds the key itself, which is not stored and cannot be shown again."""
    taken = f"an active key named {data.name!r} exists: revoke it first, or choose another name"
    if _active(db, data.name) is not None:
        raise Conflict(taken)
    configs = set(db.exec(select(ModelConfig.name)))
    unknown = [m for m in data.models if m not in configs]
    if unknown:
        existing = ", ".join(sorted(configs)) or "none yet"
        raise Invalid(
            f"no model config named {', '.join(repr(m) for m in unknown)}; a key names model configs "
            f"(their aliases and LoRA adapters come with them). Model configs: {existing}",
            field="models",
        )
    secret = KEY_START + secrets.token_urlsafe(32)
    key = InferenceKey(
        name=data.name,
        sha256=tokens.digest(secret),
        prefix=secret[:PREFIX_CHARS],
        models=list(data.models),
        **data.model_dump(include=set(LIMIT_FIELDS)),
    )
    db.add(key)
    _set_open_without_keys(db, False)  # a new key closes /v1 to callers without one
    commit_or_conflict(db, taken)
    db.refresh(key)
    return InferenceKeyCreated(**to_public(key).model_dump(), key=secret)


def list_keys(db: Session, include_revoked: bool = True) -> list[InferenceKey]:
    """Active keys by name, then revoked ones, newest revocation first."""
    keys = list(db.exec(select(InferenceKey).order_by(InferenceKey.name, col(InferenceKey.id).desc())))
    active = [k for k in keys if k.revoked_at is None]
    revoked = sorted((k for k in keys if k.revoked_at is not None), key=lambda k: k.revoked_at or k.created_at)
    return active + (revoked[::-1] if include_revoked else [])


def revoke_key(db: Session, name: str) -> InferenceKey:
    """From now on the key is refused; its usage stays counted under its name."""
    key = _active(db, name)
    if key is None:
        raise NotFound(f"no active inference key named {name!r}")
    key.revoked_at = utcnow()
    db.add(key)
    db.commit()
    db.refresh(key)
    return key


def set_limits(db: Session, name: str, data: KeyLimitsUpdate) -> InferenceKey:
    """Change the limits sent (null: no limit) of the active key of this name; the others stay."""
    key = _active(db, name)
    if key is None:
        raise NotFound(f"no active inference key named {name!r}")
    for field, value in data.model_dump(include=data.model_fields_set).items():
        setattr(key, field, value)
    db.add(key)
    db.commit()
    db.refresh(key)
    return key


def active_keys(db: Session) -> list[InferenceKey]:
    """Every active key: what /v1's check needs (its digest, models and limits)."""
    return list(db.exec(select(InferenceKey).where(col(InferenceKey.revoked_at).is_(None))))


def revoked_digests(db: Session) -> list[str]:
    """The SHA-256 digests of the revoked keys: /v1 refuses them by name, even where it is open."""
    return list(db.exec(select(InferenceKey.sha256).where(col(InferenceKey.revoked_at).is_not(None))))


def any_active(db: Session) -> bool:
    return db.exec(select(InferenceKey.id).where(col(InferenceKey.revoked_at).is_(None)).limit(1)).first() is not None


def closed_by_revoked_keys(db: Session) -> bool:
    """Whether /v1 needs a key although none is active: keys were made, and the admin has not opened
    /v1 again since the last was revoked."""
    if db.exec(select(InferenceKey.id).limit(1)).first() is None:
        return False
    access = db.get(InferenceAccess, 1)
    return access is None or not access.open_without_keys


def needs_key(db: Session) -> bool:
    """Whether /v1 takes only an inference key (or the admin token), on any bind."""
    return any_active(db) or closed_by_revoked_keys(db)


def open_without_keys(db: Session) -> InferenceAccessPublic:
    """/v1 back to how it was before any key: open on a loopback bind (or with
    VLLM_MANAGER_OPEN_INFERENCE), the admin token elsewhere. Conflict while a key is active."""
    active = [k.name for k in list_keys(db, include_revoked=False)]
    if active:
        raise Conflict(
            f"active inference keys exist ({', '.join(active)}): /v1 takes only them (or the admin token) while "
            "any is active. Revoke them first (`vllm-manager keys revoke NAME`), then open /v1"
        )
    _set_open_without_keys(db, True)
    db.commit()
    return access_now(db)


def access_now(db: Session) -> InferenceAccessPublic:
    if any_active(db):
        return InferenceAccessPublic(needs_key=True, message="/v1 needs one of the active inference keys")
    if closed_by_revoked_keys(db):
        return InferenceAccessPublic(
            needs_key=True,
            message="/v1 needs an inference key: every key was revoked, and /v1 stays closed until a new key is "
            "made or it is opened (`vllm-manager keys open-v1`)",
        )
    return InferenceAccessPublic(
        needs_key=False,
        message="/v1 needs no inference key: on a loopback bind anyone on this machine may use it; on a public "
        "bind it takes the admin token unless VLLM_MANAGER_OPEN_INFERENCE=1",
    )


def _set_open_without_keys(db: Session, value: bool) -> None:
    access = db.get(InferenceAccess, 1)
    if access is None:
        if not value:
            return  # no row: closed once a key exists
        access = InferenceAccess(id=1)
    elif access.open_without_keys == value:
        return
    access.open_without_keys = value
    access.changed_at = utcnow()
    db.add(access)


def names_by_id(db: Session) -> dict[int, str]:
    """Every key's name by its id, revoked ones included (usage keeps naming them)."""
    return {k.id: k.name for k in db.exec(select(InferenceKey)) if k.id is not None}


def mark_used(db: Session, last_used: dict[int, datetime]) -> None:
    """Note when each key was last used (the caller commits)."""
    for key_id, when in last_used.items():
        key = db.get(InferenceKey, key_id)
        if key is not None:
            key.last_used_at = when
            db.add(key)


def to_public(key: InferenceKey) -> InferenceKeyPublic:
    return InferenceKeyPublic(
        name=key.name,
        prefix=key.prefix,
        models=list(key.models),
        active=key.revoked_at is None,
        expired=is_expired(key, utcnow()),
        **{field: getattr(key, field) for field in LIMIT_FIELDS if field != "expires_at"},
        expires_at=_utc(key.expires_at) if key.expires_at else None,
        created_at=_utc(key.created_at),
        last_used_at=_utc(key.last_used_at) if key.last_used_at else None,
        revoked_at=_utc(key.revoked_at) if key.revoked_at else None,
    )


def is_expired(key: InferenceKey, now: datetime) -> bool:
    return key.expires_at is not None and _utc(key.expires_at) <= now


def _active(db: Session, name: str) -> InferenceKey | None:
    return db.exec(
        select(InferenceKey).where(InferenceKey.name == name, col(InferenceKey.revoked_at).is_(None))
    ).first()


def _utc(when: datetime) -> datetime:
    # SQLite keeps no zone: the stored times are UTC.
    return when if when.tzinfo else when.replace(tzinfo=UTC)
