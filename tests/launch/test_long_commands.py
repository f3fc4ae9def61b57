"""Commands as long as a config may make them: checked by vLLM's parser, never a 500."""

from __future__ import annotations

import errno
import subprocess
import sys

import pytest

from manager.launch.validation import validate_engine_argv

# Each argument fits a config's limit; together they are more than one argv element may be (128 KiB).
LONG_ARGS = [a for _ in range(10) for a in ("--chat-template", "{{ messages }}" + " " * 15_000)]


def test_a_long_command_reaches_vllms_parser(client):
    body = {"name": "long", "model": "org/none", "max_model_len": 4096, "extra_args": LONG_ARGS}
    assert client.post("/api/models", json=body).status_code == 201
    resp = client.get("/api/models/long/command")
    assert resp.status_code in (200, 422), resp.text[:300]
    if resp.status_code == 200:
        assert resp.json()["validation"]["status"] in ("valid", "skipped")
    else:
        assert "vLLM" in resp.json()["detail"]


def test_a_command_the_system_cannot_run_is_rejected_with_the_reason(monkeypatch):
    def too_long(*_args, **_kwargs):
        raise OSError(errno.E2BIG, "Argument list too long")

    monkeypatch.setattr(subprocess, "run", too_long)
    result = validate_engine_argv(sys.executable, ["--model", "/m", "--x", "y" * 10], {"HUGE": "v"})
    assert result.status == "rejected"
    assert "too long" in result.message and "extra_args" in result.message


@pytest.mark.parametrize(("argv", "env"), [(["--model", "/m\x00"], {}), (["--model", "/m"], {"A": "x\x00"})])
def test_a_nul_byte_from_an_old_config_is_rejected_not_raised(argv, env):
    result = validate_engine_argv(sys.executable, argv, env)
    assert result.status == "rejected" and "NUL" in result.message
