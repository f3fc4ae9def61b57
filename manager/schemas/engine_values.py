"""What the model config fields the manager writes into an engine's argv may hold.

The manager writes each of these fields after its own flag, so a value is never an option: a text
value starting with '-' is refused (vLLM's parser would read `-cc.key` as a flag of its own). The
fields vLLM takes from a fixed list are checked against vLLM 0.32.0's lists, copied here so that the
manager never imports vLLM (tests compare them with the installed vLLM). Sizes are bounded by what a
cluster can have: no user-chosen size ever becomes a loop or a collection in the manager.
"""

from __future__ import annotations

from collections.abc import Sequence

from manager.schemas.common import MAX_ENGINE_GPUS

# vllm/config/model.py: ModelDType
DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")
# vllm/config/cache.py: CacheDType
KV_CACHE_DTYPES = (
    "auto",
    "float16",
    "bfloat16",
    "fp8",
    "fp8_e4m3",
    "fp8_e5m2",
    "fp8_inc",
    "fp8_ds_mla",
    "nvfp4_ds_mla",
    "turboquant_k8v4",
    "turboquant_4bit_nc",
    "turboquant_k3v4_nc",
    "turboquant_3bit_nc",
    "ultraquant_4bit",
    "int4_per_token_head",
    "int8_per_token_head",
    "fp8_per_token_head",
    "nvfp4",
    "nvfp4_4over6",
)
# vllm/model_executor/layers/quantization/__init__.py: QuantizationMethods. vLLM also takes names a
# plugin registers; those are not known here, so the manager does not take them.
QUANTIZATIONS = (
    "awq",
    "auto_awq",
    "fp8",
    "fbgemm_fp8",
    "fp_quant",
    "modelopt",
    "modelopt_fp4",
    "modelopt_mxfp8",
    "modelopt_mixed",
    "auto_gptq",
    "gptq",
    "gptq_marlin",
    "awq_marlin",
    "humming",
    "compressed-tensors",
    "experts_int8",
    "quark",
    "moe_wna16",
    "torchao",
    "inc",
    "mxfp4",
    "gpt_oss_mxfp4",
    "deepseek_v4_fp8",
    "online",
    "fp8_per_tensor",
    "fp8_per_block",
    "fp8_per_channel",
    "int8_per_channel_weight_only",
    "nvfp4_per_token",
    "mxfp8",
)
# vllm/config/lora.py: MaxLoRARanks
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)

CHOICES: dict[str, Sequence[str | int]] = {
    "dtype": DTYPES,
    "kv_cache_dtype": KV_CACHE_DTYPES,
    "quantization": QUANTIZATIONS,
    "max_lora_rank": LORA_RANKS,
}
# Every config field the manager writes as text after a flag of its own.
TEXT_FIELDS = ("model", "served_model_name", "dtype", "kv_cache_dtype", "quantization")

# The engine flags that multiply the GPUs an engine takes, as vLLM 0.32 spells them. argparse also
# takes an unambiguous start of a long name: every start of --pipeline-parallel-size from --pi on.
_PARALLEL_FLAGS = {
    "pipeline": ("--pipeline-parallel-size", "-pp", "--pi"),
    "data": ("--data-parallel-size", "-dp", None),  # every start of it also starts other flags
    "data_backend": ("--data-parallel-backend", "-dpb", "--data-parallel-b"),
}


def value_problem(field: str, value: str | int | None) -> str | None:
    """Why a managed field's value is refused, as a message naming the field; None when it is fine."""
    flag_like = flag_like_problem(field, value)
    if flag_like or value is None:
        return flag_like
    choices = CHOICES.get(field)
    if choices is not None and value not in choices:
        shown = ", ".join(str(c) for c in choices)
        unset = " (leave it out for none)" if field == "quantization" else ""
        return f"{field} {value!r} is not one vLLM 0.32 takes; it must be one of: {shown}{unset}"
    return None


def flag_like_problem(field: str, value: object) -> str | None:
    """Why a text value is refused as one vLLM would read as a flag; None when it is not one."""
    if not (isinstance(value, str) and value.startswith("-")):
        return None
    folder = " (a local folder whose name starts with '-': give its full path)" if field == "model" else ""
    return (
        f"{field} {value!r} starts with '-', which vLLM would read as a flag of its own; a value of a "
        f"config field is never a flag{folder}"
    )


def parallel_size(extra_args: Sequence[str], kind: str) -> int:
    """The pipeline ("pipeline") or data ("data") parallel size extra_args give, as vLLM reads them
    (the last one given counts); 1 when not given or not a whole number, which vLLM refuses itself."""
    given = _last_value(extra_args, kind)
    try:
        return max(1, int(given)) if given is not None else 1
    except ValueError:
        return 1


def data_parallel_backend(extra_args: Sequence[str]) -> str:
    """How vLLM starts an engine's data parallel ranks: "mp" (its default: all on this node) or "ray"."""
    return _last_value(extra_args, "data_backend") or "mp"


def _last_value(extra_args: Sequence[str], kind: str) -> str | None:
    """The value of the last flag of ``kind`` in extra_args (``--flag value`` or ``--flag=value``)."""
    found = None
    for i, arg in enumerate(extra_args):
        flag, eq, given = arg.partition("=")
        if not _spells(flag, kind):
            continue
        if not eq:
            if i + 1 >= len(extra_args):
                continue
            given = extra_args[i + 1]
        found = given
    return found


def _spells(flag: str, kind: str) -> bool:
    name, short, shortest = _PARALLEL_FLAGS[kind]
    if flag == short:
        return True
    if not flag.startswith("--"):
        return False
    flag = flag.replace("_", "-")  # vLLM's parser takes --pipeline_parallel_size too
    return flag == name or (shortest is not None and flag.startswith(shortest) and name.startswith(flag))


def engine_gpus(tensor_parallel_size: int, extra_args: Sequence[str]) -> int:
    """The GPUs one engine of a config takes: tensor x pipeline x data parallel size."""
    return tensor_parallel_size * parallel_size(extra_args, "pipeline") * parallel_size(extra_args, "data")


def gpus_problem(tensor_parallel_size: int, extra_args: Sequence[str]) -> str | None:
    """Why the GPUs a config asks for are refused (more than any cluster of MAX_ENGINE_GPUS); None when fine."""
    pipeline, data = parallel_size(extra_args, "pipeline"), parallel_size(extra_args, "data")
    total = tensor_parallel_size * pipeline * data
    if total <= MAX_ENGINE_GPUS:
        return None
    sizes = f"tensor_parallel_size {tensor_parallel_size}"
    sizes += f" x pipeline parallel size {pipeline}" if pipeline > 1 else ""
    sizes += f" x data parallel size {data}" if data > 1 else ""
    return f"{sizes} needs {total} GPUs for one engine; the most the manager takes is {MAX_ENGINE_GPUS}"
