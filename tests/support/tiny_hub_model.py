"""A tiny Llama laid out as a model repo on the Hub is: config, tokenizer and generation config, real bf16
weights in two safetensors shards with their index, and the files vLLM would not load beside them (a
pytorch_model.bin, Meta's original/ checkpoint, a README), so that choosing what to download shows.

The weights match the config (hidden 128, 2 layers of 4 heads of 32, 2 KV heads, vocabulary 1024), so
vLLM could load them; they come from a fixed seed, so the repo's content and commit sha are the same
every run.
"""

from __future__ import annotations

import json
import random
import struct
from pathlib import Path

from manager.tiny_model import WORDS

SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
INDEX = "model.safetensors.index.json"
CONFIG_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
)
# What vLLM loads from such a repo: configs, tokenizer, the safetensors shards and their index.
SERVED_FILES = (*CONFIG_FILES, INDEX, *SHARDS)
NOT_LOADED = ("pytorch_model.bin", "original/consolidated.pth", "original/params.json", "README.md", ".gitattributes")

MiB = 1024**2
HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 128, 256, 2, 4, 2, 32, 1024
SPECIALS = ["<unk>", "<s>", "</s>", "<pad>"]

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": VOCAB,
    "hidden_size": HIDDEN,
    "intermediate_size": INTERMEDIATE,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": HEADS,
    "num_key_value_heads": KV_HEADS,
    "head_dim": HEAD_DIM,
    "hidden_act": "silu",
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 3,
    "tie_word_embeddings": False,
}


def make_tiny_hub_repo(folder: Path) -> Path:
    """Write the repo's files into ``folder`` (made if missing); returns it."""
    folder = Path(folder)
    (folder / "original").mkdir(parents=True, exist_ok=True)
    _write_json(folder / "config.json", CONFIG)
    _write_json(folder / "generation_config.json", {"bos_token_id": 1, "eos_token_id": 2, "do_sample": False})
    _write_tokenizer(folder)
    _write_weights(folder)
    noise = random.Random(0)
    (folder / "pytorch_model.bin").write_bytes(noise.randbytes(256 * 1024))
    (folder / "original" / "consolidated.pth").write_bytes(noise.randbytes(256 * 1024))
    _write_json(folder / "original" / "params.json", {"dim": HIDDEN, "n_layers": LAYERS, "n_heads": HEADS})
    (folder / "README.md").write_text("---\nlicense: apache-2.0\nlibrary_name: transformers\n---\n# tiny llama\n")
    (folder / ".gitattributes").write_text(
        "*.safetensors filter=lfs diff=lfs merge=lfs -text\n*.bin filter=lfs diff=lfs merge=lfs -text\n"
        "*.pth filter=lfs diff=lfs merge=lfs -text\n"
    )
    return folder


def _write_json(path: Path, data: object) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")


def _write_tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {tok: i for i, tok in enumerate(SPECIALS + WORDS)}
    for i in range(len(vocab), VOCAB):
        vocab[f"w{i}"] = i
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))
    specials = {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}
    _write_json(folder / "special_tokens_map.json", specials)
    _write_json(
        folder / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "model_max_length": 4096,
            "chat_template": "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:",
            **specials,
        },
    )


def _write_weights(folder: Path) -> None:
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)

    def weight(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    def layer(i: int) -> dict[str, torch.Tensor]:
        p = f"model.layers.{i}"
        return {
            f"{p}.self_attn.q_proj.weight": weight(HEADS * HEAD_DIM, HIDDEN),
            f"{p}.self_attn.k_proj.weight": weight(KV_HEADS * HEAD_DIM, HIDDEN),
            f"{p}.self_attn.v_proj.weight": weight(KV_HEADS * HEAD_DIM, HIDDEN),
            f"{p}.self_attn.o_proj.weight": weight(HIDDEN, HEADS * HEAD_DIM),
            f"{p}.mlp.gate_proj.weight": weight(INTERMEDIATE, HIDDEN),
            f"{p}.mlp.up_proj.weight": weight(INTERMEDIATE, HIDDEN),
            f"{p}.mlp.down_proj.weight": weight(HIDDEN, INTERMEDIATE),
            f"{p}.input_layernorm.weight": torch.ones(HIDDEN, dtype=torch.bfloat16),
            f"{p}.post_attention_layernorm.weight": torch.ones(HIDDEN, dtype=torch.bfloat16),
        }

    first = {"model.embed_tokens.weight": weight(VOCAB, HIDDEN), **layer(0)}
    second = {
        **layer(1),
        "model.norm.weight": torch.ones(HIDDEN, dtype=torch.bfloat16),
        "lm_head.weight": weight(VOCAB, HIDDEN),
    }
    weight_map: dict[str, str] = {}
    total = 0
    for name, tensors in zip(SHARDS, (first, second), strict=True):
        save_file(tensors, str(folder / name), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(tensors, name)
        total += sum(t.numel() * t.element_size() for t in tensors.values())
    _write_json(folder / INDEX, {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))})


def big_safetensors(mib: int) -> bytes:
    """A valid safetensors file of about ``mib`` MiB (one F32 tensor of zeros)."""
    count = mib * MiB // 4
    header = json.dumps({"w": {"dtype": "F32", "shape": [count], "data_offsets": [0, count * 4]}}).encode()
    header += b" " * (-len(header) % 8)
    return struct.pack("<Q", len(header)) + header + bytes(count * 4)
