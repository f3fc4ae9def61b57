"""The usage table: requests and tokens through /v1 per minute, inference key and model config.

``add`` merges counted minutes into the table (a minute written in several parts adds up);
``report`` sums them per minute, hour or day over a bounded range, for the API, the page and the CLI.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Literal

from pydantic import BaseModel
from sqlalchemy import func
from sqlalchemy import select as select_columns
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlmodel import Session, col, select

from manager.errors import Invalid, NotFound
from manager.schemas.inference_key import InferenceKey
from manager.schemas.usage import NO_KEY, UsageMinute

Per = Literal["minute", "hour", "day"]
BUCKET_S: dict[str, int] = {"minute": 60, "hour": 3600, "day": 86400}
# The longest range one report covers, per bucket size; and the range asked when none is given.
MAX_RANGE = {"minute": timedelta(days=1), "hour": timedelta(days=31), "day": timedelta(days=366)}
DEFAULT_RANGE = {"minute": timedelta(hours=1), "hour": timedelta(days=1), "day": timedelta(days=30)}
NO_KEY_NAME = "-"  # the key filter for requests without an inference key


@dataclass
class Counts:
    requests: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def plus(self, other: Counts) -> Counts:
        return Counts(
            self.requests + other.requests,
            self.errors + other.errors,
            self.prompt_tokens + other.prompt_tokens,
            self.completion_tokens + other.completion_tokens,
        )


@dataclass(frozen=True)
class Row:
    minute: int
    key_id: int
    model: str
    counts: Counts


def add(db: Session, rows: Sequence[Row]) -> None:
    """Add these counts to the stored ones (the caller commits)."""
    table = UsageMinute.__table__
    # SQLite allows 32766 bound parameters per statement; 7 per row.
    for i in range(0, len(rows), 4000):
        stmt = sqlite_insert(table).values(
            [
                {
                    "minute": r.minute,
                    "key_id": r.key_id,
                    "model": r.model,
                    "requests": r.counts.requests,
                    "errors": r.counts.errors,
                    "prompt_tokens": r.counts.prompt_tokens,
                    "completion_tokens": r.counts.completion_tokens,
                }
                for r in rows[i : i + 4000]
            ]
        )
        new = stmt.excluded
        db.execute(
            stmt.on_conflict_do_update(
                index_elements=["minute", "key_id", "model"],
                set_={
                    name: table.c[name] + new[name]
                    for name in ("requests", "errors", "prompt_tokens", "completion_tokens")
                },
            )
        )


class UsageLine(BaseModel):
    start: datetime | None  # the bucket's start (UTC); None in totals
    key: str | None  # the inference key's name; None: no key (the admin token, or /v1 open)
    key_prefix: str | None
    model: str
    requests: int
    errors: int
    prompt_tokens: int
    completion_tokens: int


class UsageTotal(BaseModel):
    requests: int
    errors: int
    prompt_tokens: int
    completion_tokens: int


class UsageReport(BaseModel):
    since: datetime
    until: datetime
    per: Per
    rows: list[UsageLine]  # per bucket, key and model, oldest first
    totals: list[UsageLine]  # per key and model over the whole range
    total: UsageTotal


def window(since: datetime | None, until: datetime | None, per: str, now: datetime) -> tuple[datetime, datetime]:
    """The range a report covers: ``until`` defaults to now, ``since`` to a span that suits ``per``;
    a range longer than ``per`` allows is refused (422), saying what to ask instead."""
    if per not in BUCKET_S:
        raise Invalid(f"per must be minute, hour or day, not {per!r}", field="per")
    try:
        end = _utc(until) if until else now
        start = _utc(since) if since else end - DEFAULT_RANGE[per]
    except OverflowError:
        raise Invalid("since and until must be dates after the year 1", field="since") from None
    if start >= end:
        raise Invalid(f"since ({start.isoformat()}) must be before until ({end.isoformat()})", field="since")
    if end - start > MAX_RANGE[per]:
        wider = {"minute": "per=hour", "hour": "per=day", "day": "several requests"}[per]
        raise Invalid(
            f"a report per {per} covers at most {MAX_RANGE[per].days} day(s); this range is {_span(end - start)}: "
            f"ask a shorter range, or {wider}",
            field="since",
        )
    return start, end


def _span(length: timedelta) -> str:
    """A range's length as a person says it: "2 days 3 hours", "45 minutes" (whole minutes at most)."""
    minutes = int(length.total_seconds() // 60)
    days, rest = divmod(minutes, 24 * 60)
    hours, minutes = divmod(rest, 60)
    parts = [f"{n} {unit}{'s' * (n != 1)}" for n, unit in ((days, "day"), (hours, "hour"), (minutes, "minute")) if n]
    return " ".join(parts) or "under a minute"


def report(
    db: Session,
    *,
    since: datetime | None = None,
    until: datetime | None = None,
    per: str = "hour",
    model: str | None = None,
    key: str | None = None,
    now: datetime | None = None,
) -> UsageReport:
    """Usage summed per ``per`` (minute, hour or day), key and model config, over a bounded range.

    ``key``: a key's name (every key that had it, revoked ones included), or "-" for requests
    without a key. ``model``: a model config's name.
    """
    start, end = window(since, until, per, now or datetime.now(UTC))
    keys = {k.id: k for k in db.exec(select(InferenceKey)) if k.id is not None}
    width = BUCKET_S[per]
    bucket = (col(UsageMinute.minute) // width) * width
    key_id, model_name = col(UsageMinute.key_id), col(UsageMinute.model)
    query = select_columns(
        bucket,
        key_id,
        model_name,
        func.sum(UsageMinute.requests),
        func.sum(UsageMinute.errors),
        func.sum(UsageMinute.prompt_tokens),
        func.sum(UsageMinute.completion_tokens),
    ).where(
        col(UsageMinute.minute) >= int(start.timestamp()) // 60 * 60,
        col(UsageMinute.minute) < end.timestamp(),
    )
    if model is not None:
        query = query.where(model_name == model)
    if key is not None:
        query = query.where(key_id.in_(_key_ids(keys, key)))
    query = query.group_by(bucket, key_id, model_name).order_by(bucket, key_id, model_name)
    rows: list[UsageLine] = []
    totals: dict[tuple[int, str], Counts] = {}
    for at, who, what, requests, errors, prompt, completion in db.connection().execute(query):
        counts = Counts(requests, errors, prompt, completion)
        rows.append(_line(datetime.fromtimestamp(at, UTC), keys.get(who), what, counts))
        totals[(who, what)] = totals.get((who, what), Counts()).plus(counts)
    total = Counts()
    for counts in totals.values():
        total = total.plus(counts)
    return UsageReport(
        since=start,
        until=end,
        per=per,  # type: ignore[arg-type]  # checked by window()
        rows=rows,
        totals=[_line(None, keys.get(k), m, c) for (k, m), c in sorted(totals.items(), key=_by_name(keys))],
        total=UsageTotal(**total.__dict__),
    )


def _key_ids(keys: dict[int, InferenceKey], name: str) -> list[int]:
    if name == NO_KEY_NAME:
        return [NO_KEY]
    ids = [k_id for k_id, k in keys.items() if k.name == name]
    if not ids:
        known = ", ".join(sorted({k.name for k in keys.values()})) or "none yet"
        raise NotFound(f"no inference key was ever named {name!r} (keys: {known}; '-' for requests without a key)")
    return ids


def _line(start: datetime | None, key: InferenceKey | None, model: str, counts: Counts) -> UsageLine:
    return UsageLine(
        start=start,
        key=key.name if key else None,
        key_prefix=key.prefix if key else None,
        model=model,
        **counts.__dict__,
    )


def _by_name(keys: dict[int, InferenceKey]):
    def order(item: tuple[tuple[int, str], Counts]) -> tuple[str, int, str]:
        (key_id, model), _ = item
        key = keys.get(key_id)
        return (key.name if key else "", key_id, model)

    return order


def _utc(when: datetime) -> datetime:
    return when.replace(tzinfo=UTC) if when.tzinfo is None else when.astimezone(UTC)


def tokens_since(db: Session, key_id: int, since: int) -> int:
    """Prompt and completion tokens the key's requests used from the minute ``since`` (unix s) on."""
    table = UsageMinute.__table__
    total = db.execute(
        select_columns(func.coalesce(func.sum(table.c.prompt_tokens + table.c.completion_tokens), 0)).where(
            table.c.key_id == key_id, table.c.minute >= since
        )
    ).scalar_one()
    return int(total)
