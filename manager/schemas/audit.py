"""The audit log: one row per change asked of the manager (every write to its API, the dashboard's forms,
logging in and out, the CLI's token commands), whether it was done or refused.

A row says who asked (a stored token by its id, VLLM_MANAGER_API_TOKEN, a browser session, the CLI, or
"anonymous" where no token is configured), from where, what (method, route, target, action) and what
came of it. Never a secret: no request body, only the names of the fields sent; no query string.
"""

from __future__ import annotations

from datetime import datetime
from typing import ClassVar

from pydantic import BaseModel
from pydantic import Field as Described
from sqlalchemy import Column, Index, Table
from sqlalchemy.types import JSON
from sqlmodel import Field, SQLModel

from manager.schemas.common import utcnow

# Who asked, when it was not a token (``token:<id>``) or a session (``session:<id>``).
ANONYMOUS = "anonymous"  # no token is configured: the manager is open to whoever reaches it
UNAUTHENTICATED = "unauthenticated"  # no valid token or session came with it (it was refused)
ENV_TOKEN = "env-token"  # VLLM_MANAGER_API_TOKEN (or its file)
CLI = "cli"  # the command line, on this machine, straight in the store

MAX_MESSAGE = 1000  # what is kept of an error message
MAX_TARGET = 256
MAX_FIELDS = 64


class AuditEntry(SQLModel, table=True):
    """The table of revision 0013_audit; keep both in step."""

    __tablename__ = "audit_entry"
    __table__: ClassVar[Table]  # set by SQLModel's metaclass, which does not declare it for type checkers
    __table_args__ = (
        Index("ix_audit_entry_at", "at"),  # the log is read newest first, and retention deletes by age
        {"sqlite_autoincrement": True},  # ids are never given again: a row is never replaced
    )

    id: int | None = Field(default=None, primary_key=True)
    at: datetime = Field(default_factory=utcnow)
    who: str  # token:<id>, session:<id>, env-token, cli:<user>, anonymous or unauthenticated
    token: str | None = None  # the admin token behind it (a session's too): token:<id> or env-token
    token_name: str | None = None  # that token's name, as it was then
    address: str  # the client's address; "local" for the CLI
    method: str
    route: str  # the route's template, such as /api/models/{name}; a CLI command for the CLI
    action: str  # such as models.update or workers.stop
    target: str | None = None  # the id or name acted on
    fields: list[str] = Field(default_factory=list, sa_column=Column(JSON, nullable=False))  # names only
    changed: list[str] = Field(default_factory=list, sa_column=Column(JSON, nullable=False))  # names only
    status: int  # the HTTP status it was answered with (a form's refusal shown on its page: the API's; the CLI: 200 done, 4xx refused)
    message: str | None = None  # what was wrong, for a failure


class AuditEntryPublic(BaseModel):
    id: int
    at: datetime = Described(description="When it was answered (UTC)")
    who: str = Described(
        description="Who asked: token:<id> (a stored admin token), env-token (VLLM_MANAGER_API_TOKEN), "
        "session:<id> (a browser session), cli:<user>, anonymous (no token is configured) or unauthenticated"
    )
    token: str | None = Described(description="The admin token behind it, a session's included")
    token_name: str | None = Described(description="That token's name when the call was made")
    address: str = Described(description="The client's address")
    method: str
    route: str = Described(description="The route's template, such as /api/models/{name}")
    action: str = Described(description="What was asked, such as models.update or workers.stop")
    target: str | None = Described(description="The id or name acted on")
    fields: list[str] = Described(description="The names of the fields the request sent (never their values)")
    changed: list[str] = Described(
        description="The stored fields whose value it changed, such as extra_args for an update (never the values)"
    )
    status: int = Described(
        description="The HTTP status it was answered with; for a change a dashboard form refused on its page "
        "(answered 200), the status the API answers the same refusal with"
    )
    outcome: str = Described(description="ok (below 400) or failed")
    message: str | None = Described(description="What was wrong, for a failure")


class AuditPage(BaseModel):
    entries: list[AuditEntryPublic] = Described(description="Newest first")
    more: bool = Described(description="More rows match than were sent: narrow the range or raise limit")
