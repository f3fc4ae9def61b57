"""``vllm-manager serve`` as its own process on loopback, for tests that need a real manager: pages in a
browser, the CLI, a manager killed and started again."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.support.engine import free_port, stop_leftover_engines


class LiveManager:
    """``vllm-manager serve`` in its own process, so a test can kill it and start it again."""

    def __init__(self, data_dir: Path, log_path: Path, env: dict[str, str] | None = None) -> None:
        self.data_dir = data_dir
        self.env = env or {}  # more settings, over the ones below
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 60.0) -> None:
        env = {
            **os.environ,
            "VLLM_MANAGER_ENGINE_PYTHON": sys.executable,
            "VLLM_MANAGER_WORKER_PORTS": "18200-18299",  # away from a manager on this box
            "VLLM_MANAGER_HEALTH_INTERVAL_S": "1",
            **self.env,
        }
        env.pop("VLLM_MANAGER_API_TOKEN", None)
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "manager",
                    "serve",
                    "--port",
                    str(self.port),
                    "--data-dir",
                    str(self.data_dir),
                ],  # fmt: skip
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the manager exited: see {self.log_path}")
            try:
                if httpx.get(self.url + "/api/metrics", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"the manager did not answer in {timeout} s: see {self.log_path}")

    def kill(self) -> None:
        """Gone at once, as a crash or a lost network would look to the browser."""
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def kill_manager_only(self) -> None:
        """The manager's process alone is gone at once; the processes it started are left to themselves."""
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.kill()
        self.stop_engines()

    def stop_engines(self) -> None:
        """Engines outlive the manager by design; a failed test must not leave one running."""
        stop_leftover_engines(self.data_dir)
