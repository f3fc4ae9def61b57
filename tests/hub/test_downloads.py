"""Downloads into the engines' Hugging Face cache from a hub on loopback: only the files vLLM loads, progress
while they come, the disk checked first, cancel and resume, gated repos and offline mode, and one download
for two callers."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from huggingface_hub import hf_hub_download, scan_cache_dir, snapshot_download

from manager.db import make_engine, migrate
from manager.errors import Conflict, Forbidden, InsufficientStorage
from manager.hub.downloads import Downloads
from manager.hub.fetching import FetchFailed
from manager.schemas.download import DownloadState
from tests.support.hub_server import GOOD_TOKEN, TestHub
from tests.support.tiny_hub_model import NOT_LOADED, SERVED_FILES, SHARDS, big_safetensors

REPO = "acme/tiny-llama"
BIG = "acme/big"
MiB = 1024**2


@pytest.fixture
def cache(test_hub: TestHub, tiny_hub_repo: Path, tmp_path: Path, monkeypatch) -> Path:
    test_hub.add_repo_from_folder(REPO, tiny_hub_repo)
    config = (tiny_hub_repo / "config.json").read_bytes()
    test_hub.add_repo(BIG, {"config.json": config, "model.safetensors": big_safetensors(32)})
    folder = tmp_path / "hf-cache"
    monkeypatch.setenv("HF_ENDPOINT", test_hub.url)
    monkeypatch.setenv("HF_HUB_CACHE", str(folder))
    monkeypatch.delenv("HF_HOME", raising=False)
    return folder


@pytest.fixture
def downloads(tmp_path: Path) -> Iterator[tuple[Downloads, list[tuple]]]:
    engine = make_engine(tmp_path / "manager.db")
    migrate(engine)
    events: list[tuple] = []
    yield Downloads(engine, tmp_path / "logs", record=lambda *a, **k: events.append((a, k))), events
    engine.dispose()


def run(coro):
    return asyncio.run(coro)


def cached_files(cache: Path, repo: str) -> set[str]:
    found = [r for r in scan_cache_dir(cache).repos if r.repo_id == repo]
    return {f.file_name if "/" not in str(f.file_path) else str(f.file_path).split("/snapshots/")[1].split("/", 1)[1]
            for r in found for rev in r.revisions for f in rev.files}  # fmt: skip


def test_a_pull_fetches_only_what_vllm_loads_and_records_it(downloads, cache: Path, test_hub: TestHub) -> None:
    manager, events = downloads

    async def pull():
        row = await manager.start(REPO)
        return row, await manager.wait(row.id)

    started, done = run(pull())

    assert started.state in (DownloadState.QUEUED, DownloadState.RUNNING) and started.total_bytes > 0
    assert done.state == DownloadState.DONE and done.done_bytes == done.total_bytes and done.error is None
    assert cached_files(cache, REPO) == set(SERVED_FILES)
    assert all(test_hub.bytes_served(REPO, name) == 0 for name in NOT_LOADED)
    assert not manager.needed(REPO, {})  # a start now finds it complete
    messages = [a[1] for a, _ in events]
    assert messages[0].startswith(f"downloading {REPO}") and messages[-1].startswith(f"downloaded {REPO}")


def test_a_downloaded_model_is_found_offline_as_vllm_looks_for_it(
    downloads, cache: Path, test_hub: TestHub, tiny_hub_repo: Path
) -> None:
    manager, _ = downloads
    # Shards named by the index, which vLLM loads, and one model.safetensors beside them, which it does not.
    files = {p.relative_to(tiny_hub_repo).as_posix(): p for p in tiny_hub_repo.rglob("*") if p.is_file()}
    test_hub.add_repo("acme/two-copies", {**files, "model.safetensors": big_safetensors(1)})
    run(manager.fetch("acme/two-copies", {}))

    # What vLLM 0.32 asks, started with HF_HUB_OFFLINE=1 and no revision: transformers reads the config at
    # main, and the weights come from snapshot_download(allow_patterns="*.safetensors") (the index narrows
    # that only online); vLLM then loads what the index names.
    config = hf_hub_download("acme/two-copies", "config.json", cache_dir=cache, local_files_only=True)
    weights = snapshot_download(
        "acme/two-copies", allow_patterns="*.safetensors", cache_dir=cache, local_files_only=True
    )
    (row,) = manager.list()
    assert Path(config).parent.name == Path(weights).name == row.commit
    assert {p.name for p in Path(weights).glob("*.safetensors")} == set(SHARDS)


def test_progress_is_reported_while_the_bytes_come(downloads, cache: Path, test_hub: TestHub) -> None:
    manager, _ = downloads
    test_hub.set_faults(BIG, rate_bytes_per_s=16 * MiB)  # 32 MiB: about 2 s

    async def pull():
        row = await manager.start(BIG)
        seen = []
        while (now := manager.get(row.id)).state in (DownloadState.QUEUED, DownloadState.RUNNING):
            seen.append((now.done_bytes, manager.progress(BIG, {})))
            await asyncio.sleep(0.1)
        return row, seen, now

    row, seen, done = run(pull())

    partway = {b for b, _ in seen if 0 < b < row.total_bytes}
    assert len(partway) >= 2, seen  # it moved, more than once, before the end
    rated = [p for _, p in seen if p is not None and p.rate_bps]
    assert rated and all(4 * MiB < p.rate_bps < 64 * MiB for p in rated[-3:])  # near the 16 MiB/s served
    assert rated[-1].line("big").startswith("downloading big: ") and "left" in rated[-1].line("big")
    assert done.state == DownloadState.DONE


def test_a_download_larger_than_the_free_disk_is_refused_with_both_numbers(
    downloads, cache: Path, tmp_path: Path, monkeypatch
) -> None:
    manager, _ = downloads
    small = tmp_path / "small-disk"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(small)], check=True)
    try:
        monkeypatch.setenv("HF_HUB_CACHE", str(small / "hub"))
        with pytest.raises(InsufficientStorage) as refused:
            run(manager.start(BIG))
        assert "needs 0.03 GiB more" in refused.value.message and "0.01 GiB free" in refused.value.message
        assert refused.value.status == 507
        assert not (small / "hub").exists() or not any((small / "hub").iterdir())  # not a byte written
        assert manager.list() == []
    finally:
        subprocess.run(["umount", str(small)], check=True)


def test_cancel_keeps_nothing_half_written_and_resume_finishes(downloads, cache: Path, test_hub: TestHub) -> None:
    manager, events = downloads
    test_hub.set_faults(BIG, stall_after_bytes=12 * MiB)

    async def cancel_then_resume():
        row = await manager.start(BIG)
        assert await asyncio.to_thread(test_hub.wait_stalled, 10.0)
        cancelled = await manager.cancel(row.id)
        blobs = list((cache / "models--acme--big" / "blobs").glob("*.incomplete"))
        test_hub.set_faults(BIG)  # the hub serves normally again
        resumed = await manager.resume(row.id)
        return cancelled, blobs, resumed, await manager.wait(row.id)

    cancelled, partial, resumed, done = run(cancel_then_resume())
    test_hub.release()

    assert cancelled.state == DownloadState.CANCELLED and partial == []
    assert resumed.id == cancelled.id and done.state == DownloadState.DONE
    assert "cancelled at" in " ".join(a[1] for a, _ in events)
    with pytest.raises(Conflict):
        run(manager.cancel(done.id))


def test_a_gated_repo_needs_its_token(downloads, cache: Path, test_hub: TestHub, tiny_hub_repo: Path, monkeypatch):
    manager, _ = downloads
    test_hub.add_repo_from_folder("acme/gated", tiny_hub_repo, gated=True)

    with pytest.raises(Forbidden) as refused:
        run(manager.start("acme/gated"))  # the listing is public and says gated: no download is made
    assert "gated" in refused.value.message and "HF_TOKEN" in refused.value.message

    with pytest.raises(FetchFailed) as failed:
        run(manager.fetch("acme/gated", {}))
    assert "HF_TOKEN" in str(failed.value)

    run(manager.fetch("acme/gated", {"HF_TOKEN": GOOD_TOKEN}))  # a config's own token
    assert cached_files(cache, "acme/gated") == set(SERVED_FILES)


def test_offline_the_manager_never_contacts_the_hub(downloads, cache: Path, test_hub: TestHub, monkeypatch) -> None:
    manager, _ = downloads
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    test_hub.clear_requests()

    with pytest.raises(Conflict) as refused:
        run(manager.start(REPO))

    assert "HF_HUB_OFFLINE" in refused.value.message and test_hub.requests == []


def test_two_callers_share_one_download(downloads, cache: Path, test_hub: TestHub) -> None:
    manager, _ = downloads
    test_hub.set_faults(BIG, rate_bytes_per_s=32 * MiB)

    async def both():
        first = await manager.start(BIG)
        await asyncio.gather(manager.fetch(BIG, {}), manager.fetch(BIG, {}))
        return first

    first = run(both())

    assert [d.id for d in manager.list()] == [first.id]
    assert test_hub.bytes_served(BIG, "model.safetensors") == len(big_safetensors(32))  # fetched once


def test_a_download_under_way_goes_on_after_a_restart(tmp_path: Path, cache: Path, test_hub: TestHub) -> None:
    engine = make_engine(tmp_path / "manager.db")
    migrate(engine)
    test_hub.set_faults(BIG, stall_after_bytes=12 * MiB)

    async def stop_midway():
        first = Downloads(engine, tmp_path / "logs")
        row = await first.start(BIG)
        assert await asyncio.to_thread(test_hub.wait_stalled, 10.0)
        await first.close()  # the manager stops: the row stays unfinished
        return row

    row = run(stop_midway())
    test_hub.release()
    test_hub.set_faults(BIG)

    async def start_again():
        second = Downloads(engine, tmp_path / "logs")
        await second.open()
        return await second.wait(row.id)

    done = run(start_again())
    assert done.state == DownloadState.DONE and done.id == row.id
    engine.dispose()


def test_a_connection_dropped_half_way_is_taken_up_again(downloads, cache: Path, test_hub: TestHub) -> None:
    manager, _ = downloads
    test_hub.set_faults(BIG, drop_after_bytes=15 * MiB)

    async def pull():
        row = await manager.start(BIG)
        return await manager.wait(row.id)

    done = run(pull())

    assert done.state == DownloadState.DONE
    assert any(r.range and not r.range.startswith("bytes=0-") for r in test_hub.requests)  # resumed, not restarted


def test_a_hub_that_stops_sending_is_asked_again_and_a_hub_gone_fails_the_download_with_a_reason(
    downloads, cache: Path, test_hub: TestHub, monkeypatch
) -> None:
    manager, _ = downloads
    monkeypatch.setenv("HF_HUB_DOWNLOAD_TIMEOUT", "1")  # the download process's read timeout
    test_hub.set_faults(BIG, stall_after_bytes=12 * MiB)  # once: the request after the timeout is served

    async def pull():
        row = await manager.start(BIG)
        return await asyncio.wait_for(manager.wait(row.id), 60)

    assert run(pull()).state == DownloadState.DONE
    test_hub.release()

    test_hub.add_repo("acme/big-2", {"config.json": b"{}", "model.safetensors": big_safetensors(32)})
    test_hub.set_faults("acme/big-2", stall_after_bytes=12 * MiB)

    async def hub_goes_away():
        row = await manager.start("acme/big-2")
        assert await asyncio.to_thread(test_hub.wait_stalled, 10.0)
        test_hub.close()
        return await asyncio.wait_for(manager.wait(row.id), 90)

    failed = run(hub_goes_away())

    assert failed.state == DownloadState.FAILED
    assert failed.error and "acme/big-2" in failed.error, failed.error
    assert not list((cache / "models--acme--big-2" / "blobs").glob("*.incomplete"))


def test_a_gated_download_carried_on_after_a_restart_gets_the_token_of_the_start_that_rejoins_it(
    tmp_path: Path, cache: Path, test_hub: TestHub
) -> None:
    engine = make_engine(tmp_path / "manager.db")
    migrate(engine)
    config = {"config.json": b"{}", "model.safetensors": big_safetensors(32)}
    test_hub.add_repo("acme/gated-big", config, gated=True)
    test_hub.set_faults("acme/gated-big", stall_after_bytes=12 * MiB)
    own_token = {"HF_TOKEN": GOOD_TOKEN}  # the config's env: the manager itself has none

    async def stop_midway():
        first = Downloads(engine, tmp_path / "logs")
        row = await first.start("acme/gated-big", None, own_token)
        assert await asyncio.to_thread(test_hub.wait_stalled, 10.0)
        await first.close()
        return row

    row = run(stop_midway())
    test_hub.set_faults("acme/gated-big", rate_bytes_per_s=16 * MiB)
    test_hub.release()

    async def start_again():
        second = Downloads(engine, tmp_path / "logs")
        await second.open()  # goes on at once, without the token (it is never stored)
        await second.fetch("acme/gated-big", own_token)  # the worker's start, rejoining it
        return second.list()

    rows = run(start_again())
    assert [(r.id, r.state) for r in rows] == [(row.id, DownloadState.DONE)]
    assert cached_files(cache, "acme/gated-big") == {"config.json", "model.safetensors"}
    engine.dispose()


def test_a_stalled_download_shows_its_rate_falling_not_its_last_speed(downloads, cache: Path, test_hub: TestHub):
    manager, _ = downloads
    test_hub.set_faults(BIG, rate_bytes_per_s=16 * MiB, stall_after_bytes=22 * MiB)

    async def watch():
        row = await manager.start(BIG)
        flowing = None
        while not test_hub.wait_stalled(0.0):
            flowing = manager.rate(row.id) or flowing
            await asyncio.sleep(0.2)
        await asyncio.sleep(4.0)
        stalled = manager.rate(row.id)
        progress = manager.progress(BIG, {})
        await manager.cancel(row.id)
        return flowing, stalled, progress

    flowing, stalled, progress = run(watch())
    test_hub.release()

    assert flowing and flowing > 4 * MiB
    assert stalled is not None and stalled < flowing / 2, (flowing, stalled)
    assert progress is not None
    left_at_full_speed = (progress.total_bytes - progress.done_bytes) / flowing
    assert progress.eta_s is None or progress.eta_s > 2 * left_at_full_speed  # the time left grows


@pytest.mark.parametrize("stop", ["cancel", "restart"])
def test_files_complete_before_a_stop_are_not_fetched_again(tmp_path: Path, cache: Path, test_hub: TestHub, stop):
    engine = make_engine(tmp_path / "manager.db")
    migrate(engine)
    first, second = big_safetensors(8), big_safetensors(24)  # different sizes: different blobs
    shards = {"model-00001-of-00002.safetensors": first, "model-00002-of-00002.safetensors": second}
    commit = test_hub.add_repo("acme/two-shards", {"config.json": b"{}", **shards})
    test_hub.set_faults("acme/two-shards", stall_after_bytes=4 * MiB, files=["*00002-of-00002*"])
    snapshot = cache / "models--acme--two-shards" / "snapshots" / commit

    async def stop_midway():
        manager = Downloads(engine, tmp_path / "logs")
        row = await manager.start("acme/two-shards")
        assert await asyncio.to_thread(test_hub.wait_stalled, 10.0)
        for _ in range(100):  # the first shard comes whole while the second one stalls
            if (snapshot / "model-00001-of-00002.safetensors").is_file():
                break
            await asyncio.sleep(0.1)
        if stop == "cancel":
            await manager.cancel(row.id)
        else:
            await manager.close()
        return manager, row

    manager, row = run(stop_midway())
    test_hub.set_faults("acme/two-shards")
    test_hub.release()

    async def go_on():
        if stop == "cancel":
            await manager.resume(row.id)
            return await manager.wait(row.id)
        again = Downloads(engine, tmp_path / "logs")
        await again.open()
        return await again.wait(row.id)

    done = run(go_on())
    engine.dispose()

    assert done.state == DownloadState.DONE
    assert test_hub.bytes_served("acme/two-shards", "model-00001-of-00002.safetensors") == len(first)
    assert (snapshot / "model-00002-of-00002.safetensors").stat().st_size == len(second)


def fetch_processes_of_this_test() -> list[Path]:
    """The /proc folders of the download processes this test's manager started."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            parent = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if parent == os.getpid() and b"manager.hub.fetch_process" in (proc / "cmdline").read_bytes():
                found.append(proc)
        except (OSError, ValueError, IndexError):  # not a process, or gone meanwhile
            continue
    return found


def test_the_token_reaches_the_download_process_only_through_its_environment(
    downloads, cache: Path, tmp_path: Path, test_hub: TestHub
) -> None:
    manager, events = downloads
    test_hub.add_repo("acme/gated-big", {"config.json": b"{}", "model.safetensors": big_safetensors(16)}, gated=True)
    test_hub.set_faults("acme/gated-big", stall_after_bytes=4 * MiB)

    async def pull():
        row = await manager.start("acme/gated-big", None, {"HF_TOKEN": GOOD_TOKEN})
        assert await asyncio.to_thread(test_hub.wait_stalled, 10.0)
        (proc,) = fetch_processes_of_this_test()
        seen = (proc / "cmdline").read_bytes(), (proc / "environ").read_bytes().split(b"\0")
        test_hub.release()
        return seen, await manager.wait(row.id)

    (argv, environ), done = run(pull())

    assert f"HF_TOKEN={GOOD_TOKEN}".encode() in environ  # the process that was looked at is the one with it
    assert GOOD_TOKEN.encode() not in argv
    assert done.state == DownloadState.DONE
    assert events and GOOD_TOKEN not in repr(events)
    logs = list((tmp_path / "logs" / "downloads").glob("*.log"))
    assert logs and all(GOOD_TOKEN not in log.read_text() for log in logs)


def test_a_wrong_token_refused_on_the_files_names_the_repo_and_the_token(
    downloads, cache: Path, tmp_path: Path, test_hub: TestHub, tiny_hub_repo: Path
) -> None:
    manager, events = downloads
    # Their listings are public: the files answer 401. The sharded one's index is read before the download
    # starts; the other one's first file is asked for by the download process.
    test_hub.add_repo_from_folder("acme/gated", tiny_hub_repo, gated=True)
    test_hub.add_repo("acme/gated-big", {"config.json": b"{}", "model.safetensors": big_safetensors(4)}, gated=True)
    wrong = "hf_not_a_token_of_this_hub"

    messages = []
    for repo in ("acme/gated", "acme/gated-big"):
        with pytest.raises(FetchFailed) as failed:
            run(manager.fetch(repo, {"HF_TOKEN": wrong}))
        messages.append(str(failed.value))
        assert re.search(f"refused the HF_TOKEN given for {repo} \\(40[13]\\)", messages[-1]), messages[-1]

    (row,) = manager.list()
    assert row.repo == "acme/gated-big" and row.state == DownloadState.FAILED and row.error == messages[-1]
    assert any(r.path.startswith("/acme/gated-big/resolve/") for r in test_hub.requests)  # asked for a file
    assert wrong not in repr(messages) and wrong not in repr(events)
    assert all(wrong not in log.read_text() for log in (tmp_path / "logs" / "downloads").glob("*.log"))


def test_a_pull_of_a_tag_or_an_older_commit_lands_that_commit(
    downloads, cache: Path, test_hub: TestHub, tiny_hub_repo: Path
) -> None:
    manager, _ = downloads
    config = (tiny_hub_repo / "config.json").read_bytes()
    old = test_hub.add_repo("acme/versions", {"config.json": config, "model.safetensors": big_safetensors(1)})
    test_hub.tag("acme/versions", "v1.0", old)
    new = test_hub.add_repo("acme/versions", {"config.json": config, "model.safetensors": big_safetensors(2)})
    repo_folder = cache / "models--acme--versions"

    async def pull(revision: str):
        row = await manager.start("acme/versions", revision)
        return await manager.wait(row.id)

    tagged = run(pull("v1.0"))

    assert old != new and tagged.state == DownloadState.DONE and tagged.commit == old
    assert (repo_folder / "refs" / "v1.0").read_text() == old  # found offline by its tag
    assert not (repo_folder / "refs" / "main").exists()
    weights = repo_folder / "snapshots" / old / "model.safetensors"
    assert weights.read_bytes() == big_safetensors(1)
    assert hf_hub_download("acme/versions", "config.json", revision="v1.0", cache_dir=cache, local_files_only=True)

    shutil.rmtree(repo_folder)
    by_commit = run(pull(old))

    assert by_commit.state == DownloadState.DONE and by_commit.commit == old
    assert (repo_folder / "snapshots" / old / "model.safetensors").read_bytes() == big_safetensors(1)
    assert not (repo_folder / "snapshots" / new).exists() and not (repo_folder / "refs" / "main").exists()
