"""Downloads on the Models on disk page, through the real app and a hub on loopback: the section at first
load, the form that starts one or says in place why not, and a model that a download writes into, which
is not deleted under it."""

from __future__ import annotations

import html as markup
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from manager.app import create_app
from tests.hub.test_downloads import big_safetensors
from tests.support.hub_server import TestHub

PAGE = {"Accept": "text/html"}
SMALL = "acme/tiny-llama"
BIG = "acme/big"
GATED = "acme/gated"
MiB = 1024**2


@pytest.fixture
def cache(test_hub: TestHub, tiny_hub_repo: Path, tmp_path: Path, monkeypatch) -> Path:
    test_hub.add_repo_from_folder(SMALL, tiny_hub_repo)
    test_hub.add_repo_from_folder(GATED, tiny_hub_repo, gated=True)
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


def section(html: str) -> str:
    found = re.search(r'<section id="downloads">(.*?)</section>', html, re.S)
    assert found is not None, html
    return found.group(1)


def form_errors(html: str) -> dict[str, str]:
    found = re.findall(r'data-field="([^"]+)"[^>]*>(.*?)</p>', html, re.S)
    return {name: markup.unescape(" ".join(text.split())) for name, text in found}


def test_the_page_has_the_form_and_the_table_of_downloads_from_its_first_load(client, cache):
    html = client.get("/disk", headers=PAGE).text
    assert 'sse-connect="/api/metrics/stream?view=disk"' in html
    assert 'hx-trigger="sse:disk-changed"' in html  # the list of models reloads when a download ends
    downloads = section(html)
    assert 'hx-post="/ui/disk/downloads"' in downloads and 'name="repo"' in downloads and 'name="revision"' in downloads
    assert re.search(
        r'<div id="downloads-table" sse-swap="downloads">\s*<p class="muted" data-testid="no-downloads">', downloads
    )

    started = client.post("/api/downloads", json={"repo": SMALL})
    assert started.status_code == 202, started.text
    assert finished(client, started.json()["id"])["state"] == "done"

    html = client.get("/disk", headers=PAGE).text
    row = re.search(rf'<tr data-download="{started.json()["id"]}" data-state="done">(.*?)</tr>', section(html), re.S)
    assert row is not None and f"<code>{SMALL}</code>" in row.group(1) and ">100 %<" in row.group(1)
    assert "Cancel" not in row.group(1) and "Resume" not in row.group(1)  # nothing left to do with it
    assert f'<tr data-repo="{SMALL}">' in html  # and the cache lists it


def test_the_form_starts_a_download_or_says_in_place_why_not(client, cache, test_hub, tmp_path, monkeypatch):
    bad = client.post("/ui/disk/downloads", data={"repo": "tiny-llama", "revision": ""})
    assert bad.status_code == 200
    assert "'tiny-llama' is not a Hugging Face model id: give it as owner/name" in form_errors(bad.text)["repo"]
    assert 'value="tiny-llama"' in bad.text  # what the user typed stays

    revision = client.post("/ui/disk/downloads", data={"repo": SMALL, "revision": "-x"})
    assert "'-x' is not a branch, tag or commit" in form_errors(revision.text)["revision"]

    missing = client.post("/ui/disk/downloads", data={"repo": "acme/nope"})
    assert f"no model acme/nope on {test_hub.url}" in form_errors(missing.text)["_form"]

    gated = client.post("/ui/disk/downloads", data={"repo": GATED})
    assert f"{GATED} is a gated model: accept its licence" in form_errors(gated.text)["_form"]
    assert "HF_TOKEN" in form_errors(gated.text)["_form"]

    small = tmp_path / "small-disk"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(small)], check=True)
    try:
        monkeypatch.setenv("HF_HUB_CACHE", str(small / "hub"))
        full = client.post("/ui/disk/downloads", data={"repo": BIG})
    finally:
        subprocess.run(["umount", str(small)], check=True)
    assert re.match(
        rf"{BIG} needs 0\.03 GiB more in {re.escape(str(small / 'hub'))}, but its disk has 0\.01 GiB free: free some",
        form_errors(full.text)["_form"],
    )
    assert client.get("/api/downloads").json() == []  # none of those started a download

    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    started = client.post("/ui/disk/downloads", data={"repo": SMALL, "revision": "main"})
    [row] = client.get("/api/downloads").json()
    assert re.search(
        rf'data-testid="download-started">Download {row["id"]}: {SMALL} \([\d.]+ [KM]iB\) into {re.escape(str(cache))}, '
        "progress below.</p>",
        started.text,
    )
    assert 'name="repo" value=""' in " ".join(started.text.split())  # the form is ready for the next
    assert finished(client, row["id"])["state"] == "done"


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


def test_the_form_follows_the_pages_rules_once_a_token_exists(settings, cache):
    token = "a-long-enough-admin-token-" + "t" * 20
    with TestClient(create_app(settings.model_copy(update={"api_token": token}))) as c:
        assert c.post("/ui/disk/downloads", data={"repo": SMALL}).status_code == 401
        assert c.post("/login", data={"token": token, "next": "/disk"}, follow_redirects=False).status_code == 303
        unproven = c.post("/ui/disk/downloads", data={"repo": SMALL})  # a session, but no Origin
        assert unproven.status_code == 403 and "this manager's own pages" in unproven.json()["detail"]
        other = c.post("/ui/disk/downloads", data={"repo": SMALL}, headers={"Origin": "https://attacker.example"})
        assert other.status_code == 403
        assert c.get("/api/downloads").json() == []  # none of those started one

        own = c.post("/ui/disk/downloads", data={"repo": SMALL}, headers={"Origin": "http://testserver"})
        assert 'data-testid="download-started"' in own.text
        [row] = c.get("/api/downloads").json()
        assert finished(c, row["id"])["state"] == "done"
