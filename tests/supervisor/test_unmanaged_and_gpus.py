"""Engines the manager did not start, and GPU processes left after a stop."""

from __future__ import annotations

import subprocess
import sys
import time

import pynvml

from manager.host import process
from manager.host.gpu_cleanup import end_gpu_orphans
from manager.metrics.gpu import Nvml
from manager.schemas.common import MARKER
from tests.support.nvml import MIB, FakeNvml


def test_hand_started_server_is_listed_and_can_be_stopped(client):
    # A process whose command line is a hand-started vLLM server's (it only sleeps: discovery
    # works from the command line, and stopping from the process group).
    fake = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import time; time.sleep(120)",
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            "/models/hand-started",
            "--port",
            "18777",
            "--api-key",
            "sk-hand-started-key",
        ],
        start_new_session=True,
    )
    try:
        time.sleep(0.3)
        listed = client.get("/api/workers/unmanaged").json()
        mine = [u for u in listed if u["pid"] == fake.pid]
        assert mine and mine[0]["model"] == "/models/hand-started" and mine[0]["port"] == 18777
        assert mine[0]["cmdline"][-2:] == ["--api-key", MARKER]  # its key is not for every reader
        assert client.post("/api/workers/unmanaged/999999/stop").status_code == 404
        stopped = client.post(f"/api/workers/unmanaged/{fake.pid}/stop")
        assert stopped.status_code == 200 and stopped.json()["leftover"] == []
        assert fake.wait(5) is not None
        assert all(u["pid"] != fake.pid for u in client.get("/api/workers/unmanaged").json())
        kinds = [e["kind"] for e in client.get("/api/events").json()]
        assert "unmanaged_stopped" in kinds
    finally:
        fake.kill()
        fake.wait()


def test_engine_processes_still_on_the_gpu_are_ended_and_others_only_reported(tmp_path):
    straggler = process.spawn([sys.executable, "-c", "import time; time.sleep(60)"], {}, tmp_path / "l.log")
    try:
        nvml = FakeNvml(processes={0: [(straggler.pid, 1200 * MIB), (4242, 500 * MIB)], 1: []})
        notes = end_gpu_orphans([0], [straggler.pid], nvml=Nvml(nvml))
        assert straggler.wait(5) is not None
        assert f"ended pid {straggler.pid} still holding GPU 0" in notes
        assert any("pid 4242" in n and "not ours" in n for n in notes)
    finally:
        straggler.kill()
        straggler.wait()


def test_no_driver_means_nothing_to_check():
    no_driver = Nvml(FakeNvml(init_error=pynvml.NVMLError_LibraryNotFound()))
    assert end_gpu_orphans([0], [1], nvml=no_driver) == []
