"""What a download of a repo would fetch, worked out before a byte is: the files vLLM loads, their bytes,
what the cache already has of them, and the room on the cache's disk."""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from manager.errors import InsufficientStorage
from manager.hub import client, files
from manager.hub.client import Listing
from manager.hub.files import RepoFile

GiB = 1024**3


@dataclass(frozen=True)
class DownloadPlan:
    """What a download of a repo would fetch, before it starts."""

    listing: Listing
    files: tuple[RepoFile, ...]
    cache_dir: Path
    present_bytes: int  # of those files, already complete in the cache
    free_bytes: int

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def needed_bytes(self) -> int:
        return self.total_bytes - self.present_bytes

    @property
    def fits(self) -> bool:
        return self.needed_bytes <= self.free_bytes


def plan_download(repo: str, revision: str | None, env: Mapping[str, str], cache_dir: Path) -> DownloadPlan:
    """Which files of ``repo`` vLLM loads, their bytes, what the cache has of them and the disk's room."""
    found = client.listing(repo, revision, env)
    client.refuse_if_gated_without_token(found, env)
    index_name = files.index_name_for(found.files)
    index = client.read_json(found, index_name, env) if index_name else None
    chosen = files.choose(found.files, index)
    snapshot = cache_dir / ("models--" + repo.replace("/", "--")) / "snapshots" / found.commit
    present = sum(f.size for f in chosen.files if (snapshot / f.path).is_file())
    return DownloadPlan(found, tuple(chosen.files), cache_dir, present, free_space(cache_dir))


def free_space(folder: Path) -> int:
    """Free bytes on the disk that holds ``folder`` (its nearest existing parent, before it is made)."""
    probe = folder
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return shutil.disk_usage(probe).free


def refuse_if_no_room(plan: DownloadPlan) -> None:
    if not plan.fits:
        raise InsufficientStorage(
            f"{plan.listing.repo} needs {plan.needed_bytes / GiB:.2f} GiB more in {plan.cache_dir}, but its disk has "
            f"{plan.free_bytes / GiB:.2f} GiB free: free some space (delete a model on the Models on disk page) or "
            "point HF_HOME at a larger disk",
            needed_bytes=plan.needed_bytes,
            free_bytes=plan.free_bytes,
        )
