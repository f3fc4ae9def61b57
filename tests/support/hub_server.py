"""A Hugging Face Hub on loopback that the real huggingface_hub client downloads from (``endpoint=hub.url``).

It answers the calls huggingface_hub 2.4 makes for model repos: model info (``files_metadata`` too), tree
listings, paths-info, safetensors headers in one call, and ``/resolve`` (HEAD and GET, ranges). As on the
real hub, LFS files (weights) answer ``/resolve`` with a 302 to another origin, the "CDN" (a second port
of this server), carrying ``X-Linked-Etag``/``X-Linked-Size``; huggingface_hub stops its HEAD there and
downloads from the CDN without the token. Gated repos want ``Authorization: Bearer <one of tokens>`` for
their files; their model info and tree stay public, as on the hub.

A test can slow file bodies down, drop a connection once, or stall one until ``release()``, and read
which requests came (``requests``) and how many bytes of each file went out (``bytes_served``).
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import re
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, NamedTuple
from urllib.parse import parse_qs, quote, unquote, urlsplit

from tests.support.hub_content import (
    READ_CHUNK,
    Commit,
    HubFile,
    Repo,
    commit_sha,
    file_entry,
    model_info,
    safetensors_index,
)

GOOD_TOKEN = "hf_test_token_with_access"
_API_ROUTES = {"revision", "tree", "paths-info", "safetensors-metadata"}
_SHA = re.compile(r"[0-9a-f]{40}")
_RANGE = re.compile(r"bytes=(\d*)-(\d*)")


class Request(NamedTuple):
    method: str
    path: str  # percent-decoded, without the query
    range: str | None  # the Range header


@dataclass(frozen=True)
class Faults:
    """What goes wrong with file bodies. Drops and stalls happen once per file until set again."""

    rate_bytes_per_s: float | None = None
    drop_after_bytes: int | None = None  # close the connection after this many body bytes
    stall_after_bytes: int | None = None  # stop sending after this many until release() or close()
    files: tuple[str, ...] = ()  # fnmatch patterns of the repo paths hit; none: every file

    def hits(self, path: str) -> bool:
        return not self.files or any(fnmatch.fnmatch(path, p) for p in self.files)


class TestHub:
    """A started hub: ``url`` is its endpoint. Use it as a context manager or call ``close()``."""

    __test__ = False  # not a test class, whatever pytest thinks of its name

    def __init__(self, *, tokens: Iterable[str] = (GOOD_TOKEN,)) -> None:
        self.tokens = set(tokens)
        self._lock = threading.Lock()
        self._repos: dict[str, Repo] = {}
        self._faults: dict[str | None, Faults] = {}
        self._fired: set[tuple[str, str, str]] = set()
        self._log: list[Request] = []
        self._served: Counter[tuple[str, str]] = Counter()
        self._sockets: set[socket.socket] = set()
        self._closing = threading.Event()
        self._released = threading.Event()
        self._stalled = threading.Event()
        self._servers = [_Server(self, cdn=False), _Server(self, cdn=True)]
        self.url, self.cdn_url = (f"http://127.0.0.1:{s.server_address[1]}" for s in self._servers)
        self._threads = [
            threading.Thread(target=s.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True, name="test-hub")
            for s in self._servers
        ]
        for t in self._threads:
            t.start()

    # --- content ---------------------------------------------------------------------------------------
    def add_repo(
        self,
        repo_id: str,
        files: Mapping[str, bytes | Path],
        *,
        gated: bool = False,
        revision_sha: str | None = None,
    ) -> str:
        """Commit ``files`` (repo path -> content, or a local file read when served) as the new ``main`` of
        ``repo_id``; returns the commit sha, made from the content unless ``revision_sha`` is given.

        Adding to a repo that exists makes a new commit; the older ones stay reachable by their sha."""
        if repo_id.count("/") > 1 or not repo_id.strip("/"):
            raise ValueError(f"not a repo id: {repo_id!r}")
        for path in files:
            if path.startswith("/") or ".." in path.split("/") or not path:
                raise ValueError(f"not a path in a repo: {path!r}")
        hub_files = {path: HubFile.of(path, src) for path, src in files.items()}
        with self._lock:
            repo = self._repos.get(repo_id) or Repo(repo_id, gated)
            repo.gated = gated
            sha = revision_sha or commit_sha(repo_id, hub_files, repo.refs.get("main"))
            if not _SHA.fullmatch(sha):
                raise ValueError(f"a commit sha is 40 lowercase hex digits, not {sha!r}")
            repo.commits[sha] = Commit(sha, hub_files, datetime.now(UTC))
            repo.refs["main"] = sha
            self._repos[repo_id] = repo
        return sha

    def tag(self, repo_id: str, name: str, sha: str) -> None:
        """Point ref ``name`` (a tag or a branch) of ``repo_id`` at commit ``sha``."""
        with self._lock:
            repo = self._repos[repo_id]
            if sha not in repo.commits:
                raise ValueError(f"{repo_id} has no commit {sha}")
            repo.refs[name] = sha

    def add_repo_from_folder(
        self, repo_id: str, folder: Path, *, gated: bool = False, revision_sha: str | None = None
    ) -> str:
        """Every file under ``folder``, recursively, as a commit of ``repo_id``."""
        folder = Path(folder)
        files = {p.relative_to(folder).as_posix(): p for p in sorted(folder.rglob("*")) if p.is_file()}
        return self.add_repo(repo_id, files, gated=gated, revision_sha=revision_sha)

    # --- faults ----------------------------------------------------------------------------------------
    def set_faults(
        self,
        repo_id: str | None = None,
        *,
        rate_bytes_per_s: float | None = None,
        drop_after_bytes: int | None = None,
        stall_after_bytes: int | None = None,
        files: Iterable[str] = (),
    ) -> None:
        """Faults for the file bodies of ``repo_id`` (None: of every repo without faults of its own).
        Setting them re-arms drops and stalls; all None clears them."""
        faults = Faults(rate_bytes_per_s, drop_after_bytes, stall_after_bytes, tuple(files))
        with self._lock:
            self._faults[repo_id] = faults
            self._fired = {f for f in self._fired if repo_id is not None and f[0] != repo_id}
            self._released.clear()
            self._stalled.clear()

    def wait_stalled(self, timeout: float = 5.0) -> bool:
        """Whether a body stalled (stall_after_bytes) within ``timeout`` seconds."""
        return self._stalled.wait(timeout)

    def release(self) -> None:
        """Let stalled bodies go on."""
        self._released.set()

    # --- what happened ---------------------------------------------------------------------------------
    @property
    def requests(self) -> list[Request]:
        with self._lock:
            return list(self._log)

    def clear_requests(self) -> None:
        with self._lock:
            self._log.clear()

    def bytes_served(self, repo_id: str, path: str) -> int:
        """Body bytes of file ``path`` of ``repo_id`` sent so far, over every request."""
        with self._lock:
            return self._served[(repo_id, path)]

    # --- life ------------------------------------------------------------------------------------------
    def close(self) -> None:
        self._closing.set()
        for s in self._servers:
            s.shutdown()
            s.server_close()
        with self._lock:
            open_sockets = list(self._sockets)
        for sock in open_sockets:  # kept-alive connections would go on being served otherwise
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        for t in self._threads:
            t.join(timeout=5)

    def __enter__(self) -> TestHub:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- for the handler -------------------------------------------------------------------------------
    def _record(self, request: Request) -> None:
        with self._lock:
            self._log.append(request)

    def _repo(self, repo_id: str) -> Repo | None:
        with self._lock:
            return self._repos.get(repo_id)

    def _faults_for(self, repo_id: str, path: str) -> Faults:
        with self._lock:
            faults = self._faults.get(repo_id) or self._faults.get(None) or Faults()
        return faults if faults.hits(path) else Faults()

    def _fire(self, repo_id: str, path: str, kind: str) -> bool:
        """True the first time fault ``kind`` happens to this file since it was set."""
        with self._lock:
            if (repo_id, path, kind) in self._fired:
                return False
            self._fired.add((repo_id, path, kind))
            return True

    def _count(self, repo_id: str, path: str, n: int) -> None:
        with self._lock:
            self._served[(repo_id, path)] += n

    def _hold(self) -> bool:
        """Wait for release(); False when the hub closes first."""
        self._stalled.set()
        while not self._released.wait(0.05):
            if self._closing.is_set():
                return False
        return True

    def _track(self, sock: socket.socket, open_: bool) -> None:
        with self._lock:
            if open_:
                self._sockets.add(sock)
            else:
                self._sockets.discard(sock)

    def _cdn_location(self, repo_id: str, f: HubFile) -> str:
        return f"{self.cdn_url}/cdn/{f.sha256}/{quote(f.path)}?repo={quote(repo_id, safe='')}"


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, hub: TestHub, *, cdn: bool) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.hub = hub
        self.cdn = cdn

    def process_request(self, request: Any, client_address: Any) -> None:
        self.hub._track(request, True)
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        self.hub._track(request, False)
        super().shutdown_request(request)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as huggingface_hub's client expects of the hub
    disable_nagle_algorithm = True  # headers and body go out at once, as a real hub's do (no 40 ms wait)
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        self._handle("GET")

    def do_HEAD(self) -> None:
        self._handle("HEAD")

    def do_POST(self) -> None:
        self._handle("POST")

    @property
    def hub(self) -> TestHub:
        return self.server.hub

    def _handle(self, method: str) -> None:
        url = urlsplit(self.path)
        self.hub._record(Request(method, unquote(url.path), self.headers.get("Range")))
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        try:
            if self.server.cdn:
                self._cdn(method, url.path, parse_qs(url.query))
            else:
                self._route(method, url.path, parse_qs(url.query), body)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True

    # --- routes ----------------------------------------------------------------------------------------
    def _route(self, method: str, path: str, query: dict[str, list[str]], body: bytes) -> None:
        segs = path.split("/")[1:]
        if segs[:2] == ["api", "models"] and len(segs) > 2:
            rest = segs[2:]
            split = 1 if len(rest) >= 2 and rest[1] in _API_ROUTES else 2
            self._api(method, unquote("/".join(rest[:split])), rest[split:], query, body)
        elif len(segs) > 3 and "resolve" in segs[1:3]:
            at = 2 if segs[2] == "resolve" else 1
            rev, file = unquote(segs[at + 1]), unquote("/".join(segs[at + 2 :]))
            self._resolve(method, unquote("/".join(segs[:at])), rev, file)
        else:
            self._error(method, 404, None, f"no such route on this hub: {path}")

    def _api(self, method: str, repo_id: str, tail: list[str], query: dict[str, list[str]], body: bytes) -> None:
        repo = self.hub._repo(repo_id)
        if repo is None:
            return self._repo_not_found(method)
        route = tail[0] if tail else "revision"
        rev = unquote(tail[1]) if len(tail) > 1 else "main"
        if route == "safetensors-metadata" and method == "GET":
            return self._safetensors_metadata(method, repo, unquote("/".join(tail[1:])))
        commit = repo.at(rev)
        if commit is None:
            return self._error(method, 404, "RevisionNotFound", f"Invalid rev id: {rev}")
        if route == "revision" and len(tail) <= 2 and method in ("GET", "HEAD"):
            blobs = _flag(query.get("blobs"))
            return self._json(method, 200, model_info(repo, commit, blobs=blobs))
        if route == "tree" and len(tail) >= 2 and method in ("GET", "HEAD"):
            entries = commit.tree(unquote("/".join(tail[2:])).strip("/"), _flag(query.get("recursive")))
            if entries is None:
                return self._error(method, 404, "EntryNotFound", f"{'/'.join(tail[2:])} does not exist on {rev}")
            return self._json(method, 200, entries)
        if route == "paths-info" and len(tail) == 2 and method == "POST":
            return self._json(method, 200, _paths_info(commit, _paths_asked(self.headers, body)))
        self._error(method, 404, None, f"no such route on this hub: {method} {'/'.join(tail)}")

    def _safetensors_metadata(self, method: str, repo: Repo, filename: str) -> None:
        if self._refused(method, repo):
            return
        commit = repo.at("main")
        found = safetensors_index(commit, filename) if commit is not None else None
        if found is None:
            return self._error(method, 404, "EntryNotFound", f"{filename} is not a safetensors index")
        self._json(method, 200, found)

    def _resolve(self, method: str, repo_id: str, rev: str, path: str) -> None:
        if method not in ("GET", "HEAD"):
            return self._error(method, 405, None, "resolve takes GET or HEAD")
        repo = self.hub._repo(repo_id)
        if repo is None:
            return self._repo_not_found(method)
        if self._refused(method, repo):
            return
        commit = repo.at(rev)
        if commit is None:
            return self._error(method, 404, "RevisionNotFound", f"Invalid rev id: {rev}")
        f = commit.files.get(path)
        if f is None:
            return self._error(method, 404, "EntryNotFound", "Entry not found", {"X-Repo-Commit": commit.sha})
        headers = {"X-Repo-Commit": commit.sha, "ETag": f'"{f.blob_id}"', "Accept-Ranges": "bytes"}
        if f.lfs:
            headers |= {
                "X-Linked-Etag": f'"{f.sha256}"',
                "X-Linked-Size": str(f.size),
                "Location": self.hub._cdn_location(repo_id, f),
            }
            return self._reply(method, 302, headers)
        self._file(method, repo_id, f, headers)

    def _cdn(self, method: str, path: str, query: dict[str, list[str]]) -> None:
        segs = path.split("/")[1:]
        repo = self.hub._repo((query.get("repo") or [""])[0])
        if method not in ("GET", "HEAD") or len(segs) < 3 or segs[0] != "cdn" or repo is None:
            return self._reply(method, 404, {"Content-Type": "text/plain"}, b"NoSuchKey")
        sha256, file = segs[1], unquote("/".join(segs[2:]))
        f = next((c.files[file] for c in repo.commits.values() if file in c.files), None)
        if f is None or f.sha256 != sha256:
            return self._reply(method, 404, {"Content-Type": "text/plain"}, b"NoSuchKey")
        disposition = f"inline; filename*=UTF-8''{quote(Path(file).name)}; filename=\"{Path(file).name}\";"
        headers = {"ETag": f'"{sha256}"', "Accept-Ranges": "bytes", "Content-Disposition": disposition}
        self._file(method, repo.repo_id, f, headers)

    # --- answers ---------------------------------------------------------------------------------------
    def _refused(self, method: str, repo: Repo) -> bool:
        """Answers 401/403 GatedRepo, as the hub does, when the files of a gated repo are asked without access."""
        if not repo.gated:
            return False
        auth = self.headers.get("Authorization") or ""
        token = auth[len("Bearer ") :].strip() if auth.startswith("Bearer ") else ""
        if token in self.hub.tokens:
            return False
        if not token:
            message = (
                f"Access to model {repo.repo_id} is restricted. You must have access to it and be authenticated "
                "to access it. Please log in."
            )
            self._error(method, 401, "GatedRepo", message)
        else:
            message = (
                f"Access to model {repo.repo_id} is restricted and you are not in the authorized list. "
                f"Visit {self.hub.url}/{repo.repo_id} to ask for access."
            )
            self._error(method, 403, "GatedRepo", message)
        return True

    def _repo_not_found(self, method: str) -> None:
        # The hub answers 401 to an anonymous caller (a private repo is not told apart from a missing one).
        status = 404 if self.headers.get("Authorization") else 401
        self._error(method, status, "RepoNotFound", "Repository not found")

    def _error(
        self, method: str, status: int, code: str | None, message: str, extra: Mapping[str, str] | None = None
    ) -> None:
        headers = {"Content-Type": "application/json", "X-Error-Message": message, **(extra or {})}
        if code:
            headers["X-Error-Code"] = code
        self._reply(method, status, headers, json.dumps({"error": message}).encode())

    def _json(self, method: str, status: int, data: object) -> None:
        self._reply(method, status, {"Content-Type": "application/json"}, json.dumps(data).encode())

    def _reply(self, method: str, status: int, headers: Mapping[str, str], body: bytes = b"") -> None:
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if method != "HEAD":
            self.wfile.write(body)

    def _file(self, method: str, repo_id: str, f: HubFile, headers: dict[str, str]) -> None:
        try:
            asked = _byte_range(self.headers.get("Range"), f.size)
        except _Unsatisfiable:
            return self._reply(method, 416, {"Content-Range": f"bytes */{f.size}"})
        start, end = asked or (0, f.size)
        self.send_response(206 if asked else 200)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Type", "application/json" if f.path.endswith(".json") else "application/octet-stream")
        self.send_header("Content-Length", str(end - start))
        if asked:
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{f.size}")
        self.end_headers()
        if method != "HEAD":
            self._body(repo_id, f, start, end)

    def _body(self, repo_id: str, f: HubFile, start: int, end: int) -> None:
        hub = self.hub
        faults = hub._faults_for(repo_id, f.path)
        rate = faults.rate_bytes_per_s
        length = end - start
        drop_at = faults.drop_after_bytes if (faults.drop_after_bytes or 0) < length else None
        stall_at = faults.stall_after_bytes if (faults.stall_after_bytes or 0) < length else None
        pieces = f.chunks(start, end, max(1, min(READ_CHUNK, int(rate / 50))) if rate else READ_CHUNK)
        began = time.monotonic()
        sent = 0
        buf = b""
        while True:
            if sent == drop_at and hub._fire(repo_id, f.path, "drop"):
                self.close_connection = True
                return
            if sent == stall_at and hub._fire(repo_id, f.path, "stall") and not hub._hold():
                self.close_connection = True
                return
            if not buf:
                buf = next(pieces, b"")
                if not buf:
                    return
            room = min([len(buf)] + [b - sent for b in (drop_at, stall_at) if b is not None and b > sent])
            self.wfile.write(buf[:room])
            buf = buf[room:]
            sent += room
            hub._count(repo_id, f.path, room)
            if rate and hub._closing.wait(max(0.0, began + sent / rate - time.monotonic())):
                self.close_connection = True
                return


def _flag(values: list[str] | None) -> bool:
    return values is not None and values[-1].lower() in ("1", "true")


class _Unsatisfiable(ValueError):
    """A range that starts past the end of the file: a 416."""


def _byte_range(header: str | None, size: int) -> tuple[int, int] | None:
    """[start, end) of a single ``bytes=`` range; None to serve it all, as for a range not understood."""
    m = _RANGE.fullmatch((header or "").replace(" ", ""))
    if m is None or size == 0 or m.group(1) == m.group(2) == "":
        return None
    first, last = m.groups()
    if first == "":
        return max(0, size - int(last)), size
    start = int(first)
    if start >= size:
        raise _Unsatisfiable(header)
    if last and int(last) < start:
        return None
    return start, min(size, int(last) + 1) if last else size


def _paths_asked(headers: Any, body: bytes) -> list[str]:
    if "json" in (headers.get("Content-Type") or ""):
        paths = json.loads(body or b"{}").get("paths", [])
        return [paths] if isinstance(paths, str) else list(paths)
    return parse_qs(body.decode()).get("paths", [])


def _paths_info(commit: Commit, paths: list[str]) -> list[dict]:
    folders = commit.folders()
    found = []
    for path in paths:
        path = path.strip("/")
        if path in commit.files:
            found.append(file_entry(commit.files[path]))
        elif path in folders:
            found.append(commit.folder_entry(path))
    return found
