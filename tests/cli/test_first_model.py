"""README's "First model in five minutes", run as written on this machine: a fresh venv, the
project installed into it, vLLM's CPU build installed by `vllm-manager engine install --cpu`, the
demo model and config, `serve`, and the curl that must get an answer from /v1."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tests.support.engine import stop_leftover_engines

REPO = Path(__file__).resolve().parents[2]
PORT = 7999  # the README's address


def readme_section_blocks() -> list[str]:
    text = (REPO / "README.md").read_text()
    section = text.split("## First model in five minutes", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.*?)```", section, re.S)


def copy_checkout(dest: Path) -> None:
    """What a clone has: tracked files and new ones git does not ignore."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO, capture_output=True, check=True,
    ).stdout.decode().split("\0")  # fmt: skip
    for name in filter(None, listed):
        source = REPO / name
        if source.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)


def port_in_use(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.engine
def test_the_readmes_first_model_section_answers_from_v1(tmp_path):
    install, serve, ask = readme_section_blocks()
    if port_in_use(PORT):
        pytest.fail(f"port {PORT} is taken on this machine; the README's commands use it")
    checkout, home = tmp_path / "vllm-manager", tmp_path / "home"
    checkout.mkdir()
    home.mkdir()
    copy_checkout(checkout)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_MANAGER_", "VIRTUAL_ENV", "PYTHON"))}
    # A newcomer's own home (so a fresh data folder), with pip's download cache kept.
    env.update(HOME=str(home), PIP_CACHE_DIR=str(Path.home() / ".cache" / "pip"))

    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", install], cwd=checkout, env=env, capture_output=True, text=True,
        timeout=1500,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "added model config 'tiny'" in done.stdout

    data_dir = home / ".local" / "share" / "vllm-manager"
    log = (tmp_path / "serve.log").open("wb")
    server = subprocess.Popen(
        ["bash", "-c", serve], cwd=checkout, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{PORT}/api/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.5)
        else:
            pytest.fail("the manager did not answer within 60 s: " + (tmp_path / "serve.log").read_text()[-2000:])
        answer = subprocess.run(["bash", "-c", ask], cwd=checkout, env=env, capture_output=True, text=True,
                                timeout=600)  # fmt: skip
        assert answer.returncode == 0, answer.stderr
        body = json.loads(answer.stdout)
        assert body["model"] == "tiny"
        assert body["choices"][0]["text"] and body["usage"]["completion_tokens"] > 0
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
        log.close()
        stop_leftover_engines(data_dir)
