import json

import pytest

from engine_patches.settings import ENV_VAR, PatchSettings, SettingsError


def test_round_trip_through_the_environment():
    s = PatchSettings(
        run_dir="/tmp/run",
        pin_budget_bytes=1 << 30,
        lora_pool=True,
        max_cpu_loras=4,
        moe_offload=True,
        moe_mode="copy_all",
    )
    env = s.to_env()
    assert list(env) == [ENV_VAR]
    assert PatchSettings.from_env(env) == s


def test_unset_or_empty_gives_defaults():
    assert PatchSettings.from_env({}) == PatchSettings()
    assert PatchSettings.from_env({ENV_VAR: "  "}) == PatchSettings()


def test_unknown_keys_warn_but_do_not_fail(caplog):
    s = PatchSettings.from_env({ENV_VAR: json.dumps({"pinned": False, "turbo": 1})})
    assert s.pinned is False
    assert s.unknown_keys == ("turbo",)
    assert "turbo" in caplog.text


@pytest.mark.parametrize(
    "raw, word",
    [
        ({"pinned": "yes"}, "pinned"),
        ({"pin_budget_bytes": 1.5}, "pin_budget_bytes"),
        ({"moe_mode": "fast"}, "moe_mode"),
        ({"pin_budget_bytes": -1}, "pin_budget_bytes"),
        ({"moe_stream_below_hit_rate": 1.5}, "moe_stream_below_hit_rate"),
        ({"moe_in_place_tokens": 65}, "moe_in_place_tokens"),
        ({"moe_in_place_tokens": -1}, "moe_in_place_tokens"),
        ({"moe_cache_policy": "lfu"}, "moe_cache_policy"),
    ],
)
def test_wrong_values_name_the_key(raw, word):
    with pytest.raises(SettingsError, match=word):
        PatchSettings.from_env({ENV_VAR: json.dumps(raw)})


def test_bad_json_says_so():
    with pytest.raises(SettingsError, match="not valid JSON"):
        PatchSettings.from_env({ENV_VAR: "{pinned: true"})


def test_settings_module_imports_neither_torch_nor_vllm():
    import subprocess
    import sys

    code = (
        "import sys, engine_patches.settings, engine_patches.stats; "
        "print('torch' in sys.modules, 'vllm' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]
