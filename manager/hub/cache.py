"""What the Hugging Face hub caches on this machine hold, and deleting models from them.

The caches that matter are the manager's own (``hub_cache_dir()`` of this process) and each one a
model config's engine reads (``HF_HUB_CACHE`` / ``HF_HOME`` in its env). huggingface_hub scans them
(``scan_cache_dir``) and deletes from them (``delete_revisions``); this module says which model configs
use each model, whether each revision holds what a start reads (``manager.hub.files.missing``), and
refuses a deletion while a worker of such a config is active, while a download into that repo runs
(its files would be cut from under it) or when it would touch a file outside the cache.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Protocol

from huggingface_hub import CachedRepoInfo, CachedRevisionInfo, HFCacheInfo, scan_cache_dir
from huggingface_hub.errors import CacheNotFound
from pydantic import BaseModel, Field

from manager.errors import Conflict, Invalid, NotFound
from manager.hub import files
from manager.hub.model_location import engine_cache, is_local_path
from manager.planner.model_files import hub_cache_dir
from manager.schemas.common import MARKER

# An id on the Hub: owner and name, each of letters, digits, '.', '_' and '-'. Nothing is deleted by a path
# made from it: it is compared with the ids huggingface_hub reads off the cache's folders.
REPO_PART = r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}"
REPO_ID = re.compile(rf"^{REPO_PART}/{REPO_PART}$")


class StoredConfig(Protocol):
    """What this module reads of a model config (``manager.schemas.model_config.ModelConfig``)."""

    name: str
    model: str
    env: dict[str, str]


class WorkerOfConfig(Protocol):
    """What this module reads of a worker (``manager.supervisor.view.WorkerView``)."""

    @property
    def id(self) -> int: ...
    @property
    def model(self) -> str: ...
    @property
    def state(self) -> str: ...
    @property
    def active(self) -> bool: ...


class DownloadUnderWay(Protocol):
    """What this module reads of a queued or running download (``manager.schemas.download.Download``)."""

    @property
    def id(self) -> int | None: ...
    @property
    def repo(self) -> str: ...
    @property
    def cache_dir(self) -> str: ...
    @property
    def state(self) -> str: ...
    @property
    def done_bytes(self) -> int: ...
    @property
    def total_bytes(self) -> int: ...


class CachedRevision(BaseModel):
    commit: str
    refs: list[str] = Field(description="Branches and tags that point at it, e.g. main")
    size_bytes: int
    files: int
    complete: bool = Field(description="Holds every file a vLLM start reads (config, weights, tokenizer)")
    missing: list[str] = Field(description="What a start would still need, when not complete")
    last_modified: datetime


class CachedModel(BaseModel):
    repo: str = Field(description="The Hugging Face id, e.g. Qwen/Qwen3-0.6B")
    size_bytes: int = Field(description="On disk, files shared by revisions counted once")
    files: int
    revisions: list[CachedRevision] = Field(description="Newest first")
    last_modified: datetime
    last_accessed: datetime
    used_by: list[str] = Field(description="Model configs whose engines load it from this cache")


class HubCache(BaseModel):
    path: str
    own: bool = Field(description="The manager's own cache (model configs without HF_HUB_CACHE/HF_HOME use it)")
    found: bool = Field(description="Whether the folder exists on this machine")
    size_bytes: int
    configs: list[str] = Field(description="Model configs whose engines read this cache")
    models: list[CachedModel]
    problems: list[str] = Field(description="Folders of the cache huggingface_hub could not read")


class Deleted(BaseModel):
    repo: str
    cache: str
    revisions: list[str] = Field(description="The commits deleted")
    freed_bytes: int


def _when(timestamp: float) -> datetime:
    return datetime.fromtimestamp(timestamp, UTC)


def _same(a: Path, b: Path) -> bool:
    return a.expanduser().resolve() == b.expanduser().resolve()


def _inside(path: Path, folder: Path) -> bool:
    """Whether ``path`` itself (not where a link in it points) lies under ``folder``."""
    here, root = os.path.abspath(path), os.path.abspath(folder)
    return os.path.commonpath([here, root]) == root


def caches_of(configs: Iterable[StoredConfig]) -> list[tuple[Path, list[str]]]:
    """Each cache that matters, the manager's own first, with the model configs that read it."""
    found: list[tuple[Path, list[str]]] = [(hub_cache_dir(), [])]
    for config in configs:
        cache = engine_cache(config.env)
        entry = next((e for e in found if _same(e[0], cache)), None)
        if entry is None:
            entry = (cache, [])
            found.append(entry)
        entry[1].append(config.name)
    return found


def _used_by(repo: CachedRepoInfo, configs: Sequence[StoredConfig], readers: list[str]) -> list[str]:
    """The model configs that load the repo: by its id from this cache (``readers``: the configs whose
    engines read it), or by a folder inside it whatever their env says."""
    names = []
    for config in configs:
        by_id = config.name in readers and config.model == repo.repo_id
        by_folder = is_local_path(config.model) and _inside(Path(os.path.realpath(config.model)), repo.repo_path)
        if by_id or by_folder:
            names.append(config.name)
    return names


def _revision(revision: CachedRevisionInfo) -> CachedRevision:
    gaps = files.missing(revision.snapshot_path)
    return CachedRevision(
        commit=revision.commit_hash,
        refs=sorted(revision.refs),
        size_bytes=revision.size_on_disk,
        files=len(revision.files),
        complete=not gaps,
        missing=gaps,
        last_modified=_when(revision.last_modified),
    )


def _model(repo: CachedRepoInfo, used_by: list[str]) -> CachedModel:
    revisions = sorted(repo.revisions, key=lambda r: r.last_modified, reverse=True)
    return CachedModel(
        repo=repo.repo_id,
        size_bytes=repo.size_on_disk,
        files=repo.nb_files,
        revisions=[_revision(r) for r in revisions],
        last_modified=_when(repo.last_modified),
        last_accessed=_when(repo.last_accessed),
        used_by=used_by,
    )


def _scan(path: Path) -> tuple[HFCacheInfo | None, list[str]]:
    """huggingface_hub's scan of one cache; None with the reason when there is nothing to scan."""
    try:
        info = scan_cache_dir(path)
    except CacheNotFound:
        return None, []
    except (OSError, ValueError) as exc:  # a file where the folder should be, or a folder it may not read
        return None, [f"{path}: {exc}"]
    return info, [str(w) for w in info.warnings]


def _models(info: HFCacheInfo) -> list[CachedRepoInfo]:
    return sorted((r for r in info.repos if r.repo_type == "model"), key=lambda r: r.repo_id.lower())


def list_caches(configs: Sequence[StoredConfig]) -> list[HubCache]:
    """What each cache that matters holds: its models (datasets and spaces left out), each with its
    revisions and the model configs that use it."""
    listed = []
    for index, (path, readers) in enumerate(caches_of(configs)):
        info, problems = _scan(path)
        repos = _models(info) if info is not None else []
        listed.append(
            HubCache(
                path=str(path),
                own=index == 0,
                found=info is not None,
                size_bytes=sum(r.size_on_disk for r in repos),
                configs=readers,
                models=[_model(r, _used_by(r, configs, readers)) for r in repos],
                problems=problems,
            )
        )
    return listed


def as_seen_without_token(caches: Sequence[HubCache]) -> list[HubCache]:
    """The list for a reader without the token: the paths that come from model configs' env stay hidden,
    as those env values do."""
    return [c if c.own else c.model_copy(update={"path": MARKER}) for c in caches]


def check_repo_id(repo: str) -> None:
    if not REPO_ID.fullmatch(repo):
        raise Invalid(f"{repo!r} is not a Hugging Face model id: give it as owner/name, e.g. Qwen/Qwen3-0.6B")


def _pick_cache(
    repo: str, cache: str | None, known: list[tuple[Path, list[str]]]
) -> tuple[Path, list[str], HFCacheInfo, CachedRepoInfo]:
    if cache is not None:
        chosen = [e for e in known if _same(e[0], Path(cache))]
        if not chosen:
            shown = ", ".join(str(p) for p, _ in known)
            raise NotFound(f"{cache} is not a hub cache the manager or a model config uses (those are: {shown})")
        known = chosen
    holding = []
    for path, readers in known:
        info, _ = _scan(path)
        repo_info = next((r for r in _models(info) if r.repo_id == repo), None) if info is not None else None
        if info is not None and repo_info is not None:
            holding.append((path, readers, info, repo_info))
    if not holding:
        where = cache if cache is not None else ", ".join(str(p) for p, _ in known)
        raise NotFound(f"{repo} is not in the hub cache ({where})")
    if len(holding) > 1:
        shown = ", ".join(str(h[0]) for h in holding)
        raise Invalid(f"{repo} is in {len(holding)} caches ({shown}): say which one with cache", field="cache")
    return holding[0]


def refuse_while_downloading(repo: str, path: Path, downloads: Iterable[DownloadUnderWay]) -> None:
    """A revision deleted alone shares blobs with the others, so any download of the repo into this cache
    counts, whatever revision it fetches."""
    under_way = [d for d in downloads if d.repo == repo and _same(Path(d.cache_dir), path)]
    if under_way:
        d = min(under_way, key=lambda d: d.id or 0)
        percent = 100 * d.done_bytes // d.total_bytes if d.total_bytes else 0
        raise Conflict(
            f"{repo} is being downloaded into {path} (download {d.id}, {d.state}, {percent} %): cancel the download "
            "or let it finish before deleting the model; deleting files under a running download corrupts it"
        )


def _revisions_to_delete(repo: CachedRepoInfo, revision: str | None, cache: Path) -> list[CachedRevisionInfo]:
    if revision is None:
        return list(repo.revisions)
    found = [r for r in repo.revisions if revision == r.commit_hash or revision in r.refs]
    if not found:
        have = ", ".join(
            f"{r.commit_hash} ({', '.join(sorted(r.refs))})" if r.refs else r.commit_hash for r in repo.revisions
        )
        raise NotFound(f"{repo.repo_id} in {cache} has no revision {revision}; it has {have}")
    return found


def delete(
    repo: str,
    configs: Sequence[StoredConfig],
    workers: Iterable[WorkerOfConfig],
    *,
    revision: str | None = None,
    cache: str | None = None,
    downloads: Iterable[DownloadUnderWay] = (),
) -> Deleted:
    """Delete ``repo`` from a cache: all its revisions, or one (a commit, or a ref such as main). ``cache``
    names the cache when the repo is in several. Refused while a worker of a config using it is active,
    and while one of ``downloads`` (those queued or running) writes into it there."""
    check_repo_id(repo)
    path, readers, info, repo_info = _pick_cache(repo, cache, caches_of(configs))
    refuse_while_downloading(repo, path, downloads)
    users = set(_used_by(repo_info, configs, readers))
    busy = sorted((w for w in workers if w.active and w.model in users), key=lambda w: w.id)
    if busy:
        shown = ", ".join(f"worker {w.id} ({w.model}, {w.state})" for w in busy)
        raise Conflict(f"{repo} is in use by {shown}: stop the worker before deleting the model from {path}")
    chosen = _revisions_to_delete(repo_info, revision, path)
    # huggingface_hub finds revisions by commit across the whole cache, and a duplicated repo shares its
    # commits with the original: the strategy is made from a scan holding this repo alone.
    alone = dataclasses.replace(info, repos=frozenset({repo_info}))
    strategy = alone.delete_revisions(*(r.commit_hash for r in chosen))
    paths = [*strategy.blobs, *strategy.refs, *strategy.repos, *strategy.snapshots, *strategy.files]
    outside = sorted(str(p) for p in paths if not _inside(p, info.cache_dir or path))
    if outside:
        raise Conflict(
            f"deleting {repo} would remove files outside {path} ({', '.join(outside[:3])}): nothing was deleted; "
            "remove the links by hand"
        )
    strategy.execute()
    return Deleted(
        repo=repo,
        cache=str(path),
        revisions=sorted(r.commit_hash for r in chosen),
        freed_bytes=strategy.expected_freed_size,
    )
