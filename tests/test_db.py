"""The store: its commit watch (what lets the front door keep the model names between requests) and its
migrations."""

from __future__ import annotations

import json
import logging
import sqlite3

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.config import Config
from alembic.migration import MigrationContext
from sqlalchemy import MetaData, text
from sqlmodel import create_engine, select

from manager.db import MIGRATIONS, CommitWatch, make_engine, migrate, session
from manager.errors import Conflict
from manager.schemas.lora_adapter import LoraAdapter
from manager.schemas.model_config import ModelConfig, ModelConfigCreate
from manager.schemas.offload_profile import OffloadProfile
from manager.schemas.routing_name import RoutingName
from manager.schemas.worker import Worker
from manager.services.models import create_model, delete_model


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


def _upgrade(engine, revision: str) -> None:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    with engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, revision)


def _config(conn, id_: int, name: str, served: str | None = None, aliases: tuple[str, ...] = ()) -> None:
    conn.execute(
        text(
            "INSERT INTO model_config (id, name, model, served_model_name, aliases, dtype, tensor_parallel_size,"
            " gpu_ids, gpu_memory_utilization, kv_cache_dtype, enforce_eager, enable_lora, extra_args, env,"
            " autostart, start_timeout_s, persistent, created_at, updated_at) VALUES (:id, :name, '/m', :served,"
            " :aliases, 'auto', 1, '[]', 0.9, 'auto', 0, 0, '[]', '{}', 0, 900, 0, '2026-01-01', '2026-01-01')"
        ),
        {"id": id_, "name": name, "served": served, "aliases": json.dumps(list(aliases))},
    )


def test_routing_names_are_filled_and_duplicates_in_an_older_store_keep_the_first(tmp_path, caplog):
    engine = make_engine(tmp_path / "manager.db")
    _upgrade(engine, "0007_nodes")
    with engine.begin() as conn:
        # As two clients that created configs at the same moment could leave them.
        _config(conn, 1, "llama", served="meta-llama", aliases=("fast", "chat"))
        _config(conn, 2, "qwen", aliases=("chat", "qwen-small"))
        _config(conn, 3, "mistral", served="fast", aliases=("mistral-7b",))
        _config(conn, 4, "chat", aliases=("talk",))  # a config named like an older one's alias
        conn.execute(
            text(
                "INSERT INTO lora_adapter (id, name, path, base_config, rank, pinned, created_at) VALUES"
                " (1, 'qwen-small', '/a', 'qwen', 8, 0, '2026-01-01'), (2, 'sql', '/b', 'llama', 8, 0, '2026-01-01')"
            )
        )
    with caplog.at_level(logging.WARNING, logger="vllm_manager.store"):
        migrate(engine)
    with engine.connect() as conn:
        configs = conn.execute(text("SELECT name, served_model_name, aliases FROM model_config ORDER BY id")).all()
        held = dict(conn.execute(text("SELECT name, kind FROM routing_name")).all())
        events = [m for (m,) in conn.execute(text("SELECT message FROM event WHERE kind = 'names_dropped'"))]
    # Every config is kept; a later config loses the names an older one (or a config's own name) holds.
    assert [(n, s, json.loads(a)) for n, s, a in configs] == [
        ("llama", "meta-llama", ["fast"]),
        ("qwen", None, ["qwen-small"]),
        ("mistral", None, ["mistral-7b"]),
        ("chat", None, ["talk"]),
    ]
    assert held == {
        "llama": "name", "meta-llama": "served model name", "fast": "alias",
        "qwen": "name", "qwen-small": "alias",
        "mistral": "name", "mistral-7b": "alias",
        "chat": "name", "talk": "alias",
        "sql": "adapter",
    }  # fmt: skip
    assert events == [
        "model config 'llama': its alias 'chat' was removed, as 'chat' is the name of model config 'chat'",
        "model config 'qwen': its alias 'chat' was removed, as 'chat' is the name of model config 'chat'",
        "model config 'mistral': its served model name 'fast' was cleared, as 'fast' is the alias of model config "
        "'llama'; its engine now serves it as 'mistral'",
        "LoRA adapter 'qwen-small' of 'qwen' answers to no /v1 name, as 'qwen-small' is the alias of model config "
        "'qwen': remove it and add it again under another name",
    ]
    assert [r.getMessage() for r in caplog.records] == events
    # The table is the one the code writes.
    wanted = MetaData()
    for table in (OffloadProfile, ModelConfig, LoraAdapter, RoutingName):
        table.__table__.to_metadata(wanted)
    with engine.connect() as conn:
        diffs = [d for d in compare_metadata(MigrationContext.configure(conn), wanted) if "routing_name" in repr(d)]
    assert diffs == [], diffs
    # The names now held are refused to others, and the store takes new configs.
    with session(engine) as db:
        with pytest.raises(Conflict, match="'fast' is the alias of model config 'llama'"):
            create_model(db, ModelConfigCreate(name="new", model="org/m", aliases=["fast"]))
        create_model(db, ModelConfigCreate(name="new", model="org/m", aliases=["new-small"]))
    engine.dispose()


def test_a_deleted_config_lets_go_of_its_names(tmp_path):
    engine = make_engine(tmp_path / "manager.db")
    migrate(engine)
    with session(engine) as db:
        create_model(db, ModelConfigCreate(name="a", model="org/m", served_model_name="org/a", aliases=["x"]))
        delete_model(db, "a")
        assert db.exec(select(RoutingName)).all() == []
        create_model(db, ModelConfigCreate(name="b", model="org/m", served_model_name="org/a", aliases=["x", "a"]))
    engine.dispose()


def test_a_config_is_not_deleted_while_a_worker_of_it_is_active(tmp_path):
    engine = make_engine(tmp_path / "manager.db")
    migrate(engine)
    with session(engine) as db:
        create_model(db, ModelConfigCreate(name="a", model="org/m"))
        worker = Worker(model_name="a")
        db.add(worker)
        db.commit()
        for state in ("downloading", "starting", "ready", "stopping", "crashed", "sleeping", "waking", "lost"):
            worker.state = state
            db.add(worker)
            db.commit()
            with pytest.raises(Conflict, match=r"model config 'a' is running in worker\(s\) 1; stop them first"):
                delete_model(db, "a")
        worker.state = "failed"
        db.add(worker)
        db.commit()
        delete_model(db, "a")
    engine.dispose()
