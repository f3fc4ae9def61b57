"""Reading the few shapes the planner needs out of a Hugging Face config.json.

Published configs are sparse: multimodal models nest the language model under ``text_config``
and many leave out values that transformers fills from class defaults (Gemma 3's head_dim and
sliding-window pattern are the common case). The defaults below are the ones transformers uses
for those model types, so a config straight from the hub reads the same as a loaded one.
"""

from __future__ import annotations

from typing import Any

# Class defaults of transformers configs that published config.json files rely on.
_MODEL_TYPE_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma3_text": {
        "head_dim": 256,
        "sliding_window": 4096,
        "sliding_window_pattern": 6,
        "max_position_embeddings": 131072,
        "num_key_value_heads": 4,
        "vocab_size": 262208,
        "query_pre_attn_scalar": 256,
        "tie_word_embeddings": True,
    },
    "gemma2": {"head_dim": 256, "sliding_window": 4096, "tie_word_embeddings": True},
    "gemma": {"head_dim": 256, "tie_word_embeddings": True},
    "gpt_oss": {"head_dim": 64, "sliding_window": 128},
}

# Keys a multimodal wrapper keeps at the top level that the language model inherits.
_INHERITED = ("torch_dtype", "dtype", "quantization_config", "tie_word_embeddings")


def text_config(hf_config: dict[str, Any]) -> dict[str, Any]:
    """The language-model part of a config, with transformers' defaults for missing values."""
    cfg = dict(hf_config)
    for nested in ("text_config", "llm_config", "language_config"):
        inner = cfg.get(nested)
        if isinstance(inner, dict) and ("num_hidden_layers" in inner or "hidden_size" in inner):
            merged = dict(inner)
            for key in _INHERITED:
                if key not in merged and key in cfg:
                    merged[key] = cfg[key]
            cfg = merged
            break
    for key, value in _MODEL_TYPE_DEFAULTS.get(cfg.get("model_type", ""), {}).items():
        cfg.setdefault(key, value)
    return cfg


# The planner builds a list per layer: a config (one a request can send) names at most this many. The
# deepest published models have a few hundred.
MAX_LAYERS = 4096
_LAYER_COUNTS = frozenset({"num_hidden_layers", "n_layer", "num_layers"})


def require(cfg: dict[str, Any], *keys: str) -> int:
    """The first of ``keys`` present in the config, as an int; a clear error if none is, or if a layer
    count is beyond any real model's."""
    for key in keys:
        value = cfg.get(key)
        if value is not None:
            number = int(value)
            if key in _LAYER_COUNTS and not 0 < number <= MAX_LAYERS:
                raise ValueError(
                    f"config.json gives {key} = {number}; the planner takes 1 to {MAX_LAYERS} layers. Check that "
                    "the folder holds the model's own config.json."
                )
            return number
    raise ValueError(
        f"config.json has none of {', '.join(keys)} (model_type {cfg.get('model_type')!r}); "
        "the planner cannot size this model. Check that the folder holds the model's own config.json."
    )


def head_dim(cfg: dict[str, Any]) -> int:
    if cfg.get("head_dim"):
        return int(cfg["head_dim"])
    return require(cfg, "hidden_size") // require(cfg, "num_attention_heads")


def num_kv_heads(cfg: dict[str, Any]) -> int:
    kv = cfg.get("num_key_value_heads")
    if kv is None:
        kv = cfg.get("num_kv_heads")  # a few older configs
    if kv is None:
        return require(cfg, "num_attention_heads")
    return int(kv)


_DTYPE_BYTES = {
    "float32": 4,
    "fp32": 4,
    "float": 4,
    "bfloat16": 2,
    "bf16": 2,
    "float16": 2,
    "fp16": 2,
    "half": 2,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "fp8_inc": 1,
    "fp8_ds_mla": 1,
    "int8": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}


def model_dtype_name(cfg: dict[str, Any], dtype: str = "auto") -> str:
    """The dtype vLLM runs the model in: explicit, else the config's, float32 served as bfloat16."""
    if dtype and dtype != "auto":
        return dtype.removeprefix("torch.")
    name = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16").removeprefix("torch.")
    # vLLM's "auto" serves float32 checkpoints in 16 bits on GPUs.
    return "bfloat16" if name in ("float32", "float") else name


def dtype_bytes(name: str) -> int:
    try:
        return _DTYPE_BYTES[name.removeprefix("torch.").lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; use one of {', '.join(sorted(_DTYPE_BYTES))}") from None
