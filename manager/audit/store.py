"""The audit table: rows written once and never changed, read newest first with filters, deleted once
older than the retention (VLLM_MANAGER_AUDIT_RETENTION_DAYS)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from sqlalchemy import or_
from sqlmodel import Session, col, delete, select

from manager.errors import Invalid
from manager.schemas.audit import MAX_MESSAGE, AuditEntry, AuditEntryPublic, AuditPage

DEFAULT_LIMIT = 100
MAX_LIMIT = 1000
OUTCOMES = ("ok", "failed")


@dataclass(frozen=True)
class Filters:
    since: datetime | None = None
    until: datetime | None = None
    who: str | None = None  # token:3 (its calls and its sessions'), session:7, cli, anonymous, ...
    action: str | None = None  # workers.stop, or workers for every action on workers
    outcome: str | None = None  # ok or failed
    limit: int = DEFAULT_LIMIT


def add(db: Session, entry: AuditEntry) -> None:
    if entry.message is not None:
        entry.message = entry.message[:MAX_MESSAGE]
    db.add(entry)
    db.commit()


def find(db: Session, filters: Filters) -> AuditPage:
    """The rows that match, newest first, at most ``limit`` of them."""
    if not 1 <= filters.limit <= MAX_LIMIT:
        raise Invalid(f"limit must be between 1 and {MAX_LIMIT}, got {filters.limit}", field="limit")
    if filters.outcome is not None and filters.outcome not in OUTCOMES:
        raise Invalid(f"outcome must be ok or failed, got {filters.outcome!r}", field="outcome")
    since, until = _utc(filters.since), _utc(filters.until)
    if since and until and since > until:
        raise Invalid("since must be before until", field="since")
    query = select(AuditEntry)
    if since is not None:
        query = query.where(col(AuditEntry.at) >= since)
    if until is not None:
        query = query.where(col(AuditEntry.at) <= until)
    if filters.who:
        query = query.where(
            or_(
                col(AuditEntry.who) == filters.who,
                col(AuditEntry.token) == filters.who,
                col(AuditEntry.who).startswith(filters.who + ":", autoescape=True),
            )
        )
    if filters.action:
        query = query.where(
            or_(
                col(AuditEntry.action) == filters.action,
                col(AuditEntry.action).startswith(filters.action + ".", autoescape=True),
            )
        )
    if filters.outcome == "ok":
        query = query.where(col(AuditEntry.status) < 400)
    elif filters.outcome == "failed":
        query = query.where(col(AuditEntry.status) >= 400)
    query = query.order_by(col(AuditEntry.at).desc(), col(AuditEntry.id).desc()).limit(filters.limit + 1)
    rows = list(db.exec(query))
    return AuditPage(entries=[to_public(r) for r in rows[: filters.limit]], more=len(rows) > filters.limit)


def remove_older_than(db: Session, days: float, now: datetime) -> int:
    """Delete the rows older than ``days``; how many went."""
    cutoff = now - timedelta(days=days)
    result = db.exec(delete(AuditEntry).where(col(AuditEntry.at) < cutoff))
    db.commit()
    return result.rowcount or 0


def to_public(row: AuditEntry) -> AuditEntryPublic:
    assert row.id is not None
    return AuditEntryPublic(
        id=row.id,
        at=row.at.replace(tzinfo=UTC) if row.at.tzinfo is None else row.at,
        who=row.who,
        token=row.token,
        token_name=row.token_name,
        address=row.address,
        method=row.method,
        route=row.route,
        action=row.action,
        target=row.target,
        fields=list(row.fields),
        changed=list(row.changed),
        status=row.status,
        outcome="ok" if row.status < 400 else "failed",
        message=row.message,
    )


def _utc(when: datetime | None) -> datetime | None:
    if when is None:
        return None
    return when.replace(tzinfo=UTC) if when.tzinfo is None else when.astimezone(UTC)
