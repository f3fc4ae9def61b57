"""JSON-valued engine args, checked key by key in every spelling vLLM accepts, and two plain ones."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from manager.errors import Invalid
from manager.launch.arg_rules import CODE_ARGS, JSON_ARGS, OTHER_FLAGS, SPECULATIVE_METHODS, Keys
from manager.launch.arg_values import check_arg_values
from manager.launch.refusals import CODE_FLAGS, check_extra_args

PASSES = {"p": "my_passes.fuse"}
# What a config may carry: each would load no code of the user's choosing.
ACCEPTED = [
    ["-O3"],
    ["-O", "3"],
    ["-O=2"],
    ["-Odecode"],
    ["--compilation-config", '{"cudagraph_capture_sizes": [1, 2, 4]}'],
    ["-cc", '{"mode": 3, "backend": "inductor", "inductor_compile_config": {"max_autotune": true}}'],
    ["-cc.cudagraph_capture_sizes+", "1,2"],
    ["--compilation-config.pass_config.fuse_norm_quant", "true"],
    [
        "--hf-overrides",
        '{"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}',
    ],
    ["--hf-overrides.rope_scaling.factor", "4"],
    ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}'],
    ["-sc", '{"model": "/models/draft", "num_speculative_tokens": 3}'],
    ["--spec-model", "org/draft-model", "--spec-method", "draft_model"],
    ["--kv-transfer-config", '{"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}'],
    ["--override-generation-config", '{"temperature": 0.6, "top_p": 0.95}'],
    ["--limit-mm-per-prompt", '{"image": 2}'],
    ["--model-loader-extra-config", '{"enable_multithread_load": true, "num_threads": 8}'],
    ["--pt-load-map-location", "cuda:0"],
    ["--watermark", "0.5"],
    ["--structured-outputs-config", '{"backend": "xgrammar", "reasoning_parser": "qwen3"}'],
]


def _refusal(args: list[str]) -> str:
    with pytest.raises(Invalid) as refused:
        check_extra_args(args, allow_code_flags=False)
    assert refused.value.detail["field"] == "extra_args"
    assert "VLLM_MANAGER_ALLOW_CODE_FLAGS=1" in refused.value.message
    return refused.value.message


@pytest.mark.parametrize(
    "args",
    [
        ["--compilation-config", json.dumps({"inductor_passes": PASSES})],
        ["--compilation_config", json.dumps({"inductor_passes": PASSES})],
        ["--compilation-conf", json.dumps({"inductor_passes": PASSES})],
        ["-cc", json.dumps({"inductor_passes": PASSES})],
        ["-cc=" + json.dumps({"inductor_passes": PASSES})],
        ["-c", json.dumps({"inductor_passes": PASSES})],
        ["-cc.inductor_passes.p", "my_passes.fuse"],
        ["--compilation-config.inductor_passes.p=my_passes.fuse"],
        # -O was the compilation config before vLLM 0.12.
        ["-O", json.dumps({"inductor_passes": PASSES})],
        ["-O" + json.dumps({"inductor_passes": PASSES})],
        ["-O.inductor_passes.p", "my_passes.fuse"],
        # A key given twice is still seen.
        ["-cc", '{"inductor_passes": {}, "inductor_passes": {"p": "my_passes.fuse"}}'],
    ],
)
def test_inductor_passes_are_refused_in_every_spelling(args):
    assert "sets inductor_passes, which is refused because it imports the functions" in _refusal(args)


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["-cc", '{"backend": "my_pkg.MyBackend"}'], "sets backend to 'my_pkg.MyBackend'"),
        (["-cc", '{"cache_dir": "/tmp/shared"}'], "sets cache_dir"),
        (["-cc", '{"inductor_compile_config": {"cpp.cxx": "/tmp/cc"}}'], "sets inductor_compile_config.cpp.cxx"),
        (
            ["--kv-transfer-config", '{"kv_connector": "C", "kv_connector_module_path": "my_pkg"}'],
            "kv_connector_module_path",
        ),
        (["--kv-transfer-config.kv_connector_module_path", "my_pkg"], "kv_connector_module_path"),
        (
            [
                "--kv-transfer-config",
                '{"kv_connector": "OffloadingConnector", "kv_connector_extra_config": {"spec_module_path": "m"}}',
            ],
            "kv_connector_extra_config",
        ),
        (["--ec-transfer-config", '{"ec_connector_module_path": "my_pkg"}'], "ec_connector_module_path"),
        (["--speculative-config", '{"model": "my_pkg.Proposer"}'], "sets model to 'my_pkg.Proposer'"),
        (["-sc.method", "custom_class"], "sets method to 'custom_class'"),
        (["--spec-model", "my_pkg.Proposer"], "--spec-model is given 'my_pkg.Proposer'"),
        (["--spec-method=custom_class"], "--spec-method is given 'custom_class'"),
        (["--structured-outputs-config", '{"reasoning_parser_plugin": "/tmp/p.py"}'], "reasoning_parser_plugin"),
        (["--logging-config", '{"pylogging_config_file": "/tmp/log.json"}'], "pylogging_config_file"),
        (["--ec-manager-config", '{"encoder_cache_manager_cls": "my_pkg.M"}'], "encoder_cache_manager_cls"),
        # Unknown keys of an arg that can load code: refused until someone has checked them.
        (["--additional-config", '{"my_plugin_module": "m"}'], "sets my_plugin_module, which is not a key known"),
        (["-cc", '{"something_new": 1}'], "sets something_new, which is not a key known"),
    ],
)
def test_code_loading_keys_and_values_are_refused_by_name(args, named):
    assert named in _refusal(args)


@pytest.mark.parametrize("args", ACCEPTED)
def test_typical_values_pass(args):
    check_extra_args(args, allow_code_flags=False)


def test_the_opt_out_lets_code_loading_keys_through():
    check_extra_args(["-cc", json.dumps({"inductor_passes": PASSES}), "--spec-model", "a.B"], allow_code_flags=True)


@pytest.mark.parametrize("allow", [False, True])
def test_json_that_does_not_parse_names_the_arg(allow):
    with pytest.raises(Invalid) as refused:
        check_arg_values(["--hf-overrides", '{"rope_scaling": {"factor": 4.0}'], allow_code_flags=allow)
    assert refused.value.message.startswith("extra_args: the value of --hf-overrides is not valid JSON")
    with pytest.raises(Invalid, match="the value of -cc is not valid JSON"):
        check_arg_values(["-cc", "{mode: 3}"], allow_code_flags=allow)


def test_sizes_written_the_way_vllm_accepts_them_are_valid_json():
    check_arg_values(["--kv-transfer-config", '{"kv_connector": "LMCacheConnectorV1", "kv_port": 14k}'], False)


def _vllm_facts() -> dict:
    """What vLLM's own parser says about the args above, read in a child process with vLLM's interpreter."""
    script = r"""
import contextlib, io, json, sys, typing
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.config.speculative import SpeculativeConfig
import dataclasses
parser = make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))

def parts(fn):
    seen, stack = [], [fn]
    while stack:
        f = stack.pop()
        seen.append(f)
        stack += [c.cell_contents for c in (getattr(f, "__closure__", None) or ())]
        stack += list(getattr(f, "__defaults__", None) or ())
    return seen

actions = []
for a in parser._actions:
    found = parts(a.type) if a.type else []
    names = {getattr(f, "__qualname__", "").rsplit(".", 1)[-1] for f in found}
    classes = [f for f in found if isinstance(f, type) and dataclasses.is_dataclass(f)]
    fields = [f.name for f in dataclasses.fields(classes[0]) if f.init] if classes else None
    is_json = bool(names & {"parse_dataclass", "loads", "union_dict_and_str"})
    actions.append({"names": a.option_strings, "json": is_json, "fields": fields})
methods = typing.get_args(typing.get_args(typing.get_type_hints(SpeculativeConfig)["method"])[0])

def verdict(argv):
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            parser.parse_args(["--model", "m", *argv])
    except SystemExit:
        return "rejected: " + err.getvalue().strip().splitlines()[-1]
    except Exception as exc:
        return type(exc).__name__
    return "accepted"

checks = json.loads(sys.stdin.read())
print(json.dumps({"actions": actions, "methods": list(methods), "verdicts": [verdict(a) for a in checks]}))
"""
    imports = ["-cc", json.dumps({"inductor_passes": {"p": "vllm_manager_no_such_module.fuse"}})]
    proc = subprocess.run(
        [sys.executable, "-c", script],
        input=json.dumps([*ACCEPTED, imports]),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def vllm_facts() -> dict:
    return _vllm_facts()


def test_the_table_has_every_json_valued_arg_of_vllms_parser(vllm_facts):
    json_spellings = {name for a in vllm_facts["actions"] if a["json"] for name in a["names"]}
    # --model-class-overrides holds only module paths: the whole flag is refused.
    assert "--model-class-overrides" in CODE_FLAGS
    assert json_spellings - {"--model-class-overrides"} == set(JSON_ARGS)


def test_the_flags_that_begin_a_json_args_name_are_known(vllm_facts):
    everything = {name for a in vllm_facts["actions"] for name in a["names"]}
    begins = {
        other
        for other in everything - set(JSON_ARGS)
        for name in JSON_ARGS
        if name.startswith(other) and name.startswith("--") == other.startswith("--")
    }
    assert begins == OTHER_FLAGS


def test_every_key_the_table_names_is_one_vllm_has(vllm_facts):
    fields = {name: a["fields"] for a in vllm_facts["actions"] for name in a["names"]}
    for arg in CODE_ARGS:
        if isinstance(arg.spec, Keys) and fields[arg.names[0]] is not None:
            assert set(arg.spec.allowed) <= set(fields[arg.names[0]]), arg.names[0]
    assert set(vllm_facts["methods"]) - {"custom_class"} == SPECULATIVE_METHODS


def test_vllms_parser_takes_what_is_accepted_and_imports_inductor_passes_while_parsing(vllm_facts):
    *accepted, imports = vllm_facts["verdicts"]
    assert accepted == ["accepted"] * len(ACCEPTED)
    assert imports == "ModuleNotFoundError"  # the reason inductor_passes is refused before any preview
