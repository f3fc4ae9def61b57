"""The manager's calls to the Hugging Face Hub, through huggingface_hub, and what its errors mean to a user.

The hub's address and the token are read when a call is made (``HF_ENDPOINT``, ``HF_TOKEN``: the
variables huggingface_hub and vLLM read), so a test hub or a mirror works without a restart of the
import. ``HF_HUB_OFFLINE`` in the manager's environment means no call is made at all, and the
refusal says so.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from manager.errors import Conflict, Forbidden, Invalid, ManagerError, NotFound
from manager.hub.files import RepoFile
from manager.hub.model_location import downloads_forbidden

DEFAULT_ENDPOINT = "https://huggingface.co"


class HubUnreachable(ManagerError):
    """The hub did not answer (no network, a proxy, a server error): nothing was changed."""

    status = 502


@dataclass(frozen=True)
class Listing:
    """A repo at one commit: what a download of it could fetch."""

    repo: str
    revision: str
    commit: str
    files: tuple[RepoFile, ...]
    gated: bool


def endpoint(env: Mapping[str, str] | None = None) -> str:
    env = os.environ if env is None else env
    return (env.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def token(env: Mapping[str, str] | None = None) -> str | None:
    """The token a download for an engine with ``env`` uses: its own HF_TOKEN, else the manager's."""
    return (env or {}).get("HF_TOKEN") or os.environ.get("HF_TOKEN") or None


def offline() -> bool:
    """HF_HUB_OFFLINE in the manager's own environment."""
    return downloads_forbidden({})


def check_repo_id(repo: str, *, field: str = "repo") -> None:
    """Invalid (422) for a name that is not a hub model id (``org/name``)."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if repo.count("/") != 1:
        raise Invalid(
            f"{field}: {repo!r} is not a Hugging Face model id (org/name, such as Qwen/Qwen3-0.6B)", field=field
        )
    try:
        validate_repo_id(repo)
    except HFValidationError as exc:
        raise Invalid(f"{field}: {repo!r} is not a Hugging Face model id: {exc}", field=field) from exc


def refuse_if_offline(repo: str, need: str) -> None:
    if offline():
        raise Conflict(
            f"HF_HUB_OFFLINE is set for the manager, so it does not contact the Hugging Face Hub to {need} {repo}: "
            "unset it, or put the model in the cache (or a local folder) another way"
        )


@contextlib.contextmanager
def hub_errors(
    repo: str, revision: str | None = None, hub: str | None = None, *, token_sent: bool = False
) -> Iterator[None]:
    """huggingface_hub's exceptions as the manager's errors, each naming the repo and what to do.
    ``token_sent``: the calls carried an HF_TOKEN, so a refusal is of that token."""
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        HfHubHTTPError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = hub or endpoint()
    try:
        yield
    except GatedRepoError as exc:
        if token_sent:
            status = exc.response.status_code if exc.response is not None else 401
            raise refused_token(repo, where, status) from exc
        raise gated(repo, where) from exc
    except RevisionNotFoundError as exc:
        raise NotFound(f"{repo} has no revision {revision!r} on {where}") from exc
    except EntryNotFoundError as exc:
        raise NotFound(f"{repo} at {revision or 'main'} lacks a file it needs on {where}: {_first_line(exc)}") from exc
    except RepositoryNotFoundError as exc:
        raise NotFound(
            f"no model {repo} on {where} (a private repo answers the same without a token: set HF_TOKEN)"
        ) from exc
    except OfflineModeIsEnabled as exc:
        raise Conflict(f"HF_HUB_OFFLINE is set, so {repo} cannot be read from the hub") from exc
    except HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else None
        if status in (401, 403) and token_sent:
            raise refused_token(repo, where, status) from exc
        if status in (401, 403):
            raise Forbidden(
                f"{where} refused access to {repo} ({status}): set HF_TOKEN to a token that may read it"
            ) from exc
        raise HubUnreachable(f"{where} answered {status} for {repo}: {_first_line(exc)}") from exc
    except (ConnectionError, TimeoutError, socket.gaierror) as exc:
        raise HubUnreachable(
            f"the Hugging Face Hub at {where} cannot be reached for {repo}: {_first_line(exc)}"
        ) from exc
    except Exception as exc:
        if type(exc).__module__.startswith(("httpx", "httpcore")):
            raise HubUnreachable(
                f"the Hugging Face Hub at {where} cannot be reached for {repo}: {_first_line(exc)}"
            ) from exc
        raise


def gated(repo: str, where: str | None = None) -> Forbidden:
    where = where or endpoint()
    return Forbidden(
        f"{repo} is a gated model: accept its licence on {where}/{repo} with your account, then set HF_TOKEN "
        "(the manager's environment, or the config's env) to a token of that account"
    )


def refused_token(repo: str, where: str, status: int) -> Forbidden:
    return Forbidden(
        f"{where} refused the HF_TOKEN given for {repo} ({status}): the token is wrong or expired, or its account "
        f"has not accepted the licence on {where}/{repo}; set HF_TOKEN (the manager's environment, or the config's "
        "env) to a token that may read it"
    )


def refuse_if_gated_without_token(found: Listing, env: Mapping[str, str] | None = None) -> None:
    """Forbidden for a gated repo when no token would be sent: its files would be refused one by one."""
    if found.gated and not token(env):
        raise gated(found.repo)


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]


def _api(env: Mapping[str, str] | None):
    from huggingface_hub import HfApi

    return HfApi(endpoint=endpoint(), token=token(env) or False, library_name="vllm-manager")


def listing(repo: str, revision: str | None = None, env: Mapping[str, str] | None = None) -> Listing:
    """The repo's commit and files with their sizes (one call: the model info with its files)."""
    check_repo_id(repo)
    refuse_if_offline(repo, "list the files of")
    with hub_errors(repo, revision, token_sent=bool(token(env))):
        info = _api(env).model_info(repo, revision=revision, files_metadata=True)
    files = tuple(RepoFile(s.rfilename, int(s.size or 0)) for s in info.siblings or [])
    if not info.sha:
        raise HubUnreachable(f"{endpoint()} gave no commit for {repo}")
    return Listing(repo, revision or "main", info.sha, files, bool(info.gated))


def read_json(listing_: Listing, filename: str, env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """A small JSON file of the repo (config.json, the safetensors index), read without putting anything
    in the cache: a half-known snapshot there would look like a model on disk."""
    from huggingface_hub import hf_hub_download

    sent = bool(token(env))
    with (
        tempfile.TemporaryDirectory(prefix="vllm-manager-hub-") as tmp,
        hub_errors(listing_.repo, listing_.commit, token_sent=sent),
    ):
        path = hf_hub_download(
            listing_.repo,
            filename,
            revision=listing_.commit,
            cache_dir=tmp,
            endpoint=endpoint(),
            token=token(env) or False,
        )
        with open(path) as f:
            try:
                data = json.load(f)
            except json.JSONDecodeError as exc:
                raise Invalid(f"{filename} of {listing_.repo} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise Invalid(f"{filename} of {listing_.repo} is not a JSON object")
    return data


def safetensors_headers(
    listing_: Listing, filenames: list[str], env: Mapping[str, str] | None = None
) -> dict[str, dict[str, Any]]:
    """Each file's safetensors header (tensor name → dtype, shape, data_offsets), read with HTTP range
    requests: a few kilobytes per file, however large the weights."""
    api = _api(env)
    headers: dict[str, dict[str, Any]] = {}
    with hub_errors(listing_.repo, listing_.commit, token_sent=bool(token(env))):
        for name in filenames:
            meta = api.parse_safetensors_file_metadata(listing_.repo, name, revision=listing_.commit)
            headers[name] = {
                tensor: {"dtype": info.dtype, "shape": info.shape, "data_offsets": list(info.data_offsets)}
                for tensor, info in meta.tensors.items()
            }
    return headers
