"""Which files of a Hub repo a vLLM start reads, from listings shaped like real repos', and whether a
local snapshot holds them all."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from manager.hub.files import RepoFile, choose, index_name_for, missing

GB = 1_000_000_000

# Llama-3.1-8B-Instruct's files, plus a pytorch_model.bin as repos converted to safetensors keep beside them.
LLAMA_SHARDS = {
    "model-00001-of-00004.safetensors": 4_976_698_672,
    "model-00002-of-00004.safetensors": 4_999_802_720,
    "model-00003-of-00004.safetensors": 4_915_916_176,
    "model-00004-of-00004.safetensors": 1_168_138_808,
}
LLAMA_SMALL = {
    "config.json": 855,
    "generation_config.json": 184,
    "model.safetensors.index.json": 23_950,
    "special_tokens_map.json": 296,
    "tokenizer.json": 9_085_657,
    "tokenizer_config.json": 55_351,
}
LLAMA = [
    *(RepoFile(p, s) for p, s in {**LLAMA_SHARDS, **LLAMA_SMALL}.items()),
    RepoFile("pytorch_model.bin", 16_060_617_592),
    RepoFile("original/consolidated.00.pth", 16_060_617_592),
    RepoFile("original/params.json", 199),
    RepoFile("original/tokenizer.model", 2_183_982),
    RepoFile("LICENSE", 7_627),
    RepoFile("README.md", 44_040),
    RepoFile("USE_POLICY.md", 4_691),
    RepoFile(".gitattributes", 1_519),
]


def index_of(files: dict[str, int] | list[str]) -> dict:
    """A safetensors index mapping one tensor to each shard (real ones map hundreds)."""
    return {"metadata": {}, "weight_map": {f"layers.{i}.weight": name for i, name in enumerate(files)}}


def test_a_sharded_repo_takes_its_shards_and_small_files_only():
    assert index_name_for(LLAMA) == "model.safetensors.index.json"
    chosen = choose(LLAMA, index_of(LLAMA_SHARDS))
    assert chosen.format == "hf"
    assert [f.path for f in chosen.weights] == sorted(LLAMA_SHARDS)
    assert {f.path for f in chosen.others} == set(LLAMA_SMALL)
    assert chosen.total_bytes == sum(LLAMA_SHARDS.values()) + sum(LLAMA_SMALL.values())
    assert chosen.index_name == "model.safetensors.index.json"
    patterns = chosen.allow_patterns()
    assert "pytorch_model.bin" not in patterns and not any(p.startswith("original/") for p in patterns)
    assert set(patterns) == set(LLAMA_SHARDS) | set(LLAMA_SMALL)


def test_the_index_is_required_when_the_repo_has_one():
    with pytest.raises(ValueError, match="model.safetensors.index.json"):
        choose(LLAMA, None)


# Mistral-7B-Instruct-v0.3: one consolidated file for Mistral's own format and the same weights as shards.
MISTRAL_7B = [
    RepoFile("consolidated.safetensors", 14_496_078_512),
    RepoFile("model-00001-of-00003.safetensors", 4_949_453_792),
    RepoFile("model-00002-of-00003.safetensors", 5_000_001_400),
    RepoFile("model-00003-of-00003.safetensors", 4_546_807_800),
    RepoFile("model.safetensors.index.json", 23_950),
    RepoFile("config.json", 601),
    RepoFile("generation_config.json", 116),
    RepoFile("params.json", 202),
    RepoFile("special_tokens_map.json", 414),
    RepoFile("tokenizer.json", 1_961_548),
    RepoFile("tokenizer.model", 587_404),
    RepoFile("tokenizer.model.v3", 587_404),
    RepoFile("tokenizer_config.json", 140_874),
    RepoFile("README.md", 7_088),
]


def test_a_mistral_repo_loads_its_consolidated_file_not_the_shards():
    assert index_name_for(MISTRAL_7B) is None  # one consolidated file: no consolidated index to read
    chosen = choose(MISTRAL_7B, None)
    assert chosen.format == "mistral"
    assert [f.path for f in chosen.weights] == ["consolidated.safetensors"]
    others = {f.path for f in chosen.others}
    assert {"params.json", "tokenizer.model.v3", "config.json"} <= others
    assert "model.safetensors.index.json" not in others and "README.md" not in others
    assert 14 * GB < chosen.total_bytes < 15 * GB


def test_a_sharded_mistral_repo_picks_consolidated_shards_through_their_index():
    consolidated = {f"consolidated-0000{i}-of-00003.safetensors": 8 * GB for i in (1, 2, 3)}
    hf_shards = {f"model-0000{i}-of-00003.safetensors": 8 * GB for i in (1, 2, 3)}
    listing = [
        *(RepoFile(p, s) for p, s in {**consolidated, **hf_shards}.items()),
        RepoFile("consolidated.safetensors.index.json", 30_000),
        RepoFile("model.safetensors.index.json", 30_000),
        RepoFile("params.json", 300),
        RepoFile("tekken.json", 14_800_000),
        RepoFile("config.json", 700),
    ]
    assert index_name_for(listing) == "consolidated.safetensors.index.json"
    chosen = choose(listing, index_of(consolidated))
    assert [f.path for f in chosen.weights] == sorted(consolidated)
    assert {f.path for f in chosen.others} == {
        "consolidated.safetensors.index.json",
        "params.json",
        "tekken.json",
        "config.json",
    }


def test_a_bin_only_repo_loads_its_bin_files_without_the_training_leftovers():
    # facebook/opt-125m's layout: PyTorch, TensorFlow and Flax weights side by side.
    listing = [
        RepoFile("pytorch_model.bin", 250_540_281),
        RepoFile("tf_model.h5", 501_000_000),
        RepoFile("flax_model.msgpack", 250_500_000),
        RepoFile("training_args.bin", 3_000),
        RepoFile("config.json", 651),
        RepoFile("generation_config.json", 137),
        RepoFile("merges.txt", 456_318),
        RepoFile("vocab.json", 898_822),
        RepoFile("special_tokens_map.json", 441),
        RepoFile("tokenizer_config.json", 685),
        RepoFile("LICENSE.md", 10_000),
    ]
    assert index_name_for(listing) is None
    chosen = choose(listing, None)
    assert [f.path for f in chosen.weights] == ["pytorch_model.bin"]
    assert {f.path for f in chosen.others} == {
        "config.json",
        "generation_config.json",
        "merges.txt",
        "vocab.json",
        "special_tokens_map.json",
        "tokenizer_config.json",
    }


def test_sharded_bin_files_are_all_loaded_and_pt_only_when_nothing_else_is_there():
    bins = [RepoFile(f"pytorch_model-0000{i}-of-00002.bin", 9 * GB) for i in (1, 2)]
    listing = [*bins, RepoFile("pytorch_model.bin.index.json", 26_000), RepoFile("config.json", 600)]
    assert [f.path for f in choose(listing, None).weights] == [f.path for f in bins]
    pt_only = [RepoFile("model.pt", 2 * GB), RepoFile("optimizer.pt", 4 * GB), RepoFile("config.json", 600)]
    assert [f.path for f in choose(pt_only, None).weights] == ["model.pt"]


def test_safetensors_the_index_does_not_name_are_dropped():
    listing = [*LLAMA, RepoFile("model-fp8.safetensors", 8 * GB), RepoFile("adapter_model.safetensors", GB)]
    chosen = choose(listing, index_of(LLAMA_SHARDS))
    assert [f.path for f in chosen.weights] == sorted(LLAMA_SHARDS)


def test_an_unsharded_repo_without_index_takes_its_one_file():
    listing = [RepoFile("model.safetensors", 1_200_000_000), RepoFile("config.json", 700), RepoFile("README.md", 9)]
    chosen = choose(listing, None)
    assert chosen.index_name is None
    assert chosen.allow_patterns() == ["model.safetensors", "config.json"]


def test_odd_characters_in_a_name_stay_exact_patterns():
    chosen = choose([RepoFile("model[v2].safetensors", 10), RepoFile("config.json", 1)], None)
    assert chosen.allow_patterns() == ["model[[]v2].safetensors", "config.json"]


# ---- a local snapshot --------------------------------------------------------------------------------


def snapshot(folder: Path, names: list[str], index: dict | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(b"{}" if name.endswith(".json") else b"x")
    if index is not None:
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return folder


def test_a_complete_snapshot_misses_nothing(tmp_path):
    folder = snapshot(tmp_path / "snap", ["config.json", "tokenizer.json", *LLAMA_SHARDS], index_of(LLAMA_SHARDS))
    assert missing(folder) == []


def test_a_snapshot_with_only_its_config_misses_the_weights(tmp_path):
    assert missing(snapshot(tmp_path / "a", ["config.json"])) == ["*.safetensors"]
    # With the index fetched too, the shards to come are named.
    indexed = snapshot(tmp_path / "b", ["config.json"], index_of(LLAMA_SHARDS))
    assert missing(indexed) == sorted(LLAMA_SHARDS)


def test_a_partial_download_names_the_absent_shards(tmp_path):
    shards = sorted(LLAMA_SHARDS)
    folder = snapshot(tmp_path / "snap", ["config.json", *shards[:2]], index_of(shards))
    assert missing(folder) == shards[2:]


def test_a_folder_without_config_says_so(tmp_path):
    assert missing(snapshot(tmp_path / "snap", ["model.safetensors"])) == ["config.json"]


def test_a_mistral_snapshot_needs_params_json_or_config_json(tmp_path):
    assert missing(snapshot(tmp_path / "a", ["consolidated.safetensors", "params.json", "tekken.json"])) == []
    assert missing(snapshot(tmp_path / "b", ["consolidated.safetensors"])) == ["config.json"]
    # Mistral's format takes over once a consolidated file is there: shards alone do not count.
    assert missing(
        snapshot(tmp_path / "c", ["model.safetensors", "config.json", "original/consolidated.safetensors"])
    ) == ["consolidated*.safetensors"]


def test_a_broken_link_is_not_a_file_there(tmp_path):
    folder = snapshot(tmp_path / "snap", ["config.json"])
    (folder / "model.safetensors").symlink_to(tmp_path / "blobs" / "gone")
    assert missing(folder) == ["*.safetensors"]


def test_an_unreadable_index_is_reported(tmp_path):
    folder = snapshot(tmp_path / "snap", ["config.json", "model-00001-of-00002.safetensors"])
    (folder / "model.safetensors.index.json").write_text("{not json")
    assert missing(folder) == ["model.safetensors.index.json (not readable JSON)"]
