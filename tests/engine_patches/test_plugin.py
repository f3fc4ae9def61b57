"""register(): version guard, switches, idempotence, never a crash."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm")

from engine_patches import plugin
from engine_patches.settings import ENV_VAR
from engine_patches.vllm_adapters.patching import unwrap_all


@pytest.fixture
def fresh_plugin(monkeypatch, tmp_path):
    monkeypatch.setattr(plugin, "_installed", None)
    monkeypatch.setenv(ENV_VAR, json.dumps({"run_dir": str(tmp_path)}))
    yield
    unwrap_all()


def test_registers_every_switched_on_patch_once(fresh_plugin):
    import vllm.v1.core.kv_cache_utils as utils

    plugin.register()
    first = plugin.installed_patches()
    assert "LoRAModelManager._create_merged_loras_inplace" in first
    assert "engine.core.get_kv_cache_configs" in first
    assert "SharedOffloadRegion.__init__" in first
    wrapped = utils._check_enough_kv_cache_memory
    plugin._installed = None  # vLLM may call register() again in the same process
    plugin.register()
    assert utils._check_enough_kv_cache_memory is wrapped  # not wrapped twice
    assert not hasattr(wrapped.__wrapped__, "__wrapped__")


def test_each_patch_can_be_switched_off(fresh_plugin, monkeypatch):
    monkeypatch.setenv(ENV_VAR, json.dumps({"pinned": False, "kv_check": False, "offload_config": False}))
    plugin.register()
    assert plugin.installed_patches() == ["SharedOffloadRegion.__init__"]


def test_other_vllm_versions_get_a_warning_and_no_patches(fresh_plugin, monkeypatch, caplog):
    monkeypatch.setattr(plugin, "vllm_version", lambda: "0.33.0")
    plugin.register()
    assert plugin.installed_patches() == []
    assert "supports vLLM 0.32.x and this is vLLM 0.33.0" in caplog.text


def test_bad_settings_never_crash_the_engine(fresh_plugin, monkeypatch, caplog):
    monkeypatch.setenv(ENV_VAR, "{not json")
    plugin.register()  # no exception
    assert plugin.installed_patches() == []
    assert "not valid JSON" in caplog.text


def test_a_failing_patch_costs_only_itself(fresh_plugin, monkeypatch, caplog):
    def broken():
        raise RuntimeError("boom")

    monkeypatch.setattr(plugin, "_kv_check", broken)
    plugin.register()
    assert "SharedOffloadRegion.__init__" in plugin.installed_patches()
    assert "the kv_check patch failed to install" in caplog.text


def test_importing_the_plugin_loads_no_torch():
    code = "import sys, engine_patches.plugin; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_moe_offload_calls_the_moe_adapter(fresh_plugin, monkeypatch):
    calls = []

    def fake_install(settings):
        calls.append(settings.moe_mode)
        return ["FusedMoE.moe"]

    monkeypatch.setattr("engine_patches.vllm_adapters.moe.install", fake_install)
    monkeypatch.setenv(ENV_VAR, json.dumps({"moe_offload": True, "moe_mode": "copy_all"}))
    plugin.register()
    assert calls == ["copy_all"] and "FusedMoE.moe" in plugin.installed_patches()


def test_moe_offload_gives_every_start_one_triton_cache_unless_the_engine_names_one(
    fresh_plugin, monkeypatch, tmp_path
):
    """A start that loads the model from vLLM's compile cache must find the offload's kernels that a
    start which compiled the model put there: Triton's own default folder, named for both."""
    monkeypatch.setattr("engine_patches.vllm_adapters.moe.install", lambda settings: ["FusedMoE.moe"])
    monkeypatch.setenv("TRITON_HOME", str(tmp_path))
    monkeypatch.setenv("TRITON_CACHE_DIR", "")
    monkeypatch.setenv(ENV_VAR, json.dumps({"moe_offload": True, "run_dir": str(tmp_path)}))
    plugin.register()
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / ".triton" / "cache")

    monkeypatch.setattr(plugin, "_installed", None)
    monkeypatch.setenv("TRITON_CACHE_DIR", "/srv/kernels")  # the engine's own choice stays
    plugin.register()
    assert os.environ["TRITON_CACHE_DIR"] == "/srv/kernels"

    monkeypatch.setattr(plugin, "_installed", None)
    monkeypatch.setenv("TRITON_CACHE_DIR", "")
    monkeypatch.setenv(ENV_VAR, json.dumps({"moe_offload": False, "run_dir": str(tmp_path)}))
    plugin.register()
    assert os.environ["TRITON_CACHE_DIR"] == ""  # without the offload, vLLM's choice as before
