"""Names on their own: a request's "model" to its config (and adapter), and the /v1/models listing."""

from __future__ import annotations

import pytest

from manager.frontdoor.names import AdapterNames, ConfigNames, NameTable, Target, UnknownModel, listing, state_of
from manager.supervisor.view import WorkerView
from manager.supervisor.worker_state import State

TABLE = NameTable(
    [
        ConfigNames("llama", "meta-llama/Llama-3.1-8B-Instruct", ("llama-8b", "chat"), created=100),
        ConfigNames("qwen", None, (), created=200),
    ],
    [AdapterNames("sql-lora", "llama", created=300), AdapterNames("orphan", "deleted-config")],
)


def view(wid: int, model: str, state: State) -> WorkerView:
    return WorkerView(
        id=wid, model=model, served_model_name=model, state=state, detail=None, pid=None, port=18000 + wid,
        gpus=[0], uptime_s=None, restart_count=0, next_restart_in_s=None, last_error=None, started_at=None,
        run_dir="/tmp/run", log_file=None,
    )  # fmt: skip


def test_every_kind_of_name_leads_to_its_config_and_the_name_the_engine_serves():
    served = "meta-llama/Llama-3.1-8B-Instruct"
    assert TABLE.resolve("llama") == Target("llama", served, kind="name")
    assert TABLE.resolve(served) == Target("llama", served, kind="served model name")
    assert TABLE.resolve("chat") == Target("llama", served, kind="alias")
    assert TABLE.resolve("qwen") == Target("qwen", "qwen", kind="name")
    # An adapter goes to its base config's worker, under its own name (vLLM serves adapters by name).
    assert TABLE.resolve("sql-lora") == Target("llama", "sql-lora", adapter="sql-lora", kind="adapter")


def test_an_unknown_name_lists_the_names_that_exist():
    with pytest.raises(UnknownModel) as err:
        TABLE.resolve("gpt-4o")
    assert err.value.known == ["chat", "llama", "llama-8b", "meta-llama/Llama-3.1-8B-Instruct", "qwen", "sql-lora"]
    assert "'gpt-4o' does not exist" in str(err.value) and "chat, llama" in str(err.value)
    with pytest.raises(UnknownModel, match="create a model config first"):
        NameTable([]).resolve("x")
    # An adapter whose base config is gone routes nowhere.
    with pytest.raises(UnknownModel):
        TABLE.resolve("orphan")


def test_a_name_stored_twice_before_names_were_checked_goes_to_the_first_config():
    table = NameTable([ConfigNames("b", "shared"), ConfigNames("a", "shared")])
    assert table.resolve("shared").config == "a"


def test_state_is_the_best_of_the_configs_workers():
    views = [view(1, "llama", State.STOPPED), view(2, "llama", State.STARTING), view(3, "qwen", State.FAILED)]
    assert state_of("llama", views) == "starting"
    assert state_of("llama", [*views, view(4, "llama", State.READY)]) == "ready"
    assert state_of("qwen", views) == "stopped"
    assert state_of("qwen", [view(5, "qwen", State.CRASHED), view(6, "qwen", State.STOPPING)]) == "stopped"
    assert state_of("never-started", views) == "stopped"
    assert state_of("qwen", [view(7, "qwen", State.SLEEPING)]) == "sleeping"
    assert state_of("qwen", [view(7, "qwen", State.WAKING)]) == "starting"
    assert state_of("qwen", [view(7, "qwen", State.SLEEPING), view(8, "qwen", State.READY)]) == "ready"


def test_the_listing_shows_every_name_with_its_models_state():
    body = listing(TABLE, [view(1, "llama", State.READY)])
    assert body["object"] == "list"
    entries = {e["id"]: e for e in body["data"]}
    assert sorted(entries) == TABLE.names()
    assert entries["chat"] == {
        "id": "chat", "object": "model", "created": 100, "owned_by": "vllm-manager",
        "config": "llama", "kind": "alias", "state": "ready",
    }  # fmt: skip
    assert entries["qwen"]["state"] == "stopped" and entries["qwen"]["created"] == 200
    assert entries["sql-lora"]["parent"] == "meta-llama/Llama-3.1-8B-Instruct"
    assert entries["sql-lora"]["state"] == "ready" and entries["sql-lora"]["created"] == 300
