"""Weight bytes of a model, dense and routed-expert parts apart.

Exact from the safetensors headers when the files are here; otherwise counted from config.json
(parameter shapes x bytes per parameter of the quantization). The config count covers the
language model only (a vision tower adds a few hundred MB) and is within a few percent of the
published parameter counts for the architectures in tests/fixtures/model_configs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from manager.planner.hf_config import (
    dtype_bytes,
    head_dim,
    model_dtype_name,
    num_kv_heads,
    require,
    text_config,
)
from manager.planner.model_files import WeightFiles


@dataclass(frozen=True)
class WeightEstimate:
    dense_bytes: int
    expert_bytes: int
    source: str  # "safetensors headers" or "config.json"
    bits_per_weight: float  # of the quantized linear layers (16 for bf16)
    experts: int = 0  # routed experts per MoE layer
    moe_layers: int = 0
    experts_per_token: int = 0

    @property
    def total_bytes(self) -> int:
        return self.dense_bytes + self.expert_bytes

    @property
    def is_moe(self) -> bool:
        return self.experts > 0


def quantized_bits(cfg: dict[str, Any], dtype: str = "auto") -> tuple[float, str]:
    """Bits per weight of the quantized linear layers, group scales and zeros included."""
    q = cfg.get("quantization_config") or {}
    method = str(q.get("quant_method", "")).lower()
    base = dtype_bytes(model_dtype_name(cfg, dtype)) * 8
    if method in ("awq", "gptq", "awq_marlin", "gptq_marlin", "auto-round", "autoround"):
        bits = int(q.get("bits", q.get("w_bit", 4)))
        group = int(q.get("group_size", q.get("q_group_size", 128)) or 128)
        group = group if group > 0 else 4096  # -1: one scale per column
        return bits + (16 + bits) / group, method  # fp16 scale + packed zero per group
    if method == "mxfp4":
        return 4 + 8 / 32, method  # 4-bit values + one e8m0 scale per 32
    if method in ("fp8", "fbgemm_fp8", "modelopt"):
        return 8.0, method
    if method == "bitsandbytes":
        return (4.5 if q.get("load_in_4bit") else 8.0), method
    if method == "compressed-tensors":
        for group_cfg in (q.get("config_groups") or {}).values():
            weights = (group_cfg or {}).get("weights") or {}
            if weights.get("num_bits"):
                bits = int(weights["num_bits"])
                size = int(weights.get("group_size") or 0)
                return bits + (16 / size if size else 0), method
    return float(base), method or "none"


def _moe_shape(cfg: dict[str, Any]) -> tuple[int, int, int, int]:
    """(experts, expert intermediate size, MoE layers, experts per token); zeros for a dense model."""
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts") or 0)
    if not experts:
        return 0, 0, 0, 0
    layers = require(cfg, "num_hidden_layers")
    inter = int(cfg.get("moe_intermediate_size") or cfg.get("intermediate_size") or 0)
    top_k = int(cfg.get("num_experts_per_tok") or cfg.get("experts_per_token") or 0)
    dense_first = int(cfg.get("first_k_dense_replace") or 0)
    step = int(cfg.get("decoder_sparse_step") or cfg.get("moe_layer_freq") or 1)
    mlp_only = set(cfg.get("mlp_only_layers") or [])
    moe_layers = sum(1 for i in range(layers) if i >= dense_first and i not in mlp_only and (i + 1) % step == 0)
    return experts, inter, moe_layers, top_k


def _param_counts(cfg: dict[str, Any]) -> tuple[int, int, int]:
    """(embedding + lm_head params, other dense linear params, routed expert params)."""
    hidden = require(cfg, "hidden_size")
    layers = require(cfg, "num_hidden_layers")
    vocab = require(cfg, "vocab_size")
    heads = require(cfg, "num_attention_heads")
    embed = vocab * hidden * (1 if cfg.get("tie_word_embeddings") else 2)

    if cfg.get("kv_lora_rank"):  # MLA
        nope, rope = require(cfg, "qk_nope_head_dim"), require(cfg, "qk_rope_head_dim")
        v_dim, kv_rank = require(cfg, "v_head_dim"), require(cfg, "kv_lora_rank")
        q_rank = cfg.get("q_lora_rank")
        q = (hidden * q_rank + q_rank * heads * (nope + rope)) if q_rank else hidden * heads * (nope + rope)
        attn = q + hidden * (kv_rank + rope) + kv_rank * heads * (nope + v_dim) + heads * v_dim * hidden
    else:
        hd, kv = head_dim(cfg), num_kv_heads(cfg)
        attn = 2 * hidden * heads * hd + 2 * hidden * kv * hd

    experts, inter, moe_layers, _ = _moe_shape(cfg)
    dense_mlp = 3 * hidden * int(cfg.get("intermediate_size") or 0)
    shared = 0
    if cfg.get("n_shared_experts"):
        shared = 3 * hidden * inter * int(cfg["n_shared_experts"])
    elif cfg.get("shared_expert_intermediate_size"):
        shared = 3 * hidden * int(cfg["shared_expert_intermediate_size"])
    if experts:
        router = hidden * experts
        other = layers * attn + moe_layers * (router + shared) + (layers - moe_layers) * dense_mlp
        return embed, other, moe_layers * experts * 3 * hidden * inter
    return embed, layers * (attn + dense_mlp), 0


def estimate_weights(
    hf_config: dict[str, Any], files: WeightFiles | None = None, dtype: str = "auto"
) -> WeightEstimate:
    cfg = text_config(hf_config)
    experts, _, moe_layers, top_k = _moe_shape(cfg)
    bits, method = quantized_bits(cfg, dtype)
    if files is not None:
        return WeightEstimate(
            files.dense_bytes, files.expert_bytes, "safetensors headers", bits, experts, moe_layers, top_k
        )
    embed, dense, expert = _param_counts(cfg)
    half = dtype_bytes(model_dtype_name(cfg, dtype))
    # Quantization covers the linear layers; embeddings and lm_head stay in the model dtype.
    # MXFP4 releases (gpt-oss) quantize only the experts.
    dense_bits = half * 8 if method == "mxfp4" else bits
    dense_bytes = int(embed * half + dense * dense_bits / 8)
    return WeightEstimate(dense_bytes, int(expert * bits / 8), "config.json", bits, experts, moe_layers, top_k)
