"""A config's engine API key reaches the engine through its environment, never its command line."""

from __future__ import annotations

import pytest

from manager.errors import Invalid
from manager.launch.command import build_command, inherited_env
from manager.launch.engine_key import bearer, engine_key
from manager.schemas.model_config import ModelConfig

KEY = "sk-engine-only-7f3a"


def _build(extra_args: list[str], env: dict[str, str] | None = None):
    config = ModelConfig(name="keyed", model="/models/llama", extra_args=extra_args, env=env or {})
    return build_command(config, None, engine_python="/opt/engine/bin/python", port=8001)


@pytest.mark.parametrize(
    "extra_args",
    [
        ["--api-key", KEY, "--seed", "7"],
        [f"--api-key={KEY}", "--seed", "7"],
        ["--api_key", KEY, "--seed", "7"],  # vLLM reads underscores as dashes
        ["--api-k", KEY, "--seed", "7"],  # and an unambiguous prefix as the whole flag
        ["--seed", "7", "--api-key", KEY],
    ],
)
def test_every_spelling_of_the_flag_moves_the_key_to_the_environment(extra_args):
    cmd = _build(extra_args)
    assert KEY not in " ".join(cmd.argv)
    assert not any(arg.startswith("--api") for arg in cmd.argv)
    assert cmd.argv[-2:] == ["--seed", "7"] and cmd.env["VLLM_API_KEY"] == KEY


def test_a_key_in_env_stays_there_and_the_flag_wins_over_it_as_in_vllm():
    assert _build([], {"VLLM_API_KEY": KEY}).env["VLLM_API_KEY"] == KEY
    cmd = _build(["--api-key", "sk-from-the-flag"], {"VLLM_API_KEY": KEY})
    assert cmd.env["VLLM_API_KEY"] == "sk-from-the-flag" and "sk-from-the-flag" not in cmd.argv
    # An empty --api-key turns vLLM's check off, whatever VLLM_API_KEY says.
    assert "VLLM_API_KEY" not in _build(["--api-key="], {"VLLM_API_KEY": KEY}).env
    assert "VLLM_API_KEY" not in _build(["--seed", "7"]).env


def test_the_last_flag_given_is_the_one_vllm_reads():
    assert engine_key(["--api-key", "first", "--api-key", "second"], {}) == "second"


def test_two_keys_are_refused_with_what_to_do():
    with pytest.raises(Invalid) as refused:
        _build(["--api-key", KEY, "sk-second"])
    assert "2 keys" in refused.value.message and "VLLM_API_KEY" in refused.value.message


def test_flags_that_only_start_like_it_keep_their_place():
    cmd = _build(["--api-server-count", "2"])
    assert cmd.argv[-2:] == ["--api-server-count", "2"] and "VLLM_API_KEY" not in cmd.env


def test_the_managers_own_key_variable_does_not_reach_engines(monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", "the-managers-shell-key")
    assert "VLLM_API_KEY" not in inherited_env()


def test_the_header_the_managers_calls_carry():
    assert bearer(KEY) == {"Authorization": f"Bearer {KEY}"}
    assert bearer(None) == {} and bearer("") == {}
