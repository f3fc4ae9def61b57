"""Browser sessions from the login page, kept by the manager so that logging out, or revoking the token
that logged in, ends them at once.

Only a SHA-256 digest of the session's secret is stored (the cookie holds the id and the secret), and
the digest of the token that logged in; never either secret itself.
"""

from __future__ import annotations

from datetime import datetime

from sqlmodel import Field, SQLModel

from manager.schemas.common import utcnow

MAX_USER_AGENT = 256  # what is kept of a browser's User-Agent: enough to recognise it


class BrowserSession(SQLModel, table=True):
    __tablename__ = "browser_session"
    # Ids are never given again, so an id a person read in a listing names one session only.
    __table_args__ = {"sqlite_autoincrement": True}

    id: int | None = Field(default=None, primary_key=True)
    secret_sha256: str
    token_sha256: str = Field(index=True)
    created_at: datetime = Field(default_factory=utcnow)
    expires_at: datetime
    last_seen_at: datetime = Field(default_factory=utcnow)
    client_address: str
    user_agent: str


class BrowserSessionPublic(SQLModel):
    id: int
    token: str = Field(description="The name of the admin token that logged in (or VLLM_MANAGER_API_TOKEN)")
    client_address: str = Field(description="Where the browser logged in from")
    user_agent: str
    created_at: datetime
    last_seen_at: datetime = Field(description="Its last request, to within a minute")
    expires_at: datetime


class SessionsEnded(SQLModel):
    ended: int = Field(description="How many sessions were ended")
