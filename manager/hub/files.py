"""Which files of a Hub repo a vLLM 0.32 start reads, and which of them a local snapshot lacks.

The weights follow vLLM's ``DefaultModelLoader._prepare_weights`` with ``load_format="auto"``:

- a repo with a ``consolidated*.safetensors`` file anywhere is in Mistral's format: the top-level
  ``consolidated*.safetensors``, filtered by ``consolidated.safetensors.index.json``;
- otherwise the first of ``*.safetensors``, ``*.bin``, ``*.pt`` that matches a top-level file wins;
  safetensors are filtered by ``model.safetensors.index.json`` (``filter_duplicate_safetensors_files``:
  a repo with both shards and one consolidated file would load both), .bin and .pt lose the training
  leftovers (``filter_files_not_needed_for_inference``).

vLLM globs the snapshot's top folder only, so ``original/`` and other subfolders are never loaded
(``LoadConfig.ignore_patterns`` keeps ``original/`` out of the download as well). Besides the weights a
start reads the config, the tokenizer, the chat template and the processor configs, all top-level.
"""

from __future__ import annotations

import fnmatch
import glob
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

HF_INDEX = "model.safetensors.index.json"
MISTRAL_INDEX = "consolidated.safetensors.index.json"
MISTRAL_WEIGHTS = "consolidated*.safetensors"
HF_WEIGHTS = ("*.safetensors", "*.bin", "*.pt")
# vLLM drops these when it loads .bin or .pt files (transformers' trainer writes them beside a checkpoint).
TRAINING_LEFTOVERS = ("training_args.bin", "optimizer.bin", "optimizer.pt", "scheduler.pt", "scaler.pt")

# Top-level files a start reads besides the weights: the config (params.json in Mistral's format), the
# tokenizer in its many spellings, the chat template, the processor configs of multimodal models and the
# pooling setup of sentence-transformers models. *.py: the code a config with trust_remote_code imports,
# small enough to take always, so that turning trust_remote_code on later needs no second download.
START_FILES = (
    "config.json",
    "generation_config.json",
    "params.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "tokenizer.model.v*",
    "tekken.json",
    "spiece.model",
    "sentencepiece.bpe.model",
    "vocab.*",
    "merges.txt",
    "*.tiktoken",
    "chat_template.jinja",
    "chat_template.json",
    "preprocessor_config.json",
    "processor_config.json",
    "video_preprocessor_config.json",
    "modules.json",
    "sentence_bert_config.json",
    "*.py",
)

Format = Literal["mistral", "hf"]


@dataclass(frozen=True)
class RepoFile:
    """One file of a repo: its path in the repo (``original/params.json``) and its size in bytes.
    huggingface_hub's own ``RepoFile`` (from ``HfApi.list_repo_tree``) has the same two fields."""

    path: str
    size: int


@dataclass(frozen=True)
class Chosen:
    """The files of a repo a start reads."""

    format: Format
    weights: tuple[RepoFile, ...]
    others: tuple[RepoFile, ...]  # config, tokenizer, templates, the index
    index_name: str | None  # the safetensors index that picks the weights, when the repo has it
    absent: tuple[str, ...] = ()  # weight files the index names that the listing lacks

    @property
    def files(self) -> tuple[RepoFile, ...]:
        return self.weights + self.others

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def allow_patterns(self) -> list[str]:
        """For ``snapshot_download(allow_patterns=...)``: each chosen file by its exact name."""
        return [glob.escape(f.path) for f in self.files]


def _top_level(path: str) -> bool:
    return "/" not in path


def _matches(path: str, patterns: Sequence[str]) -> bool:
    return any(fnmatch.fnmatchcase(path, p) for p in patterns)


def repo_format(listing: Sequence[RepoFile]) -> Format:
    """Mistral's format when any file of the repo, in any folder, is named ``consolidated*.safetensors``
    (vLLM's ``list_filtered_repo_files`` matches the file names of the whole repo)."""
    return "mistral" if any(_matches(f.path.rsplit("/", 1)[-1], [MISTRAL_WEIGHTS]) for f in listing) else "hf"


def _candidates(listing: Sequence[RepoFile], fmt: Format) -> list[RepoFile]:
    """The top-level weight files of the first pattern that has any, before the index filters them."""
    top = [f for f in listing if _top_level(f.path)]
    for pattern in [MISTRAL_WEIGHTS] if fmt == "mistral" else HF_WEIGHTS:
        found = [f for f in top if fnmatch.fnmatchcase(f.path, pattern)]
        if found:
            return found
    return []


def index_name_for(listing: Sequence[RepoFile]) -> str | None:
    """The safetensors index vLLM reads to pick this repo's weights, when the listing has it; pass its
    contents to ``choose``."""
    fmt = repo_format(listing)
    weights = _candidates(listing, fmt)
    if weights and not weights[0].path.endswith(".safetensors"):
        return None  # .bin or .pt: no index filters them
    # With no weight file at all (a snapshot holding the config alone) the index names those to come.
    name = MISTRAL_INDEX if fmt == "mistral" else HF_INDEX
    return name if any(f.path == name for f in listing) else None


def indexed_files(index: Mapping[str, Any]) -> set[str]:
    """The weight files a safetensors index maps tensors to."""
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, Mapping):
        return set()
    return {str(v) for v in weight_map.values()}


def choose(listing: Sequence[RepoFile], index: Mapping[str, Any] | None) -> Chosen:
    """The files a start reads, from the repo's listing and the parsed index ``index_name_for`` names
    (None when it names none)."""
    fmt = repo_format(listing)
    weights = _candidates(listing, fmt)
    index_name = index_name_for(listing)
    absent: tuple[str, ...] = ()
    if index_name is not None:
        if index is None:
            raise ValueError(f"the repo has {index_name}: pass its contents, which pick the weight files")
        named = indexed_files(index)
        weights = [f for f in weights if f.path in named]
        absent = tuple(sorted(named - {f.path for f in weights}))
    elif weights and not weights[0].path.endswith(".safetensors"):
        weights = [f for f in weights if not f.path.endswith(TRAINING_LEFTOVERS)]
    others = [f for f in listing if _top_level(f.path) and (_matches(f.path, START_FILES) or f.path == index_name)]
    return Chosen(
        format=fmt,
        weights=tuple(sorted(weights, key=lambda f: f.path)),
        others=tuple(sorted(others, key=lambda f: f.path)),
        index_name=index_name,
        absent=absent,
    )


def listing_of(folder: Path) -> list[RepoFile]:
    """The files under a local folder as a repo listing. A snapshot's files are links into the cache's
    blobs; a link whose blob is gone is not there."""
    found = []
    for path in folder.rglob("*"):
        try:
            if path.is_file():
                found.append(RepoFile(path.relative_to(folder).as_posix(), path.stat().st_size))
        except OSError:
            continue  # unreadable: as good as absent
    return found


def missing(folder: Path) -> list[str]:
    """What a start from this local folder (a snapshot of the hub cache) would need that is not there:
    ``config.json``, a weight file (named by its pattern when there is none at all), shards the index
    names. Empty: the folder is complete."""
    listing = listing_of(folder)
    gaps: list[str] = []
    index_name = index_name_for(listing)
    index: Mapping[str, Any] | None = None
    if index_name is not None:
        try:
            index = json.loads((folder / index_name).read_text())
        except (OSError, ValueError):
            return [f"{index_name} (not readable JSON)"]
        if not isinstance(index, Mapping):
            return [f"{index_name} (no weight_map)"]
    chosen = choose(listing, index)
    names = {f.path for f in listing}
    # vLLM reads params.json instead of config.json for a repo in Mistral's format that has it.
    if "config.json" not in names and not (chosen.format == "mistral" and "params.json" in names):
        gaps.append("config.json")
    if not chosen.weights and not chosen.absent:
        gaps.append(MISTRAL_WEIGHTS if chosen.format == "mistral" else HF_WEIGHTS[0])
    gaps.extend(chosen.absent)
    return gaps
