"""Usage of /v1: requests and tokens per minute, hour or day, inference key and model config. HTTP only."""

from __future__ import annotations

import re
from datetime import datetime
from typing import Annotated

from fastapi import APIRouter, Query
from pydantic import BeforeValidator

from manager.deps import SessionDep, UsageRecorderDep
from manager.openapi import errors
from manager.schemas.common import MAX_NAME
from manager.services import usage

router = APIRouter(prefix="/api", tags=["usage"])


def _iso_date(value: object) -> object:
    # pydantic would also read a bare number as seconds since 1970; the schema promises ISO 8601 only.
    if isinstance(value, str) and not re.match(r"^\d{4}-\d{2}-\d{2}", value):
        raise ValueError(f"must be an ISO 8601 date and time such as 2026-11-23T10:00:00Z, got {value!r}")
    return value


Since = Annotated[
    datetime | None,
    BeforeValidator(_iso_date),
    Query(description="Start (ISO 8601, UTC unless it names a zone); default: a span that suits per"),
]
Until = Annotated[datetime | None, BeforeValidator(_iso_date), Query(description="End (ISO 8601); default: now")]
Bucket = Annotated[
    usage.Per, Query(description="Bucket size; a report covers at most 1 (minute), 31 (hour) or 366 (day) days")
]
Model = Annotated[str | None, Query(max_length=MAX_NAME, description="Only this model config")]
Key = Annotated[str | None, Query(max_length=MAX_NAME, description="Only this key's name; '-': requests without a key")]


@router.get("/usage", responses=errors(404, 422))
async def get_usage(
    db: SessionDep,
    recorder: UsageRecorderDep,
    since: Since = None,
    until: Until = None,
    per: Bucket = "hour",
    model: Model = None,
    key: Key = None,
) -> usage.UsageReport:
    """Requests, errors and tokens through /v1 per minute, hour or day, key and model config."""
    await recorder.flush()  # what was counted in the last seconds too
    return usage.report(db, since=since, until=until, per=per, model=model, key=key)
