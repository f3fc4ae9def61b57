"""A worker's events and log lines never show its config's secrets, to anyone (token or not), and its
log files are readable by the manager's user alone.

The engine interpreter here is a script that prints what a vLLM server would reveal (its arguments,
like vLLM's "non-default args" line, the Hugging Face token it got and the hub it asks) and then sleeps.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import stat
import threading
import time
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from manager.app import create_app
from manager.host import process
from manager.launch.secrets import Redactor
from manager.schemas.common import MARKER
from manager.supervisor.logs import LogTail, new_log_file
from tests.frontdoor.conftest import served

HF = "hf_secretTOKEN0123456789"
KEY = "sk-abc123def456"
CONFIG = {
    "name": "guarded",
    "model": "org/guarded",
    "start_timeout_s": 600,
    "extra_args": ["--api-key", KEY],
    "env": {"HF_TOKEN": HF},
}


@pytest.fixture
def talkative(settings, tmp_path, hub_models_in_place):
    script = tmp_path / "python"
    script.write_text(
        '#!/bin/sh\necho "non-default args: $*"\necho "logged in to the hub with $HF_TOKEN"\n'
        'echo "fetching config.json from $HF_ENDPOINT/api/models"\nsleep 600\n'
    )
    script.chmod(0o755)
    return settings.model_copy(update={"engine_python": str(script), "worker_ports": "18350-18360", "stop_grace_s": 2})


def _log_lines(c: TestClient, wid: int, wanted: str) -> list[str]:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        lines = c.get(f"/api/workers/{wid}/logs").json()["lines"]
        if any(wanted in line for line in lines):
            return lines
        time.sleep(0.2)
    raise AssertionError(f"the engine never logged {wanted!r}")


def test_the_starting_event_and_the_log_lines_hide_the_secrets(talkative):
    with TestClient(create_app(talkative)) as c:
        c.post("/api/models", json=CONFIG)
        wid = c.post("/api/workers", json={"model": "guarded"}).json()["id"]
        try:
            lines = _log_lines(c, wid, "logged in to the hub")
            text = "\n".join(lines)
            assert KEY not in text and HF not in text
            # The key went to the engine's environment: its argv, and what prints it, never had it.
            assert "--api-key" not in text and f"logged in to the hub with {MARKER}" in text
            assert any(line.startswith("# argv:") for line in lines)

            events = c.get("/api/events", params={"worker_id": wid}).json()
            assert KEY not in json.dumps(events) and HF not in json.dumps(events)
            starting = next(e for e in events if e["kind"] == "starting")
            assert "--api-key" not in starting["data"]["argv"]
        finally:
            c.post(f"/api/workers/{wid}/stop")


def test_after_a_manager_restart_the_readopted_worker_still_hides_them(talkative):
    with TestClient(create_app(talkative)) as c:
        c.post("/api/models", json=CONFIG)
        worker = c.post("/api/workers", json={"model": "guarded"}).json()
        _log_lines(c, worker["id"], "logged in to the hub")
    try:
        with TestClient(create_app(talkative)) as c:
            assert c.get(f"/api/workers/{worker['id']}").json()["state"] == "starting"  # re-adopted, still running
            text = "\n".join(_log_lines(c, worker["id"], "logged in to the hub"))
            assert KEY not in text and HF not in text and MARKER in text
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(worker["pid"], signal.SIGKILL)


def test_live_subscribers_get_lines_already_hidden(tmp_path):
    path = new_log_file(tmp_path / "w")
    tail = LogTail()
    tail.follow(path, secrets=Redactor(["--api-key", KEY], {"HF_TOKEN": HF}))
    queue = tail.subscribe()
    with path.open("a") as fh:
        fh.write(f"INFO args: {{'api_key': ['{KEY}']}}\nusing token {HF}\nplain line\n")
    tail.poll()
    sent = [queue.get_nowait() for _ in range(3)]
    assert sent == [f"INFO args: {{'api_key': ['{MARKER}']}}", f"using token {MARKER}", "plain line"]
    assert tail.tail(3) == sent


TOKEN = "admin-token-for-tests-" + "t" * 20
AUTH = {"Authorization": f"Bearer {TOKEN}"}
SHORT_KEY = "Q7z"  # too short to be searched for everywhere in a log
HUB_PASSWORD = "hub-pw-9x"
TRACE_PASSWORD = "trace-pw-9x"
SHORT = {
    "name": "short",
    "model": "org/short",
    "start_timeout_s": 600,
    "extra_args": [
        "--api-key",
        SHORT_KEY,
        "--otlp-traces-endpoint",
        f"http://tracer:{TRACE_PASSWORD}@collector.example.com:4317",
    ],
    "env": {"HF_ENDPOINT": f"https://hubuser:{HUB_PASSWORD}@hub.example.com"},
}


def _shows_a_secret(text: str) -> bool:
    return SHORT_KEY in text or HUB_PASSWORD in text or TRACE_PASSWORD in text


def _read_stream(url: str, until: str, got: list[str], timeout_s: float = 30) -> None:
    """Lines of a server-sent event stream into ``got``, until one holds ``until`` (or time is up)."""
    with contextlib.suppress(httpx.HTTPError), httpx.stream("GET", url, timeout=timeout_s) as resp:
        deadline = time.monotonic() + timeout_s
        for line in resp.iter_lines():
            got.append(line)
            if until in line or time.monotonic() > deadline:
                return


def test_open_readers_never_get_a_short_key_or_a_urls_password(talkative):
    # Reads are left open to readers without the token (VLLM_MANAGER_OPEN_READS).
    with served(create_app(talkative.model_copy(update={"api_token": TOKEN, "open_reads": True}))) as url:
        assert httpx.post(f"{url}/api/models", json=SHORT, headers=AUTH).status_code == 201
        events: list[str] = []
        listening = threading.Thread(target=_read_stream, args=(f"{url}/api/events/stream", '"starting"', events))
        listening.start()
        time.sleep(0.5)  # the stream is open before the worker starts
        worker = httpx.post(f"{url}/api/workers", json={"model": "short"}, headers=AUTH).json()
        try:
            listening.join(40)
            deadline = time.monotonic() + 20
            while "fetching config.json" not in (logs := httpx.get(f"{url}/api/workers/{worker['id']}/logs").text):
                assert time.monotonic() < deadline, "the engine never logged the hub it asks"
                time.sleep(0.2)
            log_stream: list[str] = []
            _read_stream(f"{url}/api/workers/{worker['id']}/logs/stream", "fetching config.json", log_stream)
            shown = {
                "log lines": logs,
                "log stream": "\n".join(log_stream),
                "events": httpx.get(f"{url}/api/events", params={"worker_id": worker["id"]}).text,
                "event stream": "\n".join(events),
                "command preview": httpx.get(f"{url}/api/models/short/command", params={"validate": "false"}).text,
                "command page": httpx.get(f"{url}/ui/models/short/command").text,
            }
            assert '"starting"' in shown["event stream"] and "fetching config.json" in shown["log stream"]
            assert {where: _shows_a_secret(text) for where, text in shown.items()} == dict.fromkeys(shown, False)
            assert "tracer" not in shown["log lines"]  # the URL's user part is hidden with its password
            # Token holders still see what they stored.
            assert HUB_PASSWORD in httpx.get(f"{url}/api/models/short", headers=AUTH).text
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(worker["pid"], signal.SIGKILL)


def test_engine_log_files_are_their_users_alone(talkative, tmp_path):
    with TestClient(create_app(talkative)) as c:
        c.post("/api/models", json=CONFIG)
        worker = c.post("/api/workers", json={"model": "guarded"}).json()
        try:
            _log_lines(c, worker["id"], "logged in to the hub")
            log_file = Path(c.get(f"/api/workers/{worker['id']}").json()["log_file"])
            assert stat.S_IMODE(log_file.stat().st_mode) == 0o600
            assert stat.S_IMODE(log_file.parent.stat().st_mode) & 0o077 == 0
        finally:
            c.post(f"/api/workers/{worker['id']}/stop")
    # An engine on another node writes its own file there; a log grown too big keeps its older part.
    elsewhere = tmp_path / "node-b" / "logs" / "start-1.log"
    spawned = process.spawn(["/bin/echo", "engine output"], {}, elsewhere)
    spawned.wait()
    assert stat.S_IMODE(elsewhere.stat().st_mode) == 0o600
    tail = LogTail()
    tail.follow(new_log_file(tmp_path / "w"))
    assert tail.path is not None and stat.S_IMODE(tail.path.stat().st_mode) == 0o600
    tail.path.write_text("x" * 100)
    assert tail.cap_size(limit=10)
    assert stat.S_IMODE(tail.path.with_suffix(".log.1").stat().st_mode) == 0o600
