"""The store's commit watch: what lets the front door keep the model names between requests."""

from __future__ import annotations

import sqlite3

from sqlalchemy import text
from sqlmodel import create_engine

from manager.db import CommitWatch, make_engine, migrate


def test_the_version_changes_with_every_commit_and_only_then(tmp_path):
    path = tmp_path / "manager.db"
    engine = make_engine(path)
    migrate(engine)
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE scratch (x)"))
    watch = CommitWatch(engine)
    first = watch.version()
    assert first is not None and watch.version() == first
    with engine.connect() as conn:
        conn.execute(text("SELECT count(*) FROM model_config")).one()
    assert watch.version() == first  # reading is not a change
    with engine.connect() as conn:
        conn.execute(text("INSERT INTO scratch VALUES (0)"))
        conn.rollback()
    assert watch.version() == first  # nor is a transaction rolled back
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO scratch VALUES (1)"))
    second = watch.version()
    assert second != first
    # Another process (the CLI) writes through a connection of its own.
    other = sqlite3.connect(path)
    other.execute("INSERT INTO scratch VALUES (2)")
    other.commit()
    other.close()
    assert watch.version() not in (first, second)
    watch.close()
    assert watch.version() is None
    engine.dispose()


def test_an_in_memory_database_has_no_version_so_nothing_is_kept():
    watch = CommitWatch(create_engine("sqlite://"))
    assert watch.version() is None
