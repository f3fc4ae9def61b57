"""A plan for a model that is not downloaded: read from the hub (config.json, the safetensors headers by
range reads, the file list), the same to the byte as the plan made once the files are on disk."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from manager.cli import app as cli
from manager.hub.source import read_model
from manager.planner import PlanRequest, make_plan
from tests.support.hub_server import TestHub
from tests.support.tiny_hub_model import NOT_LOADED, SERVED_FILES, SHARDS, big_safetensors

REPO = "acme/tiny-llama"


@pytest.fixture
def hub_env(test_hub: TestHub, tiny_hub_repo: Path, tmp_path: Path, monkeypatch) -> Path:
    """The tiny repo on the test hub, HF_ENDPOINT pointing at it, and an empty cache; returns the cache."""
    test_hub.add_repo_from_folder(REPO, tiny_hub_repo)
    cache = tmp_path / "hf-cache-manager"
    monkeypatch.setenv("HF_ENDPOINT", test_hub.url)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.delenv("HF_HOME", raising=False)
    return cache


def _request() -> PlanRequest:
    return PlanRequest(model=REPO, gpu="h100-80", host_ram_gib=64, max_model_len=4096)


def test_a_model_not_downloaded_is_planned_from_its_headers_as_it_is_once_downloaded(
    test_hub: TestHub, tiny_hub_repo: Path, hub_env: Path
) -> None:
    from huggingface_hub import snapshot_download

    from_hub = make_plan(_request(), read_files=read_model)
    sizes_from_hub = read_model(REPO).weights

    source = from_hub.source
    assert source.kind == "hub" and source.repo == REPO and source.hub == test_hub.url
    assert len(source.commit or "") == 40
    served = sum((tiny_hub_repo / name).stat().st_size for name in SERVED_FILES)
    assert source.download_bytes == served == source.needed_bytes  # what vLLM loads, not the decoys
    assert source.fits_on_disk and source.free_bytes and source.cache_dir == str(hub_env)
    for shard in SHARDS:  # headers only: range reads of a few KB, never a whole shard
        assert 0 < test_hub.bytes_served(REPO, shard) < (tiny_hub_repo / shard).stat().st_size
    assert all(test_hub.bytes_served(REPO, name) == 0 for name in NOT_LOADED)
    assert not (hub_env / "models--acme--tiny-llama").exists()  # nothing left in the cache
    assert any("a download takes" in w for w in from_hub.warnings)

    snapshot_download(REPO, cache_dir=hub_env, endpoint=test_hub.url, allow_patterns=list(SERVED_FILES))
    on_disk = make_plan(_request(), read_files=read_model)

    assert on_disk.source.kind == "cache"
    assert read_model(REPO).weights == sizes_from_hub  # every byte, per dtype, from the headers alone
    assert on_disk.line("weights_total").model_dump() == from_hub.line("weights_total").model_dump()
    assert [line.model_dump() for line in on_disk.lines] == [line.model_dump() for line in from_hub.lines]
    assert on_disk.kv_cache_tokens == from_hub.kv_cache_tokens


def test_the_plan_api_and_cli_read_the_hub_and_say_so(hub_env: Path, client: TestClient) -> None:
    answer = client.post("/api/plan", json=_request().model_dump(exclude_none=True))
    assert answer.status_code == 200, answer.text
    assert answer.json()["source"]["kind"] == "hub"

    out = CliRunner().invoke(cli, ["plan", REPO, "--gpu", "h100-80", "--max-model-len", "4096"])
    assert "read from http://127.0.0.1" in out.output and "a download takes" in out.output, out.output


def test_a_gated_model_is_refused_with_what_to_do(test_hub: TestHub, tiny_hub_repo: Path, hub_env: Path, client):
    test_hub.add_repo_from_folder("acme/gated", tiny_hub_repo, gated=True)

    answer = client.post("/api/plan", json={"model": "acme/gated", "gpu": "h100-80", "max_model_len": 4096})

    assert answer.status_code == 403
    assert "acme/gated is a gated model" in answer.json()["detail"] and "HF_TOKEN" in answer.json()["detail"]


def test_an_unknown_model_is_a_404_and_offline_a_409_that_says_why(hub_env: Path, client, monkeypatch) -> None:
    unknown = client.post("/api/plan", json={"model": "acme/nothing-here", "gpu": "h100-80"})
    assert unknown.status_code == 404 and "no model acme/nothing-here" in unknown.json()["detail"]

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    offline = client.post("/api/plan", json={"model": REPO, "gpu": "h100-80"})
    assert offline.status_code == 409 and "HF_HUB_OFFLINE" in offline.json()["detail"]


def test_a_hub_that_does_not_answer_is_a_502(monkeypatch, client, tmp_path) -> None:
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # discard port: nothing listens
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))

    answer = client.post("/api/plan", json={"model": REPO, "gpu": "h100-80"})

    assert answer.status_code == 502 and "cannot be reached" in answer.json()["detail"]


def test_the_plan_page_says_the_plan_came_from_the_hub_and_offers_the_download(
    test_hub: TestHub, tiny_hub_repo: Path, hub_env: Path, client: TestClient
) -> None:
    page = client.post("/ui/plan", data={"model": REPO, "gpu": "h100-80", "max_model_len": "4096"})

    assert page.status_code == 200
    assert 'data-testid="plan-source"' in page.text and "Read from the hub" in page.text
    assert 'hx-post="/api/downloads"' in page.text  # the disk has room: the page offers the download

    test_hub.add_repo_from_folder("acme/gated", tiny_hub_repo, gated=True)
    refused = client.post("/ui/plan", data={"model": "acme/gated", "gpu": "h100-80", "max_model_len": "4096"})
    assert refused.status_code == 200 and "acme/gated is a gated model" in refused.text


def test_the_plan_warns_when_the_cache_disk_lacks_room_for_the_download(
    test_hub: TestHub, tiny_hub_repo: Path, hub_env: Path, tmp_path: Path, monkeypatch
) -> None:
    config = (tiny_hub_repo / "config.json").read_bytes()
    test_hub.add_repo("acme/big", {"config.json": config, "model.safetensors": big_safetensors(32)})
    small = tmp_path / "small-disk"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(small)], check=True)
    try:
        monkeypatch.setenv("HF_HUB_CACHE", str(small / "hub"))
        plan = make_plan(PlanRequest(model="acme/big", gpu="h100-80", max_model_len=4096), read_files=read_model)
        out = CliRunner().invoke(cli, ["plan", "acme/big", "--gpu", "h100-80", "--max-model-len", "4096"])
    finally:
        subprocess.run(["umount", str(small)], check=True)

    assert plan.source.fits_on_disk is False
    (warning,) = [w for w in plan.warnings if "acme/big at" in w]
    assert "a download needs 0.03 GiB but" in warning and "has only 0.01 GiB free: it would be refused" in warning
    assert str(small / "hub") in warning
    assert "it would be refused" in " ".join(out.output.split()), out.output
