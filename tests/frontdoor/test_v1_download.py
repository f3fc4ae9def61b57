"""/v1 for a model that is being downloaded, through the whole manager with stand-in engines (no vLLM)
and stand-in downloads (tests.support.downloads) that end when the test says so."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from manager.app import create_app
from tests.frontdoor.conftest import two_models
from tests.support.downloads import Downloads, use_downloads

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


@pytest.fixture
def downloads(monkeypatch) -> Downloads:
    return use_downloads(monkeypatch, Downloads())


def manager(settings, **extra: dict) -> Iterator[TestClient]:
    with TestClient(create_app(settings)) as client:
        two_models(client, **extra)
        yield client


@pytest.fixture
def door(door_settings, downloads) -> Iterator[TestClient]:
    yield from manager(door_settings)


@pytest.fixture
def patient_door(door_settings, downloads) -> Iterator[TestClient]:
    yield from manager(door_settings, a={"wait_for_download": True})


def worker_of(client: TestClient, model: str) -> dict:
    return next(w for w in client.get("/api/workers").json() if w["model"] == model)


def wait_until(check: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition never became true"
        time.sleep(0.05)


def test_a_request_while_the_model_downloads_is_a_503_saying_how_far_with_retry_after(door, downloads):
    resp = door.post("/v1/chat/completions", json={"model": "alpha", **CHAT})
    assert resp.status_code == 503, resp.text
    assert resp.headers["Retry-After"] == "60"  # 66 s left, asked again within a minute
    assert resp.json()["error"] == {
        "message": "downloading a: 34 %, about 66 s left",
        "type": "server_error",
        "param": None,
        "code": "model_downloading",
    }
    worker = worker_of(door, "a")
    assert worker["state"] == "downloading" and worker["download"]["percent"] == 34
    listed = {m["id"]: m["state"] for m in door.get("/v1/models").json()["data"]}
    assert listed["a"] == "downloading"

    # Asked again while it downloads: the same answer, and the same one download.
    again = door.post("/v1/chat/completions", json={"model": "a", **CHAT})
    assert again.status_code == 503 and again.headers["Retry-After"] == "60"
    assert len(downloads.waits) == 1

    door.portal.call(downloads.finish.set)
    wait_until(lambda: worker_of(door, "a")["state"] == "ready")
    assert door.post("/v1/chat/completions", json={"model": "a", **CHAT}).status_code == 200


def test_a_model_that_waits_for_its_download_answers_once_downloaded_and_started(patient_door, downloads):
    answer: dict[str, Any] = {}

    def ask() -> None:
        answer["resp"] = patient_door.post("/v1/chat/completions", json={"model": "a", **CHAT})

    asking = threading.Thread(target=ask)
    asking.start()
    wait_until(lambda: bool(patient_door.get("/api/workers").json()))
    assert worker_of(patient_door, "a")["state"] == "downloading"
    time.sleep(0.3)
    assert "resp" not in answer  # still waiting: no 503
    patient_door.portal.call(downloads.finish.set)
    asking.join(60)
    assert answer["resp"].status_code == 200, answer["resp"].text


@pytest.fixture
def beside_a_model_on_disk(door_settings, downloads, tmp_path) -> Iterator[TestClient]:
    """a is a hub model that is not downloaded; b, on the same GPU, is a folder on this machine."""
    yield from manager(door_settings, b={"model": str(tmp_path)})


def test_a_model_being_downloaded_takes_the_gpu_of_another_only_once_downloaded(beside_a_model_on_disk, downloads):
    door = beside_a_model_on_disk
    assert door.post("/v1/chat/completions", json={"model": "b", **CHAT}).status_code == 200
    assert door.post("/v1/chat/completions", json={"model": "a", **CHAT}).status_code == 503
    # b goes on serving while a downloads.
    assert worker_of(door, "b")["state"] == "ready" and worker_of(door, "a")["state"] == "downloading"
    assert door.post("/v1/chat/completions", json={"model": "b", **CHAT}).status_code == 200

    door.portal.call(downloads.finish.set)
    wait_until(lambda: worker_of(door, "a")["state"] == "ready")
    assert worker_of(door, "b")["state"] == "stopped"  # stopped before a's engine started
    evicted = [e["message"] for e in door.get("/api/events").json() if e["kind"] == "evicted"]
    assert evicted == ["stopped b to make room for a"]


def test_the_command_preview_says_how_a_start_meets_its_hub_model(door, downloads):
    missing = door.get("/api/models/a/command", params={"validate": False}).json()
    assert "HF_HUB_OFFLINE" not in missing["env"]
    assert any("org/a is downloaded from the Hugging Face Hub before vLLM starts" in n for n in missing["notes"])
    downloads.missing = False
    complete = door.get("/api/models/a/command", params={"validate": False}).json()
    assert complete["env"]["HF_HUB_OFFLINE"] == "1"
    assert any(n.startswith("HF_HUB_OFFLINE=1: org/a is complete") for n in complete["notes"])


def test_the_openapi_document_declares_retry_after_on_v1_503s(door):
    responses = door.get("/openapi.json").json()["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert "Retry-After" in responses["503"]["headers"]
    assert "downloaded" in responses["503"]["description"]
