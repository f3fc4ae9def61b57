"""The LoRA registry through the REST API and the `loras` CLI (no engine: see test_engine_loras)."""

from __future__ import annotations

import importlib.util
import socket
import threading
import time
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import uvicorn
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.operations import Operations
from fastapi.testclient import TestClient
from sqlalchemy import MetaData, create_engine
from typer.testing import CliRunner

from manager.app import create_app
from manager.cli_loras import loras_app
from manager.routes import loras
from manager.schemas.lora_adapter import LoraAdapter
from tests.lora.peft_adapters import make_llama_adapter

MIGRATION = Path(__file__).parents[2] / "manager/migrations/versions/0003_lora_adapters.py"


def lora_app(settings):
    """The manager app with the LoRA routes and the pin keeper, as manager/app.py wires them."""
    app = create_app(settings)
    if not any(getattr(r, "path", "") == "/api/loras" for r in app.routes):
        app.include_router(loras.router)
    inner = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan(a):
        async with inner(a) as state:
            try:
                yield state
            finally:
                keeper = getattr(a.state, "lora_pin_keeper", None)
                if keeper is not None:
                    await keeper.stop()

    app.router.lifespan_context = lifespan
    return app


@pytest.fixture
def api(settings, tiny_llama):
    with TestClient(lora_app(settings)) as c:
        c.post(
            "/api/models",
            json={"name": "tiny", "model": str(tiny_llama), "enable_lora": True, "max_lora_rank": 16, "max_loras": 2},
        )
        yield c


def test_add_list_pin_remove(api, tiny_llama, tmp_path):
    folder = make_llama_adapter(tmp_path / "a", tiny_llama, rank=8)
    created = api.post("/api/loras", json={"name": "sql-helper", "path": str(folder), "base_config": "tiny"})
    assert created.status_code == 201, created.text
    assert created.json()["rank"] == 8 and created.json()["pinned"] is False
    assert [a["name"] for a in api.get("/api/loras").json()] == ["sql-helper"]
    assert api.get("/api/loras?base_config=other").json() == []

    pinned = api.post("/api/loras/sql-helper/pin", json={"pinned": True})
    assert pinned.json()["pinned"] is True and pinned.json()["loaded_now"] == []  # no workers
    assert api.get("/api/loras/sql-helper").json()["pinned"] is True

    assert api.delete("/api/loras/sql-helper").status_code == 204
    assert api.get("/api/loras/sql-helper").status_code == 404


def test_bad_adapters_are_refused_with_the_reason(api, tiny_llama, tmp_path):
    big = make_llama_adapter(tmp_path / "big", tiny_llama, rank=32)
    resp = api.post("/api/loras", json={"name": "big", "path": str(big), "base_config": "tiny"})
    assert resp.status_code == 422 and "max_lora_rank 16" in resp.json()["detail"]
    resp = api.post("/api/loras", json={"name": "x", "path": str(tmp_path), "base_config": "tiny"})
    assert resp.status_code == 422 and "adapter_config.json" in resp.json()["detail"]
    resp = api.post("/api/loras", json={"name": "x", "path": str(big), "base_config": "nope"})
    assert resp.status_code == 404
    ok = make_llama_adapter(tmp_path / "ok", tiny_llama)
    api.post("/api/loras", json={"name": "ok", "path": str(ok), "base_config": "tiny"})
    again = api.post("/api/loras", json={"name": "ok", "path": str(ok), "base_config": "tiny"})
    assert again.status_code == 409
    assert api.get("/api/loras").json()[0]["name"] == "ok"


def test_loading_into_a_worker_that_does_not_exist_is_a_404(api, tiny_llama, tmp_path):
    folder = make_llama_adapter(tmp_path / "a", tiny_llama)
    api.post("/api/loras", json={"name": "a", "path": str(folder), "base_config": "tiny"})
    assert api.post("/api/workers/99/loras/a/load").status_code == 404
    assert api.get("/api/workers/99/loras").status_code == 404


def test_migration_creates_exactly_the_adapter_table(tmp_path):
    spec = importlib.util.spec_from_file_location("m0003", MIGRATION)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert (module.revision, module.down_revision) == ("0003_lora_adapters", "0002_metric_history")
    engine = create_engine(f"sqlite:///{tmp_path / 'mig.db'}")
    with engine.begin() as conn:
        with Operations.context(MigrationContext.configure(conn)):
            module.upgrade()
        model = MetaData()
        LoraAdapter.__table__.to_metadata(model)
        assert compare_metadata(MigrationContext.configure(conn), model) == []


@pytest.fixture
def live_manager(settings, tiny_llama):
    """The app served on a real port, for the CLI (it talks HTTP to the manager)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(lora_app(settings), port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    url = f"http://127.0.0.1:{port}"
    import httpx

    httpx.post(
        f"{url}/api/models", json={"name": "tiny", "model": str(tiny_llama), "enable_lora": True, "max_lora_rank": 16}
    )
    yield url
    server.should_exit = True
    thread.join(10)


def test_cli_add_list_pin_rm(live_manager, tiny_llama, tmp_path):
    cli = CliRunner()
    folder = make_llama_adapter(tmp_path / "a", tiny_llama, rank=4)
    added = cli.invoke(loras_app, ["add", "chat-style", str(folder), "--config", "tiny", "--url", live_manager])
    assert added.exit_code == 0, added.output
    listed = cli.invoke(loras_app, ["list", "--url", live_manager])
    assert "chat-style" in listed.output and "rank 4" in listed.output
    assert "pinned" in cli.invoke(loras_app, ["pin", "chat-style", "--url", live_manager]).output
    unpinned = cli.invoke(loras_app, ["pin", "chat-style", "--off", "--url", live_manager])
    assert "pinned" not in unpinned.output
    refused = cli.invoke(loras_app, ["load", "7", "chat-style", "--url", live_manager])
    assert refused.exit_code == 1 and "404" in refused.output
    assert cli.invoke(loras_app, ["rm", "chat-style", "--url", live_manager]).exit_code == 0
    assert "chat-style" not in cli.invoke(loras_app, ["list", "--url", live_manager]).output
