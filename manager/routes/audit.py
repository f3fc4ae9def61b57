"""The audit log of admin changes, newest first, with filters. HTTP only; it needs the admin token even
where reads are open (VLLM_MANAGER_OPEN_READS): it says who changed what, from where."""

from __future__ import annotations

import re
from datetime import datetime
from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Query
from pydantic import BeforeValidator

from manager.audit import store
from manager.deps import SessionDep, require_token
from manager.openapi import errors
from manager.schemas.audit import AuditPage
from manager.schemas.common import MAX_SHORT

router = APIRouter(prefix="/api", tags=["audit log"], dependencies=[Depends(require_token)])


def _iso_date(value: object) -> object:
    # pydantic would also read a bare number as seconds since 1970; the schema promises ISO 8601 only.
    if isinstance(value, str) and not re.match(r"^\d{4}-\d{2}-\d{2}", value):
        raise ValueError(f"must be an ISO 8601 date and time such as 2026-11-23T10:00:00Z, got {value!r}")
    return value


Since = Annotated[
    datetime | None, BeforeValidator(_iso_date), Query(description="From (ISO 8601, UTC unless it names a zone)")
]
Until = Annotated[datetime | None, BeforeValidator(_iso_date), Query(description="Until (ISO 8601)")]
Who = Annotated[
    str | None,
    Query(
        max_length=MAX_SHORT,
        description="token:<id> (its calls and its sessions'), session:<id>, env-token, cli, anonymous or "
        "unauthenticated",
    ),
]
Action = Annotated[
    str | None, Query(max_length=MAX_SHORT, description="An action (workers.stop), or a resource (workers)")
]
Outcome = Annotated[Literal["ok", "failed"] | None, Query(description="ok: answered below 400; failed: 400 or more")]
Limit = Annotated[int, Query(ge=1, le=store.MAX_LIMIT, description="The most rows to send")]


@router.get("/audit", responses=errors(422))
def read_audit(
    db: SessionDep,
    since: Since = None,
    until: Until = None,
    who: Who = None,
    action: Action = None,
    outcome: Outcome = None,
    limit: Limit = store.DEFAULT_LIMIT,
) -> AuditPage:
    """Who changed what, from where, and what came of it: every write to this API and the dashboard's
    forms, logging in and out, and the CLI's token commands. Never a secret: only the names of the fields
    a request sent, and error messages with secret values hidden."""
    filters = store.Filters(since=since, until=until, who=who, action=action, outcome=outcome, limit=limit)
    return store.find(db, filters)
