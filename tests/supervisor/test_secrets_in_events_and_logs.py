"""A worker's events and log lines never show its config's secrets, to anyone (token or not).

The engine interpreter here is a script that prints what a vLLM server would reveal (its arguments,
like vLLM's "non-default args" line, and the Hugging Face token it got) and then sleeps.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time

import pytest
from fastapi.testclient import TestClient

from manager.app import create_app
from manager.launch.secrets import MARKER, Redactor
from manager.supervisor.logs import LogTail, new_log_file

HF = "hf_secretTOKEN0123456789"
KEY = "sk-abc123def456"
CONFIG = {
    "name": "guarded",
    "model": "/models/guarded",
    "start_timeout_s": 600,
    "extra_args": ["--api-key", KEY],
    "env": {"HF_TOKEN": HF},
}


@pytest.fixture
def talkative(settings, tmp_path):
    script = tmp_path / "python"
    script.write_text('#!/bin/sh\necho "non-default args: $*"\necho "logged in to the hub with $HF_TOKEN"\nsleep 600\n')
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
