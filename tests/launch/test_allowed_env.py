"""A model config's env: an allow-list, each refusal naming the variable and the way to allow it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from manager.errors import Invalid
from manager.launch import allowed_env
from manager.launch.allowed_env import ALLOWED_ENV, NOT_FOR_CONFIGS, REFUSED_BECAUSE, RETIRED, check_env
from manager.launch.command import build_command
from manager.schemas.model_config import ModelConfig

TYPICAL = {
    "HF_TOKEN": "hf_x",
    "HF_HOME": "/data/hf",
    "HF_HUB_OFFLINE": "1",
    "CUDA_VISIBLE_DEVICES": "0,1",
    "NCCL_DEBUG": "INFO",
    "NCCL_P2P_DISABLE": "1",
    "VLLM_ATTENTION_BACKEND": "FLASHINFER",
    "VLLM_LOGGING_LEVEL": "DEBUG",
    "VLLM_CPU_KVCACHE_SPACE": "4",
    "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
    "OMP_NUM_THREADS": "8",
    "TOKENIZERS_PARALLELISM": "false",
}


@pytest.mark.parametrize(
    "name", ["VLLM_LOGGING_CONFIG_PATH", "NCCL_NET_PLUGIN", "NCCL_TUNER_PLUGIN", "PATH", "CC", "VLLM_PLUGINS"]
)
def test_the_issues_variables_are_refused_by_name_with_the_reason(name):
    with pytest.raises(Invalid) as refused:
        check_env({"HF_TOKEN": "x", name: "/tmp/anything"}, allow_code_flags=False)
    message = refused.value.message
    assert message.startswith(f"env: {name} is refused because ")
    assert "VLLM_MANAGER_ALLOW_CODE_FLAGS=1" in message
    assert refused.value.detail["field"] == "env"


def test_a_variable_nobody_listed_is_refused_with_where_the_list_is():
    with pytest.raises(Invalid) as refused:
        check_env({"MY_TUNING_KNOB": "3"}, allow_code_flags=False)
    message = refused.value.message
    assert "MY_TUNING_KNOB is not one of the variables a model config may set" in message
    assert "manager/launch/allowed_env.py" in message and "VLLM_MANAGER_ALLOW_CODE_FLAGS=1" in message


def test_typical_configs_pass_and_the_opt_out_passes_anything():
    check_env(TYPICAL, allow_code_flags=False)
    check_env({"LD_PRELOAD": "/tmp/x.so", "MY_TUNING_KNOB": "3", "NCCL_NET_PLUGIN": "p"}, allow_code_flags=True)


def test_no_name_is_both_allowed_and_refused():
    refused = set(REFUSED_BECAUSE) | set(NOT_FOR_CONFIGS.split())
    assert not ALLOWED_ENV & refused
    for name in REFUSED_BECAUSE:
        with pytest.raises(Invalid, match=f"env: {name} is refused because"):
            check_env({name: "x"}, allow_code_flags=False)


def test_the_gpus_of_the_worker_replace_the_configs_cuda_visible_devices_and_the_preview_says_so():
    config = ModelConfig(name="m", model="/models/m", env={"CUDA_VISIBLE_DEVICES": "0"})
    kept = build_command(config, None, engine_python="py", port=1)
    assert kept.env["CUDA_VISIBLE_DEVICES"] == "0" and kept.notes == []
    replaced = build_command(config, None, engine_python="py", port=1, gpus=[2, 3])
    assert replaced.env["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert replaced.notes == ["CUDA_VISIBLE_DEVICES=2,3 (the worker's GPUs) replaces 0 from env"]


def test_a_variable_this_vllm_no_longer_reads_is_accepted_and_noted():
    config = ModelConfig(name="m", model="/models/m", env={"VLLM_ATTENTION_BACKEND": "FLASHINFER"})
    cmd = build_command(config, None, engine_python="py", port=1)
    assert cmd.env["VLLM_ATTENTION_BACKEND"] == "FLASHINFER"
    assert cmd.notes == ["VLLM_ATTENTION_BACKEND is not read by vLLM 0.32: use --attention-backend"]


def test_every_variable_vllm_knows_has_a_decision_and_every_listed_one_is_read_by_vllm():
    # In a child process: importing vLLM loads its plugins, which the manager never does itself.
    script = (
        "import json, pathlib, vllm.envs as e\n"
        "root = pathlib.Path(e.__file__).parent\n"
        "text = '\\n'.join(p.read_text(errors='replace') for p in root.rglob('*.py'))\n"
        f"names = {sorted(n for n in ALLOWED_ENV if n.startswith('VLLM_'))!r}\n"
        "print(json.dumps({'known': sorted(e.environment_variables), 'unread': [n for n in names if n not in text]}))\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    decided = ALLOWED_ENV | set(REFUSED_BECAUSE) | set(allowed_env.NOT_FOR_CONFIGS.split())
    assert sorted(set(found["known"]) - decided) == []
    assert sorted(found["unread"]) == sorted(RETIRED)
