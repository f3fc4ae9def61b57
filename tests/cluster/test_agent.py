"""A node's agent, called directly (as its Ray actor runs it): engines it starts outlive it."""

from __future__ import annotations

import os
import sys
import time

import psutil

from manager import processes
from manager.cluster.agent import NodeAgent, engine_env


def test_an_engine_gets_the_nodes_environment_without_rays_worker_settings():
    inherited = {"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "", "RAY_JOB_ID": "01", "RAY_ADDRESS": "h:6379"}
    env = engine_env(inherited, {"CUDA_VISIBLE_DEVICES": "0,1", "HF_HOME": "/m"})
    assert env == {"PATH": "/bin", "RAY_ADDRESS": "h:6379", "CUDA_VISIBLE_DEVICES": "0,1", "HF_HOME": "/m"}
    assert "CUDA_VISIBLE_DEVICES" not in engine_env(inherited, {})  # Ray's empty mask hides every GPU


def test_an_engine_started_by_the_agent_is_not_its_child_and_its_log_is_read_back(tmp_path):
    agent = NodeAgent("box2")
    script = "import time; print('engine up', flush=True); time.sleep(60)"
    log = tmp_path / "logs" / "start.log"
    run = tmp_path / "run"
    (run / "stale").mkdir(parents=True)
    spawned = agent.spawn([sys.executable, "-c", script], {}, str(log), str(run))
    try:
        proc = psutil.Process(spawned.pid)
        assert proc.ppid() != os.getpid()  # the launcher exited: the engine outlives whoever asked
        assert os.getsid(spawned.pid) == spawned.pid  # its own session: its group is stopped as one
        assert not (run / "stale").exists()  # a fresh run folder
        assert agent.alive(spawned.pid, spawned.create_time, spawned.cmdline)
        deadline = time.monotonic() + 10
        while b"engine up" not in agent.read_log(str(log), 0) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert agent.read_log(str(log), 0).endswith(b"engine up\n")
        assert agent.read_log(str(log), 3) == b"ine up\n"
        sample = agent.sample({"1": (spawned.pid, str(run))})
        assert sample.trees[spawned.pid].alive and sample.host.ram_total_bytes > 0
    finally:
        report = agent.stop_group(spawned.pid, 5.0)
    assert report.graceful and not processes.alive(spawned.pid)
    assert not agent.alive(spawned.pid, spawned.create_time, spawned.cmdline)


def test_an_engine_that_cannot_start_is_an_os_error_naming_it(tmp_path):
    agent = NodeAgent("box2")
    try:
        agent.spawn(["/nonexistent/python", "-m", "x"], {}, str(tmp_path / "l.log"), str(tmp_path / "run"))
    except OSError as exc:
        assert "/nonexistent/python" in str(exc)
    else:
        raise AssertionError("no error for a missing interpreter")
