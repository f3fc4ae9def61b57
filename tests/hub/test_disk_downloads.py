"""Downloads and the Models on disk page, through the real app and a hub on loopback: a model that a
download writes into is not deleted under it."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from manager.app import create_app
from tests.hub.test_downloads import big_safetensors
from tests.support.hub_server import TestHub

SMALL = "acme/tiny-llama"
BIG = "acme/big"
MiB = 1024**2


@pytest.fixture
def cache(test_hub: TestHub, tiny_hub_repo: Path, tmp_path: Path, monkeypatch) -> Path:
    test_hub.add_repo_from_folder(SMALL, tiny_hub_repo)
    config = (tiny_hub_repo / "config.json").read_bytes()
    test_hub.add_repo(BIG, {"config.json": config, "model.safetensors": big_safetensors(32)})
    folder = tmp_path / "hf-cache"
    monkeypatch.setenv("HF_ENDPOINT", test_hub.url)
    monkeypatch.setenv("HF_HUB_CACHE", str(folder))
    monkeypatch.delenv("HF_HOME", raising=False)
    return folder


@pytest.fixture
def client(settings, cache) -> Iterator[TestClient]:
    with TestClient(create_app(settings)) as c:
        yield c


def finished(client: TestClient, download_id: int, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        row = client.get(f"/api/downloads/{download_id}").json()
        if row["state"] not in ("queued", "running"):
            return row
        time.sleep(0.1)
    raise AssertionError(f"download {download_id} still {row['state']} after {timeout} s")


def test_a_model_is_not_deleted_while_a_download_writes_into_it(client, cache, test_hub):
    test_hub.set_faults(BIG, stall_after_bytes=12 * MiB)
    started = client.post("/api/downloads", json={"repo": BIG}).json()
    assert test_hub.wait_stalled(10.0)

    refused = client.delete(f"/api/cache/{BIG}")
    assert refused.status_code == 409, refused.text
    assert re.match(
        rf"{BIG} is being downloaded into {re.escape(str(cache))} \(download {started['id']}, running, \d+ %\): "
        "cancel the download or let it finish",
        refused.json()["detail"],
    )
    page = client.post("/ui/disk/delete", data={"repo": BIG, "cache": str(cache)})
    assert re.search(rf'data-testid="disk-error">{BIG} is being downloaded into', page.text)
    assert (cache / "models--acme--big").is_dir()

    assert client.post(f"/api/downloads/{started['id']}/cancel").json()["state"] == "cancelled"
    test_hub.release()
    deleted = client.delete(f"/api/cache/{BIG}")
    assert deleted.status_code == 200, deleted.text
    assert not (cache / "models--acme--big").exists()
