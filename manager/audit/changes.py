"""Which stored fields a change really changed: an update sends every field of a config, and the audit
log names the few whose stored value is now different (never the values).

While the trail serves a request its note is the current one (a context variable, which FastAPI's
thread pool carries into the route), and every flush of the store during it adds the names of the
columns it changes. Bookkeeping columns (times of a change or a use) are left out.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Any

from sqlalchemy import event, inspect
from sqlmodel import Session

from manager.audit.caller import Note

CURRENT: ContextVar[Note | None] = ContextVar("vllm_manager_audit_note", default=None)
BOOKKEEPING = frozenset({"created_at", "updated_at", "last_seen_at", "last_used_at"})


def refused(status: int, message: str) -> None:
    """A change refused on a page that shows why (a form's errors, a list with its message): the page is
    answered 200, so the audit row records the status the API answers the same refusal with, and why.
    The first refusal of a request is the one kept."""
    note = CURRENT.get()
    if note is not None and note.refused_status is None:
        note.refused_status, note.message = status, message


@event.listens_for(Session, "before_flush")
def _note_changes(db: Session, _context: Any, _instances: Any) -> None:
    note = CURRENT.get()
    if note is None:
        return
    for row in db.dirty:
        state = inspect(row)
        for column in state.mapper.column_attrs:
            if column.key in BOOKKEEPING:
                continue
            history = state.attrs[column.key].history
            if history.added and list(history.added) != list(history.deleted):
                note.changed.add(column.key)
