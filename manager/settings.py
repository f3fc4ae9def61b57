"""The manager's settings: environment variables (prefix VLLM_MANAGER_) and `serve` options."""

from __future__ import annotations

import ipaddress
import os
import sys
import tempfile
from functools import cached_property
from pathlib import Path
from typing import Any

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from manager.address import DEFAULT_PORT, is_loopback

__all__ = ["DEFAULT_PORT", "DataDirUnusable", "Settings", "is_loopback", "make_private"]

# A token from the environment or a file must be at least this long: it opens the whole manager.
# Stored tokens are generated (vmt_ and 43 random characters).
MIN_TOKEN_LENGTH = 32
MAKE_A_TOKEN = "python3 -c 'import secrets; print(secrets.token_urlsafe(32))'"


def default_data_dir() -> Path:
    return Path.home() / ".local" / "share" / "vllm-manager"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="VLLM_MANAGER_", extra="ignore")

    data_dir: Path = Field(default_factory=default_data_dir)
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    # A token from the environment (or a file, for Docker secrets) works beside stored tokens.
    api_token: str | None = None
    api_token_file: Path | None = None
    # Once a token exists, reading (pages, GET endpoints, live streams) needs it too, or a session
    # from the login page. This keeps reads open to anyone who reaches the manager; changes still
    # need the token.
    open_reads: bool = False
    # The interpreter that runs vLLM; validation of a command uses exactly this one.
    engine_python: str = Field(default_factory=lambda: sys.executable)
    worker_ports: str = "8100-8199"
    # Where workers listen. Loopback by default; a container sets 0.0.0.0 so published ports reach them.
    # Workers on other nodes of a Ray cluster listen on their node's address, where the manager reaches them.
    worker_host: str = "127.0.0.1"
    # A Ray cluster to run workers on ("auto", or the head's host:port). Unset: this box only, no Ray.
    ray_address: str | None = None
    # Engine flags that load code of the user's choosing are refused unless this is on.
    allow_code_flags: bool = False
    stop_grace_s: float = 20.0
    # A clean stop of the manager (Ctrl-C, SIGTERM) stops the workers it runs, gracefully. Off
    # (`serve --keep-workers`): their engines keep running and the next manager re-adopts them, as it
    # always does after a manager that died (kill -9, a crash).
    stop_workers_on_exit: bool = True
    health_interval_s: float = 2.0
    health_failures_before_crash: int = 3
    restart_ceiling: int = 5
    backoff_base_s: float = 10.0
    backoff_cap_s: float = 300.0
    healthy_reset_s: float = 600.0
    metrics_retention_days: float = 7.0
    # Rows of the audit log older than this are deleted (at start, then daily).
    audit_retention_days: float = Field(default=90.0, gt=0)
    validation_timeout_s: float = 180.0
    # Request bodies larger than this are refused (413). An export file of every config is far smaller
    # than the import limit; a config alone is at most a few hundred KiB.
    max_body_bytes: int = Field(default=2 * 1024**2, ge=1024)
    max_import_bytes: int = Field(default=16 * 1024**2, ge=1024)
    # The front door (/v1). Bodies over this size get 413 (audio uploads are the big ones).
    proxy_max_body_bytes: int = Field(default=64 << 20, gt=0)
    # Requests that may wait for one model (its start, a swap, a drain, their turn) before 429 with Retry-After.
    proxy_max_queue: int = Field(default=64, ge=0)
    # Of those, the requests one inference key may have waiting for one model (429 beyond); requests
    # without a key share the limit above only.
    max_queue_per_key: int = Field(default=32, ge=1)
    # How long a request waits for its turn at a ready model (its max_concurrent, the fair queue), then 504.
    queue_timeout_s: float = Field(default=600.0, gt=0)
    proxy_retry_after_s: int = Field(default=5, ge=1)
    # How long a swap waits for the busy models it must evict to finish their requests, then 503.
    proxy_drain_timeout_s: float = Field(default=60.0, gt=0)
    # How often models are checked against their idle_timeout_s.
    idle_check_s: float = Field(default=5.0, gt=0)
    # Without inference keys, /v1 is open on a loopback bind; on a public bind it needs the admin
    # token, unless this is set (logged at start). Once a key exists, /v1 needs one on any bind.
    open_inference: bool = False
    # One log line per HTTP request (uvicorn's access log). Under heavy /v1 load it is a good share of
    # the manager's CPU (bench/README.md); 0 turns it off. Events, errors and engine logs stay.
    access_log: bool = True
    # Processes besides the manager's own that take the HTTP port and forward /v1 requests themselves
    # (everything else they pass to the manager's process). 0: the manager's process does it all. On a
    # box with cores to spare, a few let /v1 keep up with many clients (bench/README.md).
    forwarders: int = Field(default=0, ge=0, le=64)
    # Proxies in front of the manager whose X-Forwarded-For and X-Forwarded-Proto are believed: addresses
    # or networks, comma separated ("*": any peer). Empty: none, so a client's address is the peer's,
    # and no client can claim another address to escape the limit on wrong tokens.
    forwarded_allow_ips: str = ""
    # Host names this manager answers to (DNS-rebinding guard). Default: loopback names when bound to
    # loopback, any name when bound to a public address (where the API token guards changes).
    allowed_hosts: list[str] | None = None

    def trusted_hosts(self) -> list[str]:
        if self.allowed_hosts:
            return self.allowed_hosts
        if is_loopback(self.host):
            return ["localhost", "127.0.0.1", "::1", "[::1]"]
        return ["*"]

    def proxy_header_options(self) -> dict[str, Any]:
        """uvicorn's options for forwarded headers: believed only from the proxies named."""
        proxies = self.forwarded_proxies
        if not proxies:
            return {"proxy_headers": False}
        return {"proxy_headers": True, "forwarded_allow_ips": proxies}

    @property
    def forwarded_proxies(self) -> list[str]:
        items = [item.strip() for item in self.forwarded_allow_ips.split(",") if item.strip()]
        # A network written with host bits (10.0.0.1/8) as the network it names: uvicorn would take it for
        # a name and never match it.
        return [str(ipaddress.ip_network(item, strict=False)) if "/" in item else item for item in items]

    @field_validator("forwarded_allow_ips")
    @classmethod
    def _check_proxies(cls, value: str) -> str:
        for item in (item.strip() for item in value.split(",")):
            if not item or item == "*":
                continue
            try:
                ipaddress.ip_network(item, strict=False)
            except ValueError:
                raise ValueError(
                    f"forwarded_allow_ips takes IP addresses or networks separated by commas (e.g. "
                    f"127.0.0.1,10.0.0.0/8), or '*'; {item!r} is neither"
                ) from None
        return value

    @field_validator("worker_ports")
    @classmethod
    def _check_range(cls, value: str) -> str:
        lo, sep, hi = value.partition("-")
        if not sep or not lo.strip().isdigit() or not hi.strip().isdigit() or int(lo) > int(hi):
            raise ValueError(f"worker_ports must look like 8100-8199, got {value!r}")
        return value

    @field_validator("worker_host")
    @classmethod
    def _check_worker_host(cls, value: str) -> str:
        # The manager reaches its workers on 127.0.0.1; a wildcard bind includes loopback, another
        # address would not.
        if value not in ("127.0.0.1", "localhost", "0.0.0.0", "::", "::1"):
            raise ValueError(f"worker_host must be 127.0.0.1 (default) or 0.0.0.0 (containers), got {value!r}")
        return value

    @property
    def worker_port_range(self) -> range:
        lo, _, hi = self.worker_ports.partition("-")
        return range(int(lo), int(hi) + 1)

    @property
    def local_model_paths(self) -> bool:
        """Engines run on this machine (no Ray cluster), so a config's model path names a folder here."""
        return self.ray_address is None

    @property
    def db_path(self) -> Path:
        return self.data_dir / "manager.db"

    @property
    def logs_dir(self) -> Path:
        return self.data_dir / "logs"

    @property
    def run_dir(self) -> Path:
        return self.data_dir / "run"

    @cached_property
    def env_token(self) -> str | None:
        """The token from VLLM_MANAGER_API_TOKEN or VLLM_MANAGER_API_TOKEN_FILE; ValueError, saying
        what to do, when the file cannot be read or the token is too short to be safe."""
        if self.api_token and self.api_token.strip():
            return _long_enough(self.api_token.strip(), "VLLM_MANAGER_API_TOKEN")
        if self.api_token_file:
            try:
                token = self.api_token_file.read_text().strip()
            except OSError as exc:
                raise ValueError(f"VLLM_MANAGER_API_TOKEN_FILE {self.api_token_file} cannot be read: {exc}") from exc
            return _long_enough(token, f"the token in VLLM_MANAGER_API_TOKEN_FILE ({self.api_token_file})") or None
        return None

    def ensure_dirs(self) -> None:
        """The data dir and its folders, readable by this user only (0700): the database holds
        environment values such as HF_TOKEN, and engine logs hold whatever the engines print.
        DataDirUnusable when they cannot be made or written."""
        try:
            for folder in (self.data_dir, self.logs_dir, self.run_dir):
                folder.mkdir(mode=0o700, parents=True, exist_ok=True)
                make_private(folder, 0o700)
            with tempfile.TemporaryFile(dir=self.data_dir):
                pass  # an existing folder on a read-only disk (or of another user) fails here
        except OSError as exc:
            raise DataDirUnusable(
                f"the data dir {self.data_dir} cannot be written ({exc.strerror or exc}): the manager keeps its "
                "database and the engine logs there. Make it writable for this user, or choose another "
                "folder with --data-dir or VLLM_MANAGER_DATA_DIR."
            ) from exc


def _long_enough(token: str, source: str) -> str:
    if token and len(token) < MIN_TOKEN_LENGTH:
        raise ValueError(
            f"{source} is too short ({len(token)} of at least {MIN_TOKEN_LENGTH} characters): the token opens "
            f"the whole manager, so it must not be guessable. Make one with: {MAKE_A_TOKEN}"
        )
    return token


class DataDirUnusable(Exception):
    """The data dir cannot be created or written; the message names it and says what to do."""


def make_private(path: Path, mode: int) -> None:
    """Take group and other access away from a file or folder of this user's; one owned by someone
    else (a mounted volume) keeps its mode, and the manager does not fail over it."""
    try:
        stat = path.stat()
        if stat.st_uid == os.getuid() and stat.st_mode & 0o777 != mode:
            path.chmod(mode)
    except OSError:
        pass
