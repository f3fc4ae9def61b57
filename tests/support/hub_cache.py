"""A Hugging Face hub cache on disk, laid out by huggingface_hub's own code without a hub to download from.

``hf_hub_download`` stores a file as ``blobs/<hash>``, links ``snapshots/<commit>/<path>`` to it with a
relative symlink and writes ``refs/<revision>`` with the commit; the same functions of
``huggingface_hub.file_download`` do it here, so ``scan_cache_dir`` reads the result as it reads a real
cache.
"""

from __future__ import annotations

import hashlib
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


def complete_model(config: bytes = b'{"model_type": "llama"}', weights: bytes = b"w" * 1000) -> dict[str, bytes]:
    """The files of a small complete model: a config, a tokenizer and one safetensors file."""
    return {"config.json": config, "tokenizer.json": b"{}", "model.safetensors": weights}
