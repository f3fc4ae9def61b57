"""The flag table: the flags build_command writes are the flags extra_args may not set, and vLLM knows them."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from manager.errors import Invalid
from manager.launch.command import build_command
from manager.launch.flags import ENGINE_FLAGS, MANAGED_FLAGS, flag_name, flag_value
from manager.launch.refusals import check_extra_args
from manager.schemas.model_config import ModelConfig
from manager.schemas.offload_profile import OffloadProfile

TABLE_SPELLINGS = {name for row in ENGINE_FLAGS for name in row.names}
# Launch values that are not model config fields: the launch decides them.
LAUNCH_VALUES = {"host", "kv_offloading_size", "kv_offloading_backend", "enable_sleep_mode", "quiet_paths"}


def _refused(flag: str) -> bool:
    try:
        check_extra_args([flag, "1"], allow_code_flags=True)
    except Invalid as exc:
        assert "set by the manager" in exc.message
        return True
    return False


def test_extra_args_refuse_exactly_the_tables_flags():
    may_set = {name for row in ENGINE_FLAGS if row.extra_args_may_set for name in row.names}
    assert may_set == {"--enforce-eager", "--enable-prefix-caching", "--disable-access-log-for-endpoints"}
    assert set(MANAGED_FLAGS) == TABLE_SPELLINGS - may_set
    assert {name for name in TABLE_SPELLINGS if _refused(name)} == TABLE_SPELLINGS - may_set


def test_a_refusal_names_what_to_set_instead():
    with pytest.raises(Invalid, match="use the config field tensor_parallel_size instead"):
        check_extra_args(["-tp", "2"], allow_code_flags=False)
    with pytest.raises(Invalid, match="the offload profile's kv_offload_gib"):
        check_extra_args(["--kv-offloading-size=4"], allow_code_flags=False)


def _written_flags(argv: list[str]) -> set[str]:
    names = {flag_name(part) for part in argv}
    return {"--" + n[5:] if n.startswith("--no-") else n for n in names if n}


def test_every_flag_build_command_writes_comes_from_the_table():
    everything = ModelConfig(
        name="all",
        model="/models/m",
        served_model_name="s",
        dtype="half",
        quantization="awq",
        tensor_parallel_size=2,
        max_model_len=4096,
        max_num_seqs=4,
        kv_cache_dtype="fp8",
        enforce_eager=True,
        enable_prefix_caching=False,
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
        max_cpu_loras=4,
        sleep_level=1,
    )
    lru = build_command(everything, OffloadProfile(name="p", kv_offload_gib=2), engine_python="py", port=1)
    arc = OffloadProfile(name="a", kv_offload_gib=2, kv_eviction_policy="arc")
    connector = build_command(everything, arc, engine_python="py", port=1)
    table_flags = {row.flag for row in ENGINE_FLAGS}
    assert _written_flags(lru.engine_argv) == table_flags
    # An eviction policy other than LRU has no flag of its own: vLLM takes it in the connector's config.
    kv_flags = {"--kv-offloading-size", "--kv-offloading-backend"}
    assert _written_flags(connector.engine_argv) == (table_flags - kv_flags) | {"--kv-transfer-config"}


def test_the_tables_values_are_config_fields_or_launch_values():
    for row in ENGINE_FLAGS:
        assert row.field in ModelConfig.model_fields or row.field in LAUNCH_VALUES, row.flag
        assert row.needs is None or row.needs in ModelConfig.model_fields, row.flag


def test_vllms_parser_knows_every_spelling_in_the_table():
    script = (
        "import json\n"
        "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
        "from vllm.entrypoints.launchers.cli_args import make_arg_parser\n"
        "parser = make_arg_parser(FlexibleArgumentParser(prog='vllm serve'))\n"
        "print(json.dumps(sorted({o for a in parser._actions for o in a.option_strings})))\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    known = set(json.loads(proc.stdout.strip().splitlines()[-1]))
    switches = {"--no-" + row.flag[2:] for row in ENGINE_FLAGS if row.text is None}
    assert TABLE_SPELLINGS | switches <= known


def test_flag_value_reads_both_spellings():
    assert flag_value(["--block-size", "32"], "--block-size") == "32"
    assert flag_value(["--block-size=32"], "--block-size") == "32"
    assert flag_value(["--block-size"], "--block-size") is None
