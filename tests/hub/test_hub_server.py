"""The loopback hub answers the real huggingface_hub client as the Hugging Face Hub does."""

from __future__ import annotations

import hashlib
import json
import random
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from huggingface_hub import HfApi, hf_hub_download, scan_cache_dir, snapshot_download
from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

from tests.support.hub_server import GOOD_TOKEN, TestHub
from tests.support.tiny_hub_model import INDEX, NOT_LOADED, SERVED_FILES, SHARDS

REPO = "tiny-org/tiny-llama"
MIB = 1024 * 1024
# huggingface_hub writes (and so resumes from) whole pieces of this size: a smaller file starts over.
CLIENT_PIECE = 10 * MIB


@pytest.fixture
def tiny_repo(test_hub: TestHub, tiny_hub_repo: Path) -> str:
    return test_hub.add_repo_from_folder(REPO, tiny_hub_repo)


def header_of(path: Path) -> dict:
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + length])


def test_snapshot_fetches_only_the_allowed_files_into_the_standard_cache(
    test_hub: TestHub, tiny_repo: str, tiny_hub_repo: Path, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    allowed = ["*.safetensors", "model.safetensors.index.json", "config.json", "generation_config.json", "tokenizer*"]
    allowed.append("special_tokens_map.json")

    folder = Path(snapshot_download(REPO, allow_patterns=allowed, endpoint=test_hub.url, cache_dir=cache))

    assert folder == cache / "models--tiny-org--tiny-llama" / "snapshots" / tiny_repo
    got = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}
    assert got == set(SERVED_FILES)
    assert all((folder / f).read_bytes() == (tiny_hub_repo / f).read_bytes() for f in SERVED_FILES)
    assert all(test_hub.bytes_served(REPO, f) == 0 for f in NOT_LOADED)
    (repo,) = scan_cache_dir(cache).repos
    assert repo.repo_id == REPO and repo.refs["main"].commit_hash == tiny_repo
    assert repo.size_on_disk == sum((tiny_hub_repo / f).stat().st_size for f in SERVED_FILES)
    # Nothing but the hub's own routes was asked for: no Xet, no other host.
    assert all(r.path.startswith(("/api/models/", f"/{REPO}/resolve/", "/cdn/")) for r in test_hub.requests)


def test_safetensors_metadata_comes_from_range_reads_of_the_shard_headers(
    test_hub: TestHub, tiny_repo: str, tiny_hub_repo: Path
) -> None:
    meta = HfApi(endpoint=test_hub.url, token=False).get_safetensors_metadata(REPO)

    assert meta.sharded and set(meta.files_metadata) == set(SHARDS)
    for shard in SHARDS:
        header = header_of(tiny_hub_repo / shard)
        tensors = meta.files_metadata[shard].tensors
        assert set(tensors) == set(header) - {"__metadata__"}
        for name, t in tensors.items():
            assert (t.dtype, t.shape, list(t.data_offsets)) == (
                "BF16",
                header[name]["shape"],
                header[name]["data_offsets"],
            )
        size = (tiny_hub_repo / shard).stat().st_size
        reads = [r for r in test_hub.requests if r.method == "GET" and r.path.endswith(shard)]
        assert reads and all(r.range is not None for r in reads)
        assert 0 < test_hub.bytes_served(REPO, shard) <= 100_001 < size
    assert meta.weight_map == json.loads((tiny_hub_repo / INDEX).read_text())["weight_map"]


def test_every_shard_header_in_one_call(test_hub: TestHub, tiny_repo: str) -> None:
    api = HfApi(endpoint=test_hub.url, token=False)

    at_once = api.get_sharded_safetensors_metadata(REPO)

    assert at_once.files_metadata == api.get_safetensors_metadata(REPO).files_metadata
    assert all(test_hub.bytes_served(REPO, s) > 0 for s in SHARDS)  # only from the second call


def test_model_info_gives_the_commit_and_file_sizes(test_hub: TestHub, tiny_repo: str, tiny_hub_repo: Path) -> None:
    info = HfApi(endpoint=test_hub.url, token=False).model_info(REPO, files_metadata=True)

    assert info.sha == tiny_repo and info.gated is False
    siblings = {s.rfilename: s for s in info.siblings or []}
    assert set(siblings) == set(SERVED_FILES) | set(NOT_LOADED)
    for name, s in siblings.items():
        content = (tiny_hub_repo / name).read_bytes()
        assert s.size == len(content)
        if name.endswith((".safetensors", ".bin", ".pth")):
            assert s.lfs is not None and s.lfs.sha256 == hashlib.sha256(content).hexdigest()
        else:
            assert s.lfs is None
    assert info.safetensors is not None and set(info.safetensors.parameters) == {"BF16"}


def test_a_dropped_connection_is_resumed_with_a_range(test_hub: TestHub, tmp_path: Path) -> None:
    data = random.Random(1).randbytes(CLIENT_PIECE + 2 * MIB)
    test_hub.add_repo("org/big", {"big.safetensors": data})
    test_hub.set_faults(drop_after_bytes=CLIENT_PIECE + MIB)

    path = hf_hub_download("org/big", "big.safetensors", endpoint=test_hub.url, cache_dir=tmp_path)

    assert Path(path).read_bytes() == data
    gets = [r for r in test_hub.requests if r.method == "GET" and r.path.startswith("/cdn/")]
    assert [r.range for r in gets] == [None, f"bytes={CLIENT_PIECE}-"]


def test_a_killed_download_leaves_its_part_and_the_next_starts_over(test_hub: TestHub, tmp_path: Path) -> None:
    # huggingface_hub 2.4 downloads into a file of its own per call and never resumes another call's.
    data = random.Random(2).randbytes(CLIENT_PIECE + 2 * MIB)
    test_hub.add_repo("org/big", {"big.safetensors": data})
    test_hub.set_faults(stall_after_bytes=CLIENT_PIECE + MIB)
    fetch = "import sys; from huggingface_hub import hf_hub_download as d; d('org/big', 'big.safetensors', endpoint=sys.argv[1], cache_dir=sys.argv[2])"
    proc = subprocess.Popen([sys.executable, "-c", fetch, test_hub.url, str(tmp_path)], stderr=subprocess.DEVNULL)
    try:
        assert test_hub.wait_stalled(10)
        deadline = time.monotonic() + 5  # until the client has written what it got
        while _part_size(tmp_path) < CLIENT_PIECE and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        proc.kill()
        proc.wait()
    test_hub.release()

    path = hf_hub_download("org/big", "big.safetensors", endpoint=test_hub.url, cache_dir=tmp_path)

    assert Path(path).read_bytes() == data
    gets = [r for r in test_hub.requests if r.method == "GET" and r.path.startswith("/cdn/")]
    assert [r.range for r in gets] == [None, None]
    (left,) = scan_cache_dir(tmp_path).incomplete_files  # the killed call's part, never cleaned up
    assert left.size_on_disk == CLIENT_PIECE


def _part_size(cache: Path) -> int:
    return sum(f.size_on_disk for f in scan_cache_dir(cache).incomplete_files) if cache.exists() else 0


def test_a_stalled_download_goes_on_when_released(test_hub: TestHub, tmp_path: Path) -> None:
    data = random.Random(3).randbytes(MIB)
    test_hub.add_repo("org/m", {"w.safetensors": data})
    test_hub.set_faults(stall_after_bytes=1000)
    got: list[str] = []
    t = threading.Thread(
        target=lambda: got.append(hf_hub_download("org/m", "w.safetensors", endpoint=test_hub.url, cache_dir=tmp_path))
    )
    t.start()
    assert test_hub.wait_stalled(5)
    time.sleep(0.2)
    assert t.is_alive() and test_hub.bytes_served("org/m", "w.safetensors") == 1000

    test_hub.release()
    t.join(5)

    assert Path(got[0]).read_bytes() == data


def test_a_gated_repo_wants_a_token_with_access(test_hub: TestHub, tmp_path: Path) -> None:
    test_hub.add_repo("org/gated", {"config.json": b"{}", "model.safetensors": b"weights"}, gated=True)

    with pytest.raises(GatedRepoError, match="restricted.*Please log in"):
        hf_hub_download("org/gated", "model.safetensors", endpoint=test_hub.url, cache_dir=tmp_path, token=False)
    with pytest.raises(GatedRepoError, match="not in the authorized list"):
        hf_hub_download("org/gated", "config.json", endpoint=test_hub.url, cache_dir=tmp_path, token="hf_other")
    api = HfApi(endpoint=test_hub.url, token=False)
    assert api.model_info("org/gated").gated == "manual"  # the card and file list stay public, as on the hub

    path = hf_hub_download(
        "org/gated", "model.safetensors", endpoint=test_hub.url, cache_dir=tmp_path, token=GOOD_TOKEN
    )

    assert Path(path).read_bytes() == b"weights"


def test_unknown_repos_revisions_and_files(test_hub: TestHub, tmp_path: Path) -> None:
    test_hub.add_repo("org/m", {"config.json": b"{}"})
    api = HfApi(endpoint=test_hub.url, token=False)

    with pytest.raises(RepositoryNotFoundError):
        api.model_info("org/nothing")
    with pytest.raises(RepositoryNotFoundError):
        hf_hub_download("org/nothing", "config.json", endpoint=test_hub.url, cache_dir=tmp_path)
    with pytest.raises(RevisionNotFoundError):
        api.model_info("org/m", revision="v9")
    assert not api.file_exists("org/m", "model.safetensors")
    assert api.file_exists("org/m", "config.json")


def test_an_older_commit_stays_downloadable_by_its_sha(test_hub: TestHub, tmp_path: Path) -> None:
    old = test_hub.add_repo("org/m", {"config.json": b'{"v": 1}'})
    new = test_hub.add_repo("org/m", {"config.json": b'{"v": 2}'})

    assert old != new and HfApi(endpoint=test_hub.url, token=False).model_info("org/m").sha == new
    path = hf_hub_download("org/m", "config.json", revision=old, endpoint=test_hub.url, cache_dir=tmp_path)
    assert Path(path).read_bytes() == b'{"v": 1}'


def test_a_slow_hub_takes_as_long_as_its_rate(test_hub: TestHub, tmp_path: Path) -> None:
    data = random.Random(4).randbytes(MIB)
    test_hub.add_repo("org/m", {"w.safetensors": data})
    test_hub.set_faults("org/m", rate_bytes_per_s=2 * MIB)

    began = time.monotonic()
    path = hf_hub_download("org/m", "w.safetensors", endpoint=test_hub.url, cache_dir=tmp_path)

    assert time.monotonic() - began >= 0.4  # 0.5 s at 2 MiB/s
    assert Path(path).read_bytes() == data


def test_repo_ids_without_an_owner(test_hub: TestHub, tmp_path: Path) -> None:
    sha = test_hub.add_repo("gpt2", {"config.json": b"{}", "sub/dir/f.bin": b"x"})
    api = HfApi(endpoint=test_hub.url, token=False)

    assert api.model_info("gpt2").sha == sha
    assert api.list_repo_files("gpt2") == ["config.json", "sub/dir/f.bin"]
    assert [e.path for e in api.list_repo_tree("gpt2", "sub")] == ["sub/dir"]
    path = hf_hub_download("gpt2", "sub/dir/f.bin", endpoint=test_hub.url, cache_dir=tmp_path)
    assert Path(path).read_bytes() == b"x"


def test_resolve_answers_as_the_hub_does(test_hub: TestHub) -> None:
    sha = test_hub.add_repo("org/m", {"config.json": b'{"a": 1}', "w.safetensors": b"0123456789"})
    resolve = f"{test_hub.url}/org/m/resolve/main"
    with httpx.Client() as http:
        lfs = http.head(f"{resolve}/w.safetensors")
        small = http.get(f"{resolve}/config.json", headers={"Range": "bytes=2-5"})
        cdn = lfs.headers["Location"]
        tail = http.get(cdn, headers={"Range": "bytes=7-"})
        past = http.get(cdn, headers={"Range": "bytes=10-"})
        missing = http.head(f"{resolve}/nothing.json")

    assert lfs.status_code == 302 and lfs.headers["X-Repo-Commit"] == sha
    assert (
        lfs.headers["X-Linked-Size"] == "10"
        and lfs.headers["X-Linked-Etag"].strip('"') == hashlib.sha256(b"0123456789").hexdigest()
    )
    assert cdn.startswith(test_hub.cdn_url) and test_hub.cdn_url != test_hub.url  # another origin, as the hub's CDN
    assert not any(h.lower().startswith("x-xet") for h in lfs.headers)
    assert (small.status_code, small.content, small.headers["Content-Range"]) == (206, b'a": ', "bytes 2-5/8")
    assert (tail.status_code, tail.content, tail.headers["Content-Range"]) == (206, b"789", "bytes 7-9/10")
    assert past.status_code == 416
    assert missing.status_code == 404 and missing.headers["X-Error-Code"] == "EntryNotFound"
    assert missing.headers["X-Repo-Commit"] == sha
