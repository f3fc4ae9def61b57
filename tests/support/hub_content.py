"""What the test hub holds: repos, their commits and files, and the JSON the real hub answers about them.

Files are stored the way the hub stores them: small text files in git (their ETag is the git blob id),
weights in LFS (their ETag is the git id of the LFS pointer, and the sha256 of the content is what
huggingface_hub keys its cache on). No file carries a Xet hash, so huggingface_hub never tries Xet.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import struct
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path, PurePosixPath

# As a model repo's .gitattributes puts them in LFS; anything from 10 MiB up goes there too.
LFS_PATTERNS = ("*.safetensors", "*.bin", "*.pth", "*.pt", "*.ckpt", "*.gguf", "*.h5", "*.onnx", "*.msgpack", "*.model")
LFS_MIN_SIZE = 10 * 1024 * 1024
READ_CHUNK = 64 * 1024


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def lfs_pointer(sha256: str, size: int) -> bytes:
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n".encode()


@dataclass(frozen=True)
class HubFile:
    path: str
    size: int
    blob_id: str  # git's id of what git holds: the content, or the LFS pointer
    sha256: str
    lfs: bool
    pointer_size: int | None
    source: bytes | Path = field(repr=False)

    @classmethod
    def of(cls, path: str, source: bytes | Path) -> HubFile:
        digest = hashlib.sha256()
        size = 0
        for chunk in _chunks(source, 0, None, READ_CHUNK):
            digest.update(chunk)
            size += len(chunk)
        sha256 = digest.hexdigest()
        lfs = size >= LFS_MIN_SIZE or any(fnmatch.fnmatch(PurePosixPath(path).name, p) for p in LFS_PATTERNS)
        if lfs:
            pointer = lfs_pointer(sha256, size)
            return cls(path, size, git_blob_id(pointer), sha256, True, len(pointer), source)
        data = source if isinstance(source, bytes) else source.read_bytes()
        return cls(path, size, git_blob_id(data), sha256, False, None, source)

    def chunks(self, start: int, end: int, size: int) -> Iterator[bytes]:
        """The bytes [start, end) in pieces of at most ``size``."""
        return _chunks(self.source, start, end, size)

    def head(self, n: int) -> bytes:
        return b"".join(self.chunks(0, min(n, self.size), READ_CHUNK))


def _chunks(source: bytes | Path, start: int, end: int | None, size: int) -> Iterator[bytes]:
    if isinstance(source, bytes):
        stop = len(source) if end is None else end
        for pos in range(start, stop, size):
            yield source[pos : min(pos + size, stop)]
        return
    with source.open("rb") as fh:
        fh.seek(start)
        pos = start
        while end is None or pos < end:
            chunk = fh.read(size if end is None else min(size, end - pos))
            if not chunk:
                return
            pos += len(chunk)
            yield chunk


@dataclass(frozen=True)
class Commit:
    sha: str
    files: Mapping[str, HubFile]
    date: datetime

    def folders(self) -> set[str]:
        return {str(parent) for path in self.files for parent in PurePosixPath(path).parents if str(parent) != "."}

    def tree(self, under: str, recursive: bool) -> list[dict] | None:
        """The tree listing of folder ``under`` ('' for the root), or None when there is no such folder."""
        folders = self.folders()
        if under and under not in folders:
            return None
        prefix = f"{under}/" if under else ""

        def listed(path: str) -> bool:
            return path.startswith(prefix) and (recursive or "/" not in path[len(prefix) :])

        entries = [self.folder_entry(p) for p in sorted(folders) if listed(p)]
        return entries + [file_entry(f) for p, f in sorted(self.files.items()) if listed(p)]

    def folder_entry(self, path: str) -> dict:
        oid = hashlib.sha1(f"tree {self.sha} {path}".encode()).hexdigest()
        return {"type": "directory", "oid": oid, "size": 0, "path": path}

    def safetensors_headers(self) -> dict[str, dict]:
        """The header of each .safetensors file that has one, as parsed JSON."""
        headers = {p: read_safetensors_header(f) for p, f in self.files.items() if p.endswith(".safetensors")}
        return {p: h for p, h in headers.items() if h is not None}


def file_entry(f: HubFile) -> dict:
    entry: dict = {"type": "file", "oid": f.blob_id, "size": f.size, "path": f.path}
    if f.lfs:
        entry["lfs"] = {"oid": f.sha256, "size": f.size, "pointerSize": f.pointer_size}
    return entry


def read_safetensors_header(f: HubFile) -> dict | None:
    """None when the file is no safetensors file (a test may well add one that is not)."""
    if f.size < 8:
        return None
    (length,) = struct.unpack("<Q", f.head(8))
    try:
        header = json.loads(f.head(8 + length)[8:]) if 8 + length <= f.size else None
    except ValueError:
        return None
    return header if isinstance(header, dict) else None


@dataclass
class Repo:
    repo_id: str
    gated: bool
    commits: dict[str, Commit] = field(default_factory=dict)
    refs: dict[str, str] = field(default_factory=dict)  # branch -> commit sha
    created: datetime = field(default_factory=lambda: datetime.now(UTC))

    def at(self, revision: str) -> Commit | None:
        sha = self.refs.get(revision, revision)
        return self.commits.get(sha)


def commit_sha(repo_id: str, files: Mapping[str, HubFile], parent: str | None) -> str:
    h = hashlib.sha1(f"{repo_id}\n{parent or ''}\n".encode())
    for path, f in sorted(files.items()):
        h.update(f"{path}\0{f.sha256}\n".encode())
    return h.hexdigest()


def iso(t: datetime) -> str:
    return t.strftime("%Y-%m-%dT%H:%M:%S.000Z")


def model_info(repo: Repo, commit: Commit, *, blobs: bool) -> dict:
    """GET /api/models/{repo}[/revision/{rev}] as the hub answers it (``blobs``: files_metadata=True)."""
    siblings = []
    for path, f in sorted(commit.files.items()):
        sibling: dict = {"rfilename": path}
        if blobs:
            sibling |= {"size": f.size, "blobId": f.blob_id}
            if f.lfs:
                sibling["lfs"] = {"sha256": f.sha256, "size": f.size, "pointerSize": f.pointer_size}
        siblings.append(sibling)
    info: dict = {
        "_id": hashlib.sha1(repo.repo_id.encode()).hexdigest()[:24],
        "id": repo.repo_id,
        "modelId": repo.repo_id,
        "author": repo.repo_id.split("/")[0] if "/" in repo.repo_id else None,
        "sha": commit.sha,
        "lastModified": iso(commit.date),
        "createdAt": iso(repo.created),
        "private": False,
        "gated": "manual" if repo.gated else False,
        "disabled": False,
        "downloads": 0,
        "likes": 0,
        "tags": [],
        "siblings": siblings,
        "spaces": [],
        "usedStorage": sum(f.size for f in commit.files.values()),
    }
    config = _json_file(commit, "config.json")
    if config is not None:
        info["library_name"] = "transformers"
        info["tags"].append("transformers")
        info["config"] = {k: config[k] for k in ("architectures", "model_type") if k in config}
    headers = commit.safetensors_headers()
    if headers:
        info["tags"].append("safetensors")
        info["safetensors"] = safetensors_parameters(headers.values())
    return info


def safetensors_parameters(headers: Iterable[dict]) -> dict:
    """The hub's ``safetensors`` summary: parameters per dtype, and their total."""
    per_dtype: dict[str, int] = {}
    for header in headers:
        for name, tensor in header.items():
            if name == "__metadata__":
                continue
            count = 1
            for dim in tensor["shape"]:
                count *= dim
            per_dtype[tensor["dtype"]] = per_dtype.get(tensor["dtype"], 0) + count
    return {"parameters": per_dtype, "total": sum(per_dtype.values())}


def _json_file(commit: Commit, path: str) -> dict | None:
    f = commit.files.get(path)
    if f is None:
        return None
    try:
        data = json.loads(f.head(f.size))
    except ValueError:
        return None
    return data if isinstance(data, dict) else None


def safetensors_index(commit: Commit, filename: str) -> dict | None:
    """GET /api/models/{repo}/safetensors-metadata/{index}: the index less its weight map, and every
    shard's header (None when the index is not there)."""
    index = _json_file(commit, filename)
    if index is None:
        return None
    folder = str(PurePosixPath(filename).parent)
    shards = sorted(set(index.get("weight_map", {}).values()))
    headers = {}
    for shard in shards:
        f = commit.files.get(shard if folder == "." else f"{folder}/{shard}")
        header = read_safetensors_header(f) if f is not None else None
        if header is not None:
            headers[shard] = header
    return {"index": {k: v for k, v in index.items() if k != "weight_map"}, "headers": headers}
