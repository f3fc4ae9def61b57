"""A Hugging Face hub cache on disk, laid out by huggingface_hub's own code without a hub to download from.

``hf_hub_download`` stores a file as ``blobs/<hash>``, links ``snapshots/<commit>/<path>`` to it with a
relative symlink and writes ``refs/<revision>`` with the commit; the same functions of
``huggingface_hub.file_download`` do it here, so ``scan_cache_dir`` reads the result as it reads a real
cache.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Mapping
from pathlib import Path

from huggingface_hub import file_download


def put_revision(
    cache: Path,
    repo: str,
    files: Mapping[str, bytes],
    *,
    commit: str | None = None,
    refs: tuple[str, ...] = ("main",),
    repo_type: str = "model",
) -> Path:
    """Store ``files`` (path in the repo -> content) as one revision of ``repo``; its snapshot folder."""
    storage = cache / file_download.repo_folder_name(repo_id=repo, repo_type=repo_type)
    commit = commit or hashlib.sha1(repr(sorted(files.items())).encode()).hexdigest()
    for path, content in files.items():
        blob = storage / "blobs" / hashlib.sha256(content).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        new_blob = not blob.exists()
        if new_blob:
            blob.write_bytes(content)
        pointer = Path(file_download._get_pointer_path(str(storage), commit, path))
        pointer.parent.mkdir(parents=True, exist_ok=True)
        file_download._create_symlink(str(blob), str(pointer), new_blob=new_blob)
    (storage / "snapshots" / commit).mkdir(parents=True, exist_ok=True)
    for ref in refs:
        file_download._cache_commit_hash_for_specific_revision(str(storage), ref, commit)
    return storage / "snapshots" / commit


def safetensors(values: int = 256, fill: int = 0) -> bytes:
    """A safetensors file of one float32 tensor: the 8-byte header length, the JSON header, the data."""
    header = json.dumps({"w": {"dtype": "F32", "shape": [values], "data_offsets": [0, 4 * values]}}).encode()
    return struct.pack("<Q", len(header)) + header + bytes([fill]) * (4 * values)


LLAMA_CONFIG = json.dumps(
    {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 1024,
        "max_position_embeddings": 2048,
        "torch_dtype": "bfloat16",
    }
).encode()


def complete_model(weights: bytes | None = None) -> dict[str, bytes]:
    """The files of a small complete model: a config, a tokenizer and one safetensors file."""
    return {"config.json": LLAMA_CONFIG, "tokenizer.json": b"{}", "model.safetensors": weights or safetensors()}
