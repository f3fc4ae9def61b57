"""What the hub caches hold and deleting from them, on caches laid out by huggingface_hub's own code."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest
from huggingface_hub import scan_cache_dir

from manager.errors import Conflict, Invalid, NotFound
from manager.hub import cache as hub_cache
from manager.supervisor.view import WorkerView
from manager.supervisor.worker_state import State
from tests.support.hub_cache import complete_model, put_revision, safetensors


@dataclass
class Config:
    name: str
    model: str
    env: dict[str, str] = field(default_factory=dict)


def worker(config: str, state: State, worker_id: int = 1) -> WorkerView:
    return WorkerView(
        id=worker_id, model=config, served_model_name=None, state=state, detail=None, pid=None, port=None,
        gpus=[], uptime_s=None, restart_count=0, next_restart_in_s=None, last_error=None, started_at=None,
        run_dir="/tmp", log_file=None,
    )  # fmt: skip


@pytest.fixture
def own(tmp_path, monkeypatch) -> Path:
    folder = tmp_path / "own" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(folder))
    return folder


def repos_in(folder: Path) -> set[str]:
    return {r.repo_id for r in scan_cache_dir(folder).repos}


def test_each_cache_lists_its_models_with_revisions_and_the_configs_using_them(own, tmp_path):
    old = put_revision(own, "Qwen/Qwen3-0.6B", {"config.json": b"{}"}, commit="a" * 40, refs=())
    put_revision(own, "Qwen/Qwen3-0.6B", complete_model(), commit="b" * 40, refs=("main",))
    put_revision(own, "org/some-data", {"data.csv": b"1,2"}, repo_type="dataset")
    other = tmp_path / "other"
    put_revision(other / "hub", "org/tiny", complete_model())
    configs = [
        Config("qwen", "Qwen/Qwen3-0.6B"),
        Config("tiny", "org/tiny", {"HF_HOME": "ignored-behind-HF_HUB_CACHE", "HF_HUB_CACHE": str(other / "hub")}),
        # A config naming a snapshot folder itself, whatever cache its env names.
        Config("pinned", str(old), {"HF_HUB_CACHE": str(tmp_path / "nowhere")}),
        Config("elsewhere", "org/gone", {"HF_HUB_CACHE": str(tmp_path / "nowhere")}),
    ]
    listed = hub_cache.list_caches(configs)

    assert [(c.path, c.own, c.found) for c in listed] == [
        (str(own), True, True),
        (str(other / "hub"), False, True),
        (str(tmp_path / "nowhere"), False, False),
    ]
    mine = listed[0]
    assert mine.configs == ["qwen"]
    assert [m.repo for m in mine.models] == ["Qwen/Qwen3-0.6B"]  # the dataset is not a model
    qwen = mine.models[0]
    assert qwen.used_by == ["qwen", "pinned"]
    assert [(r.commit, r.refs, r.complete, r.missing) for r in qwen.revisions] == [
        ("b" * 40, ["main"], True, []),
        ("a" * 40, [], False, ["*.safetensors"]),
    ]
    assert qwen.size_bytes == sum(len(v) for v in complete_model().values())  # the shared config counted once
    assert qwen.revisions[0].files == 3 and qwen.revisions[1].files == 1
    assert listed[1].models[0].repo == "org/tiny" and listed[1].models[0].used_by == ["tiny"]
    assert listed[2].models == [] and listed[2].configs == ["pinned", "elsewhere"]


def test_a_reader_without_the_token_does_not_see_paths_from_config_env(own, tmp_path):
    configs = [Config("tiny", "org/tiny", {"HF_HUB_CACHE": str(tmp_path / "secret-place")})]
    shown = hub_cache.as_seen_without_token(hub_cache.list_caches(configs))
    assert [c.path for c in shown] == [str(own), "<hidden>"]


def test_deleting_a_model_removes_all_its_revisions(own):
    put_revision(own, "org/a", complete_model(), commit="a" * 40, refs=())
    put_revision(own, "org/a", complete_model(weights=safetensors(fill=2)))
    put_revision(own, "org/b", complete_model())
    deleted = hub_cache.delete("org/a", [], [])
    assert len(deleted.revisions) == 2 and deleted.freed_bytes > 2 * len(safetensors())
    assert repos_in(own) == {"org/b"}
    assert not (own / "models--org--a").exists()


def test_a_duplicated_repo_sharing_its_commits_is_left_alone(own):
    # A repo duplicated on the Hub keeps the original's git history, so the same commit is in each copy.
    # huggingface_hub takes the first repo it meets with that commit: with six copies, deleting them one
    # by one in a fixed order finds a wrong pick almost surely.
    copies = [f"org{i}/model" for i in range(6)]
    for repo in copies:
        put_revision(own, repo, complete_model(), commit="c" * 40)
    for i, repo in enumerate(copies):
        hub_cache.delete(repo, [], [], revision="main" if i % 2 else None)
        assert repos_in(own) == set(copies[i + 1 :])


def test_deleting_one_revision_keeps_the_others_and_their_shared_files(own):
    put_revision(own, "org/a", complete_model(), commit="a" * 40, refs=("v1",))
    main = put_revision(own, "org/a", complete_model(weights=safetensors(fill=2)))
    deleted = hub_cache.delete("org/a", [], [], revision="v1")
    assert deleted.revisions == ["a" * 40] and deleted.freed_bytes == len(safetensors())  # its own weights only
    [repo] = scan_cache_dir(own).repos
    assert [r.commit_hash for r in repo.revisions] == [main.name]
    assert (main / "config.json").read_bytes() == complete_model()["config.json"]  # shared blob kept


def test_a_model_in_use_by_an_active_worker_is_not_deleted(own):
    put_revision(own, "org/a", complete_model())
    configs = [Config("a", "org/a"), Config("other", "org/other")]
    for state in (State.STARTING, State.READY, State.SLEEPING, State.CRASHED):
        with pytest.raises(Conflict, match=r"org/a is in use by worker 7 \(a, .*\): stop the worker"):
            hub_cache.delete("org/a", configs, [worker("a", state, 7)])
    assert repos_in(own) == {"org/a"}
    hub_cache.delete("org/a", configs, [worker("a", State.STOPPED), worker("other", State.READY, 2)])
    assert repos_in(own) == set()


def test_a_worker_reading_another_cache_does_not_hold_this_one(own, tmp_path):
    put_revision(own, "org/a", complete_model())
    configs = [Config("a-elsewhere", "org/a", {"HF_HUB_CACHE": str(tmp_path / "else")})]
    hub_cache.delete("org/a", configs, [worker("a-elsewhere", State.READY)])
    assert repos_in(own) == set()


def test_what_is_not_there_is_a_404(own):
    put_revision(own, "org/a", complete_model(), commit="c" * 40)
    with pytest.raises(NotFound, match="org/b is not in the hub cache"):
        hub_cache.delete("org/b", [], [])
    with pytest.raises(NotFound, match="has no revision main2; it has c{40} \\(main\\)"):
        hub_cache.delete("org/a", [], [], revision="main2")
    with pytest.raises(NotFound, match="is not a hub cache the manager or a model config uses"):
        hub_cache.delete("org/a", [], [], cache="/etc")
    put_revision(own, "datasets-only/x", {"a.csv": b"1"}, repo_type="dataset")
    with pytest.raises(NotFound):
        hub_cache.delete("datasets-only/x", [], [])


@pytest.mark.parametrize("repo", ["../etc", "org/..", "a/b/c", "noslash", "/abs/path", "org/.hidden"])
def test_only_owner_slash_name_ids_are_taken(own, repo):
    with pytest.raises(Invalid, match="owner/name"):
        hub_cache.delete(repo, [], [])


def test_an_id_that_only_looks_like_a_cache_folder_matches_nothing(own):
    put_revision(own, "org/x", complete_model())
    with pytest.raises(NotFound):
        hub_cache.delete("org--x/y", [], [])  # not the folder models--org--x, whatever its spelling
    assert repos_in(own) == {"org/x"}


def test_a_model_in_two_caches_needs_the_cache_named(own, tmp_path):
    other = tmp_path / "other-hub"
    put_revision(own, "org/a", complete_model())
    put_revision(other, "org/a", complete_model())
    configs = [Config("x", "org/x", {"HF_HUB_CACHE": str(other)})]
    with pytest.raises(Invalid, match="org/a is in 2 caches"):
        hub_cache.delete("org/a", configs, [])
    deleted = hub_cache.delete("org/a", configs, [], cache=str(other))
    assert deleted.cache == str(other)
    assert repos_in(other) == set() and repos_in(own) == {"org/a"}


def test_nothing_outside_the_cache_is_deleted(own, tmp_path):
    precious = tmp_path / "precious.safetensors"
    precious.write_bytes(b"keep me")
    put_revision(own, "org/a", complete_model(), commit="a" * 40, refs=())
    main = put_revision(own, "org/a", complete_model(weights=safetensors(fill=3)))
    (main / "model.safetensors").unlink()
    (main / "model.safetensors").symlink_to(precious)  # a link put there by hand, to a file outside
    with pytest.raises(Conflict, match="outside"):
        hub_cache.delete("org/a", [], [], revision="main")
    assert precious.read_bytes() == b"keep me"
    [repo] = scan_cache_dir(own).repos
    assert len(repo.revisions) == 2
    # Deleting the whole model only unlinks: the file outside stays.
    hub_cache.delete("org/a", [], [])
    assert precious.read_bytes() == b"keep me" and repos_in(own) == set()
