"""Browser sessions in the store: the cookie names one, only digests are kept, and each ends at its
expiry, at logout, when the admin ends it, or with the token that made it."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest
from sqlmodel import Session, select

from manager.auth import sessions
from manager.db import make_engine, migrate
from manager.db import session as open_session
from manager.schemas.browser_session import BrowserSession

TOKEN = "vmt_" + "a" * 43
DIGEST = hashlib.sha256(TOKEN.encode()).hexdigest()
OTHER_DIGEST = hashlib.sha256(b"another token").hexdigest()
T0 = datetime(2026, 5, 1, 12, 0, tzinfo=UTC)


@pytest.fixture
def db(tmp_path) -> Iterator[Session]:
    engine = make_engine(tmp_path / "manager.db")
    migrate(engine)
    with open_session(engine) as db:
        yield db
    engine.dispose()


def _start(db: Session, digest: str = DIGEST, now: datetime = T0, agent: str = "Firefox") -> str:
    return sessions.start(db, digest, "10.0.0.5", agent, now)


def test_a_session_is_good_until_it_expires_and_is_then_deleted(db):
    value = _start(db)
    assert TOKEN not in value and DIGEST not in value
    row = sessions.find(db, value, T0 + sessions.SESSION_LIFETIME - timedelta(seconds=1))
    assert row is not None and row.token_sha256 == DIGEST and row.client_address == "10.0.0.5"
    assert sessions.find(db, value, T0 + sessions.SESSION_LIFETIME) is None
    assert db.exec(select(BrowserSession)).all() == []


def test_only_digests_are_stored(db, tmp_path):
    value = _start(db)
    secret = value.partition(".")[2]
    raw = b"".join(f.read_bytes() for f in tmp_path.glob("manager.db*"))
    assert secret.encode() not in raw and TOKEN.encode() not in raw
    assert hashlib.sha256(secret.encode()).hexdigest().encode() in raw


def test_changed_or_made_up_values_are_refused(db):
    value = _start(db)
    session_id, _, secret = value.partition(".")
    other = _start(db)
    made_up = (f"{other.partition('.')[0]}.{secret}", f"{session_id}.{secret[:-1]}", f"{session_id}.",
               f"{session_id}.\udcff", f"\u0661.{secret}", "9" * 40 + f".{secret}", "", "a.b", secret, TOKEN)  # fmt: skip
    for forged in made_up:
        assert sessions.find(db, forged, T0) is None, forged
    assert sessions.find(db, value, T0) is not None


def test_logging_out_ends_that_session_only(db):
    first, second = _start(db), _start(db)
    assert sessions.end(db, first)
    assert sessions.find(db, first, T0) is None
    assert sessions.find(db, second, T0) is not None
    assert not sessions.end(db, first)


def test_a_token_takes_its_sessions_with_it(db):
    mine, theirs = _start(db, DIGEST), _start(db, OTHER_DIGEST)
    assert sessions.end_made_with(db, DIGEST) == 1
    db.commit()
    assert sessions.find(db, mine, T0) is None and sessions.find(db, theirs, T0) is not None
    assert sessions.end_unless_made_with(db, [DIGEST]) == 1
    assert sessions.find(db, theirs, T0) is None


def test_the_admin_ends_one_session_or_all(db):
    values = [_start(db) for _ in range(3)]
    listed = sessions.live(db, T0)
    assert len(listed) == 3
    sessions.end_by_id(db, listed[0].id or 0)
    with pytest.raises(Exception, match="no browser session with id"):
        sessions.end_by_id(db, listed[0].id or 0)
    assert sum(sessions.find(db, v, T0) is not None for v in values) == 2
    assert sessions.end_all(db) == 2
    assert sessions.live(db, T0) == []


def test_ids_are_never_given_again(db):
    first = _start(db)
    sessions.end(db, first)
    assert _start(db).partition(".")[0] != first.partition(".")[0]


def test_last_seen_is_written_at_most_once_a_minute(db):
    value = _start(db)
    seen = sessions.find(db, value, T0 + timedelta(seconds=30))
    assert seen is not None and seen.last_seen_at == T0
    seen = sessions.find(db, value, T0 + timedelta(seconds=61))
    assert seen is not None and seen.last_seen_at == T0 + timedelta(seconds=61)


def test_expired_sessions_are_removed_when_a_new_one_starts(db):
    _start(db, now=T0)
    later = T0 + sessions.SESSION_LIFETIME + timedelta(hours=1)
    _start(db, now=later)
    assert [s.created_at for s in db.exec(select(BrowserSession))] == [later]


def test_the_number_of_sessions_kept_is_bounded(db, monkeypatch):
    monkeypatch.setattr(sessions, "MAX_SESSIONS", 3)
    values = [_start(db, now=T0 + timedelta(minutes=n)) for n in range(5)]
    assert len(sessions.live(db, T0)) == 3
    assert [sessions.find(db, v, T0 + timedelta(minutes=5)) is not None for v in values] == [False] * 2 + [True] * 3


def test_what_is_kept_of_the_browser_is_bounded(db):
    _start(db, agent="x" * 10_000)
    (row,) = sessions.live(db, T0)
    assert len(row.user_agent) == 256
    public = sessions.to_public(row, {DIGEST: "laptop"})
    assert public.token == "laptop" and public.client_address == "10.0.0.5"
    assert sessions.to_public(row, {}).token == "VLLM_MANAGER_API_TOKEN"
