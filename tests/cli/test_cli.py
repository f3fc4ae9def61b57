"""The `vllm-manager` command: serve safety, tokens, export/import, durability across kill -9."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

CLI = [sys.executable, "-m", "manager"]


def _run(args, data_dir: Path, **env) -> subprocess.CompletedProcess:
    return subprocess.run(
        CLI + args + ["--data-dir", str(data_dir)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "VLLM_MANAGER_API_TOKEN": "", **env},
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(data_dir: Path, port: int, *extra: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        CLI + ["serve", "--port", str(port), "--data-dir", str(data_dir), *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "VLLM_MANAGER_API_TOKEN": "", **(env or {})},
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/api/health", timeout=1).status_code == 200:
                return proc
        except httpx.TransportError:
            time.sleep(0.2)
        if proc.poll() is not None:
            raise AssertionError(proc.communicate()[0])
    proc.kill()
    raise AssertionError("the manager did not answer within 60 s")


def test_public_bind_without_token_is_refused(tmp_path):
    result = _run(["serve", "--host", "0.0.0.0", "--port", str(_free_port())], tmp_path)
    assert result.returncode == 2
    assert "token create" in result.stderr


def test_the_line_per_request_can_be_turned_off(tmp_path):
    for env, logged in (({}, True), ({"VLLM_MANAGER_ACCESS_LOG": "0"}, False)):
        port = _free_port()
        proc = _serve(tmp_path, port, env=env)
        try:
            assert httpx.get(f"http://127.0.0.1:{port}/api/profiles").status_code == 200
        finally:
            proc.terminate()
            output = proc.communicate(timeout=10)[0]
        assert ('"GET /api/profiles HTTP/1.1" 200' in output) is logged, output
        assert "Application startup complete" in output  # the rest of the log stays


def test_with_forwarders_a_port_in_use_ends_the_start_with_one_clear_line(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = _run(["serve", "--port", str(port)], tmp_path, VLLM_MANAGER_FORWARDERS="2")
    assert result.returncode == 3
    assert f"cannot listen on 127.0.0.1:{port}" in result.stderr and "Address already in use" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_second_manager_with_forwarders_cannot_share_the_port_of_the_first(tmp_path):
    port = _free_port()
    first = _serve(tmp_path / "first", port, env={"VLLM_MANAGER_FORWARDERS": "1"})
    try:
        # SO_REUSEPORT would let its forwarders bind beside the first's: the manager refuses instead.
        second = _run(["serve", "--port", str(port)], tmp_path / "second", VLLM_MANAGER_FORWARDERS="1")
        assert second.returncode == 3
        assert "another vllm-manager with forwarders serves" in second.stderr
    finally:
        first.send_signal(signal.SIGINT)
        first.communicate(timeout=60)


def test_token_create_prints_once_and_guards_the_api(tmp_path):
    created = _run(["token", "create"], tmp_path)
    assert created.returncode == 0, created.stderr
    token = created.stdout.strip()
    assert token.startswith("vmt_") and "not shown again" in created.stderr
    port = _free_port()
    proc = _serve(tmp_path, port)
    try:
        url = f"http://127.0.0.1:{port}/api/profiles"
        auth = {"Authorization": f"Bearer {token}"}
        assert httpx.post(url, json={"name": "p"}).status_code == 401
        assert httpx.post(url, json={"name": "p"}, headers=auth).status_code == 201
        assert httpx.get(url).status_code == 401  # reading needs it too
        assert httpx.get(url, headers=auth).json()[0]["name"] == "p"
        page = httpx.get(f"http://127.0.0.1:{port}/models", headers={"Accept": "text/html"})
        assert page.status_code == 303 and page.headers["location"] == "/login?next=/models"
        # The CLI says how to give it the token, not to log in on a page.
        ps = [*CLI, "ps", "--url", f"http://127.0.0.1:{port}"]
        refused = subprocess.run(ps, capture_output=True, text=True, timeout=60,
                                 env={**os.environ, "VLLM_MANAGER_API_TOKEN": ""})  # fmt: skip
        assert refused.returncode == 1 and "--token" in refused.stderr and "VLLM_MANAGER_API_TOKEN" in refused.stderr
        listed = subprocess.run([*ps, "--token", token], capture_output=True, text=True, timeout=60)
        assert listed.returncode == 0 and listed.stdout.split()[:3] == ["id", "state", "model"]
    finally:
        proc.terminate()
        proc.wait(10)
    proc = _serve(tmp_path, port, "--open-reads")
    try:
        assert httpx.get(url).status_code == 200
        assert httpx.post(url, json={"name": "q"}).status_code == 401
    finally:
        proc.terminate()
        proc.wait(10)


def test_a_short_token_from_the_environment_stops_serve_with_what_to_do(tmp_path):
    public = ["serve", "--host", "0.0.0.0", "--port", str(_free_port())]
    result = _run(public, tmp_path, VLLM_MANAGER_API_TOKEN="x")
    assert result.returncode == 2
    assert "VLLM_MANAGER_API_TOKEN is too short (1 of at least 32 characters)" in result.stderr
    assert "secrets.token_urlsafe(32)" in result.stderr
    token_file = tmp_path / "api_token"
    token_file.write_text("only-twenty-characte\n")
    from_file = _run(["serve", "--port", str(_free_port())], tmp_path, VLLM_MANAGER_API_TOKEN_FILE=str(token_file))
    assert from_file.returncode == 2 and "(20 of at least 32 characters)" in from_file.stderr


def test_models_profiles_export_import(tmp_path):
    (tmp_path / "p.yaml").write_text(yaml.safe_dump({"name": "kv", "kv_offload_gib": 4}))
    (tmp_path / "m.yaml").write_text(yaml.safe_dump({"name": "m1", "model": "org/x", "offload_profile": "kv"}))
    data = tmp_path / "a"
    assert _run(["profiles", "add", str(tmp_path / "p.yaml")], data).returncode == 0
    assert _run(["models", "add", str(tmp_path / "m.yaml")], data).returncode == 0
    dup = _run(["models", "add", str(tmp_path / "m.yaml")], data)
    assert dup.returncode == 1 and "already exists" in dup.stderr
    listed = _run(["models", "list"], data).stdout.splitlines()
    assert listed[0].split("\t") == ["name", "model", "offload profile"] and listed[1].startswith("m1\t")
    assert json.loads(_run(["models", "show", "m1"], data).stdout)["offload_profile"] == "kv"
    in_use = _run(["profiles", "rm", "kv"], data)
    assert in_use.returncode == 1 and "m1" in in_use.stderr

    export = tmp_path / "all.yaml"
    assert _run(["export", str(export)], data).returncode == 0
    other = tmp_path / "b"
    assert _run(["import", str(export)], other).returncode == 0
    assert _run(["export", "-"], other).stdout == export.read_text()
    shown = _run(["command", "m1", "--no-validate"], other)
    assert (
        json.loads(shown.stdout)["argv"][-2:] == ["--kv-offloading-size", "4"] or "--kv-offloading-size" in shown.stdout
    )


def test_acknowledged_write_survives_kill_9(tmp_path):
    port = _free_port()
    proc = _serve(tmp_path, port)
    resp = httpx.post(f"http://127.0.0.1:{port}/api/models", json={"name": "durable", "model": "org/x"})
    assert resp.status_code == 201
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(10)
    proc = _serve(tmp_path, port)
    try:
        assert httpx.get(f"http://127.0.0.1:{port}/api/models/durable").status_code == 200
    finally:
        proc.terminate()
        proc.wait(10)


def test_a_read_from_a_folder_without_manager_data_names_the_folder_and_makes_nothing(tmp_path):
    wrong = tmp_path / "not-the-data-dir"
    for args in (["models", "list"], ["models", "show", "tiny"], ["profiles", "list"]):
        done = _run(args, wrong)
        assert done.returncode == 2, done
        assert f"no manager data in {wrong}" in done.stderr and "--data-dir" in done.stderr
    assert not wrong.exists()
    helped = subprocess.run([*CLI, "models", "--help"], capture_output=True, text=True, timeout=60)
    assert "List the stored model configs" in helped.stdout and "Add a model config from a YAML" in helped.stdout


def _wrong_tokens(port: int, forged: list[str]) -> list[httpx.Response]:
    """A wrong token from this machine per address it claims to come from."""
    return [
        httpx.get(
            f"http://127.0.0.1:{port}/api/profiles",
            headers={"Authorization": f"Bearer wrong-{n}", "X-Forwarded-For": address},
        )
        for n, address in enumerate(forged)
    ]


@pytest.mark.parametrize("forwarders", ["0", "1"])
def test_a_client_cannot_claim_other_addresses_to_escape_the_wrong_token_limit(tmp_path, forwarders):
    token = _run(["token", "create"], tmp_path).stdout.strip()
    assert _run(["keys", "create", "app"], tmp_path).returncode == 0  # /v1 then takes keys only
    env = {"VLLM_MANAGER_FORWARDERS": forwarders}
    port = _free_port()
    proc = _serve(tmp_path, port, env=env)
    try:
        # /v1 (answered by a forwarder when there are some): wrong keys from forged addresses count as one.
        chat = f"http://127.0.0.1:{port}/v1/chat/completions"
        statuses = []
        for n in range(30):
            forged = {"Authorization": f"Bearer vmk_wrong-{n}", "X-Forwarded-For": f"203.0.113.{n}"}
            statuses.append(httpx.post(chat, json={"model": "m", "messages": []}, headers=forged).status_code)
            if statuses[-1] == 429:
                break
            time.sleep(0.05 * (n >= 10))  # a forwarder hears of the limit from the manager a moment later
        assert statuses[:10] == [401] * 10 and statuses[-1] == 429
        # Wrong keys do not lock the admin out of the API.
        assert (
            httpx.get(f"http://127.0.0.1:{port}/api/profiles", headers={"Authorization": f"Bearer {token}"}).status_code
            == 200
        )
        answers = _wrong_tokens(port, [f"203.0.113.{n}" for n in range(11)])
        assert [a.status_code for a in answers] == [401] * 10 + [429]
        assert "too many wrong tokens from 127.0.0.1" in answers[-1].json()["detail"]
        right = {"Authorization": f"Bearer {token}"}
        assert httpx.get(f"http://127.0.0.1:{port}/api/profiles", headers=right).status_code == 429
    finally:
        proc.terminate()
        proc.communicate(timeout=60)
    # A proxy the admin names is believed: each client behind it has a limit of its own.
    port = _free_port()
    proc = _serve(tmp_path, port, "--forwarded-allow-ips", "127.0.0.1", env=env)
    try:
        assert [a.status_code for a in _wrong_tokens(port, [f"203.0.113.{n}" for n in range(11)])] == [401] * 11
        behind = _wrong_tokens(port, ["198.51.100.7"] * 11)[-1]
        assert behind.status_code == 429 and "from 198.51.100.7" in behind.json()["detail"]
    finally:
        proc.terminate()
        proc.communicate(timeout=60)


def test_a_proxy_setting_that_is_not_an_address_stops_serve_with_what_to_do(tmp_path):
    result = _run(["serve", "--port", str(_free_port()), "--forwarded-allow-ips", "proxy.local"], tmp_path)
    assert result.returncode == 2 and "'proxy.local' is neither" in result.stderr and "Traceback" not in result.stderr


def test_command_shows_the_argv_before_vllms_parser_answers(tmp_path):
    """vLLM's parser takes seconds to load; the command is on the screen while it runs."""
    slow = tmp_path / "python"
    slow.write_text("#!/bin/sh\nsleep 20\n")
    slow.chmod(0o755)
    (tmp_path / "m.yaml").write_text(yaml.safe_dump({"name": "m1", "model": "org/x", "max_model_len": 2048}))
    data = tmp_path / "data"
    env = {**os.environ, "VLLM_MANAGER_API_TOKEN": "", "VLLM_MANAGER_ENGINE_PYTHON": str(slow)}
    assert _run(["models", "add", str(tmp_path / "m.yaml")], data).returncode == 0
    proc = subprocess.Popen(
        CLI + ["command", "m1", "--data-dir", str(data)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        text=True,
    )
    try:
        assert proc.stderr is not None
        first = proc.stderr.readline()
        assert proc.poll() is None, "the argv came only after the parser's verdict"
        assert "org/x" in first and "--max-model-len=2048" in first
        assert "checking it with vLLM's own parser" in proc.stderr.readline()
    finally:
        proc.kill()
        proc.wait(10)
