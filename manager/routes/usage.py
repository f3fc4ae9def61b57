"""Usage of /v1: requests and tokens per minute, hour or day, inference key and model config. HTTP only."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from fastapi import APIRouter, Query

from manager.deps import SessionDep, UsageRecorderDep
from manager.schemas.common import MAX_NAME
from manager.services import usage

router = APIRouter(prefix="/api", tags=["usage"])

Since = Annotated[
    datetime | None, Query(description="Start (ISO 8601, UTC unless it names a zone); default: a span that suits per")
]
Until = Annotated[datetime | None, Query(description="End (ISO 8601); default: now")]
Bucket = Annotated[
    usage.Per, Query(description="Bucket size; a report covers at most 1 (minute), 31 (hour) or 366 (day) days")
]
Model = Annotated[str | None, Query(max_length=MAX_NAME, description="Only this model config")]
Key = Annotated[str | None, Query(max_length=MAX_NAME, description="Only this key's name; '-': requests without a key")]


@router.get("/usage")
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
