"""Whether a config's hub model is in the engine's cache: a snapshot holding only what the planner
fetched (config.json) is not, so a start still says it downloads, and offline it is refused."""

from __future__ import annotations

import pytest

from manager.errors import Invalid
from manager.hub.model_location import check_startable, download_note, not_cached
from manager.planner.model_files import find_model_folder
from tests.support.hub_cache import complete_model, put_revision


@pytest.fixture
def cache(tmp_path, monkeypatch):
    folder = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(folder))
    return folder


def test_a_complete_snapshot_is_in_the_cache(cache):
    put_revision(cache, "org/m", complete_model())
    assert not_cached("org/m", {}) is None
    assert download_note("org/m", {}) is None
    check_startable("org/m", {"HF_HUB_OFFLINE": "1"})


def test_a_snapshot_with_only_the_config_still_needs_a_download(cache):
    snap = put_revision(cache, "org/m", {"config.json": b'{"model_type": "llama"}'})
    assert find_model_folder("org/m") == snap  # the planner reads its config all the same
    assert not_cached("org/m", {}) == cache
    assert "org/m is not in this machine's Hugging Face cache" in (download_note("org/m", {}) or "")
    with pytest.raises(Invalid, match="HF_HUB_OFFLINE is set"):
        check_startable("org/m", {"HF_HUB_OFFLINE": "1"})


def test_a_sharded_snapshot_missing_a_shard_is_not_complete(cache):
    index = b'{"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}'
    files = {"config.json": b"{}", "model.safetensors.index.json": index, "model-00001-of-00002.safetensors": b"1"}
    put_revision(cache, "org/m", files)
    assert not_cached("org/m", {}) == cache
    put_revision(cache, "org/m", {**files, "model-00002-of-00002.safetensors": b"2"})  # the next commit, on main
    assert not_cached("org/m", {}) is None


def test_the_configs_own_cache_is_the_one_looked_at(cache, tmp_path):
    other = tmp_path / "elsewhere"
    put_revision(other / "hub", "org/m", complete_model())
    assert not_cached("org/m", {}) == cache
    assert not_cached("org/m", {"HF_HUB_CACHE": str(other / "hub")}) is None
    # HF_HOME names a cache only where HF_HUB_CACHE does not: the manager's own wins in the engine too.
    assert not_cached("org/m", {"HF_HOME": str(other)}) == cache
