"""Synthetic PEFT LoRA adapters for the tiny test models: adapter_config.json + safetensors.

The tensors follow PEFT's naming (``base_model.model.<module>.lora_A.weight`` of [rank, in],
``lora_B.weight`` of [out, rank]) and the tiny models' real shapes, so vLLM loads them as it would
a trained adapter. Values are seeded random numbers; nothing is downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file


# (in, out) of each Llama projection, from the model's config.json.
def llama_projections(config: dict) -> dict[str, tuple[str, int, int]]:
    hidden = config["hidden_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q_out = config["num_attention_heads"] * head_dim
    kv_out = config["num_key_value_heads"] * head_dim
    inter = config["intermediate_size"]
    return {
        "q_proj": ("self_attn", hidden, q_out),
        "k_proj": ("self_attn", hidden, kv_out),
        "v_proj": ("self_attn", hidden, kv_out),
        "o_proj": ("self_attn", q_out, hidden),
        "gate_proj": ("mlp", hidden, inter),
        "up_proj": ("mlp", hidden, inter),
        "down_proj": ("mlp", inter, hidden),
    }


def make_llama_adapter(
    folder: Path,
    model_dir: Path,
    *,
    rank: int = 8,
    alpha: int = 16,
    targets: tuple[str, ...] = ("q_proj", "v_proj"),
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
) -> Path:
    """A PEFT LoRA adapter for a Llama-shaped model at ``model_dir``."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    shapes = llama_projections(config)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for target in targets:
            block, fan_in, fan_out = shapes[target]
            prefix = f"base_model.model.model.layers.{layer}.{block}.{target}"
            tensors[f"{prefix}.lora_A.weight"] = (torch.randn(rank, fan_in, generator=generator) * 0.02).to(dtype)
            tensors[f"{prefix}.lora_B.weight"] = (torch.randn(fan_out, rank, generator=generator) * 0.02).to(dtype)
    return _save(folder, tensors, rank=rank, alpha=alpha, targets=list(targets), base=str(model_dir))


def make_moe_adapter(
    folder: Path, model_dir: Path, *, rank: int = 8, alpha: int = 16, seed: int = 0, dtype: torch.dtype = torch.bfloat16
) -> Path:
    """A PEFT LoRA adapter for a Qwen3-MoE model: attention q/v plus every expert's MLP."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    hidden = config["hidden_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    inter = config["moe_intermediate_size"]
    generator = torch.Generator().manual_seed(seed)

    def pair(prefix: str, fan_in: int, fan_out: int) -> None:
        tensors[f"{prefix}.lora_A.weight"] = (torch.randn(rank, fan_in, generator=generator) * 0.02).to(dtype)
        tensors[f"{prefix}.lora_B.weight"] = (torch.randn(fan_out, rank, generator=generator) * 0.02).to(dtype)

    tensors: dict[str, torch.Tensor] = {}
    for layer in range(config["num_hidden_layers"]):
        base = f"base_model.model.model.layers.{layer}"
        pair(f"{base}.self_attn.q_proj", hidden, config["num_attention_heads"] * head_dim)
        pair(f"{base}.self_attn.v_proj", hidden, config["num_key_value_heads"] * head_dim)
        experts = config.get("num_experts") or config["num_local_experts"]
        for expert in range(experts):
            e = f"{base}.mlp.experts.{expert}"
            pair(f"{e}.gate_proj", hidden, inter)
            pair(f"{e}.up_proj", hidden, inter)
            pair(f"{e}.down_proj", inter, hidden)
    return _save(
        folder,
        tensors,
        rank=rank,
        alpha=alpha,
        targets=["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"],
        base=str(model_dir),
    )


def _save(
    folder: Path, tensors: dict[str, torch.Tensor], *, rank: int, alpha: int, targets: list[str], base: str
) -> Path:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(
        json.dumps(
            {
                "peft_type": "LORA",
                "task_type": "CAUSAL_LM",
                "base_model_name_or_path": base,
                "r": rank,
                "lora_alpha": alpha,
                "lora_dropout": 0.0,
                "bias": "none",
                "target_modules": targets,
                "fan_in_fan_out": False,
                "modules_to_save": None,
                "use_rslora": False,
                "use_dora": False,
                "init_lora_weights": True,
            },
            indent=2,
        )
    )
    return folder
