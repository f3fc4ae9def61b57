"""The SQLite database: one engine per data dir, WAL and foreign keys on, schema by Alembic."""

from __future__ import annotations

import os
import sqlite3
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Generic, TypeVar

from alembic import command
from alembic.config import Config
from sqlalchemy import event
from sqlalchemy.engine import Engine, ExceptionContext
from sqlalchemy.exc import IntegrityError
from sqlmodel import Session, create_engine

from manager.errors import Conflict, InsufficientStorage, Unavailable
from manager.settings import make_private

T = TypeVar("T")

MIGRATIONS = Path(__file__).parent / "migrations"


def _on_connect(dbapi_conn, _record) -> None:
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA foreign_keys=ON")
    # FULL: an acknowledged commit is on disk before the reply leaves, even across a power cut.
    cur.execute("PRAGMA synchronous=FULL")
    cur.execute("PRAGMA busy_timeout=5000")
    cur.close()


def _storage_fault(context: ExceptionContext) -> None:
    """SQLite's answers about the disk become errors that say what happened and what to do; the
    transaction they broke is rolled back, so nothing is half-written."""
    code = getattr(context.original_exception, "sqlite_errorcode", None)
    folder = Path(context.engine.url.database or "").parent if context.engine else "the data dir"
    if code == sqlite3.SQLITE_FULL:
        raise InsufficientStorage(
            f"the disk holding the manager's data ({folder}) is full; nothing was saved: free space there and try again"
        ) from context.original_exception
    if code in (sqlite3.SQLITE_READONLY, sqlite3.SQLITE_IOERR, sqlite3.SQLITE_CANTOPEN):
        raise Unavailable(
            f"the manager's database in {folder} cannot be written ({context.original_exception}); nothing was "
            "saved: check that the folder is writable and its disk healthy"
        ) from context.original_exception
    if code in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED):
        raise Unavailable(
            "the manager's database is busy (another process holds a lock on it); nothing was saved: try again"
        ) from context.original_exception


def make_engine(db_path: Path) -> Engine:
    db_path.parent.mkdir(parents=True, exist_ok=True)
    _create_private(db_path)
    engine = create_engine(f"sqlite:///{db_path}", connect_args={"check_same_thread": False})
    event.listen(engine, "connect", _on_connect)
    event.listen(engine, "handle_error", _storage_fault)
    return engine


def _create_private(db_path: Path) -> None:
    """The database readable by this user only (0600). SQLite gives its -wal and -shm files the mode
    of the database file, so creating that one first is enough; older files are tightened."""
    if not db_path.exists():
        os.close(os.open(db_path, os.O_CREAT | os.O_WRONLY, 0o600))  # an empty file is an empty database
    for path in (db_path, db_path.with_name(db_path.name + "-wal"), db_path.with_name(db_path.name + "-shm")):
        if path.exists():
            make_private(path, 0o600)


def migrate(engine: Engine) -> None:
    """Create or upgrade the schema to the newest Alembic revision."""
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    with engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "head")


class CommitWatch:
    """Tells whether anything was committed to the database since a version was read, for one PRAGMA.

    SQLite's data_version, read on a connection of its own that never writes, changes whenever another
    connection commits: the manager's own pool or another process (the CLI). Values read from the store
    may be kept for as long as the version stays the same. Without a database file (in memory) the
    version is unknown (None) and nothing may be kept.
    """

    def __init__(self, engine: Engine) -> None:
        path = engine.url.database
        self._conn = sqlite3.connect(path, check_same_thread=False) if path and path != ":memory:" else None
        self._lock = threading.Lock()  # pages read it from the thread pool, /v1 from the event loop

    def version(self) -> int | None:
        if self._conn is None:
            return None
        with self._lock:
            return int(self._conn.execute("PRAGMA data_version").fetchone()[0])

    def close(self) -> None:
        if self._conn is not None:
            with self._lock:
                self._conn.close()
                self._conn = None


class ReadAfterCommits(Generic[T]):
    """What ``read`` gives, kept until something is committed to the store (by any connection or
    process), then read again at the next ``get``. Without a version to watch (an in-memory store),
    read every time."""

    def __init__(self, watch: CommitWatch, read: Callable[[], T]) -> None:
        self._watch = watch
        self._read = read
        self._kept: tuple[int, T] | None = None

    def get(self) -> T:
        version = self._watch.version()
        kept = self._kept
        if version is not None and kept is not None and kept[0] == version:
            return kept[1]
        value = self._read()
        if version is not None:
            self._kept = (version, value)
        return value


def session(engine: Engine) -> Session:
    return Session(engine, expire_on_commit=False)


def commit_or_conflict(db: Session, clash: str) -> None:
    """Commit, or roll back and raise Conflict(clash) when another writer got there first: a name taken
    between our check and our insert, or a row we refer to removed meanwhile (SQLite's constraints)."""
    try:
        db.commit()
    except IntegrityError as exc:
        db.rollback()
        raise Conflict(clash) from exc
