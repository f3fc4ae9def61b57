"""Who may send requests to /v1, and which models each caller may use.

Inference keys, once any is made, are needed on every bind, even after the last one is revoked, until
the admin opens /v1 again (`vllm-manager keys open-v1`); the admin token also works, so the owner can
try a model. Before any key, /v1 is open on a loopback bind; on a public bind it takes the admin token,
unless the operator opened it (VLLM_MANAGER_OPEN_INFERENCE). A revoked key is refused everywhere. A key
made for some model configs sees only those: the others are answered as names that do not exist. A key
past its expires_at is refused, saying so; its other limits (``Caller.limits``) are counted as its
requests are forwarded (``manager.frontdoor.limits``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Protocol

from sqlmodel import Session
from starlette.requests import Request

from manager.errors import ManagerError, TooManyAttempts
from manager.frontdoor.errors import KeyExpired, NoCredentials, NotAllowed, TooManyWrongKeys
from manager.frontdoor.limits import BudgetPeriod, KeyLimits
from manager.request_checks import (
    Throttles,
    bearer,
    kind_of,
    record_wrong_token,
    refuse_cross_site,
    refuse_while_throttled,
)
from manager.schemas.usage import NO_KEY
from manager.services import inference_keys, tokens
from manager.settings import Settings, is_loopback

SEND_KEY = "send it as 'Authorization: Bearer <key>'"


@dataclass(frozen=True)
class Caller:
    """Who a /v1 request comes from: an inference key, or no key (the admin token, or /v1 open)."""

    key_id: int = NO_KEY
    key_name: str | None = None
    models: frozenset[str] | None = None  # the model configs it may use; None: all
    # Its requests' place in a model's queue: "interactive" ones go before "batch" ones (fair_queue).
    priority: str = "interactive"
    limits: KeyLimits | None = None  # None: none
    expires_at: float | None = None  # unix time; None: never

    def may_use(self, config: str) -> bool:
        return self.models is None or config in self.models


ANYONE = Caller()


@dataclass(frozen=True)
class Credentials:
    """What the store says about who may call /v1: the active inference keys by their SHA-256 digest,
    the digests of the revoked ones and of the stored admin tokens, and whether /v1 stays closed though
    no key is active. Read once per change of the store, not per request."""

    keys: dict[str, Caller] = field(default_factory=dict)
    admin_digests: frozenset[str] = frozenset()
    revoked: frozenset[str] = frozenset()
    closed_by_revoked_keys: bool = False


def read_credentials(db: Session) -> Credentials:
    keys = {}
    for key in inference_keys.active_keys(db):
        if key.id is None:
            continue
        period: BudgetPeriod = "day" if key.budget_period == "day" else "month"
        limits = KeyLimits(key.rpm, key.tpm, key.max_concurrent, key.token_budget, period)
        expires = key.expires_at.replace(tzinfo=key.expires_at.tzinfo or UTC).timestamp() if key.expires_at else None
        keys[key.sha256] = Caller(
            key.id,
            key.name,
            frozenset(key.models) if key.models else None,
            key.priority,
            limits if limits.any() else None,
            expires,
        )
    return Credentials(
        keys,
        frozenset(tokens.valid_digests(db, None)),
        frozenset(inference_keys.revoked_digests(db)),
        inference_keys.closed_by_revoked_keys(db),
    )


def caller_for(credentials: Credentials, bearer: str | None, settings: Settings) -> Caller:
    """The caller a request's bearer token makes it, or NoCredentials (401) saying what to send."""
    if bearer is not None:
        digest = tokens.digest(bearer) if bearer.startswith(inference_keys.KEY_START) else None
        key = credentials.keys.get(digest) if digest is not None else None
        if key is not None:
            if key.expires_at is not None and time.time() >= key.expires_at:
                when = datetime.fromtimestamp(key.expires_at, UTC)
                raise KeyExpired(
                    f"the key sent ({key.key_name}) expired at {when:%Y-%m-%d %H:%M:%S} UTC: ask the owner of this "
                    "server for a new one, or to extend it (`vllm-manager keys set NAME --expires ...`)"
                )
            return key
        if tokens.matches(bearer, settings.env_token, credentials.admin_digests):
            return ANYONE
        if digest in credentials.revoked:
            raise NoCredentials("the key sent was revoked: ask the owner of this server for a new one")
    if credentials.keys:
        if bearer is None:
            raise NoCredentials(
                f"/v1 on this server needs an inference key: {SEND_KEY}. Its owner makes keys with "
                "`vllm-manager keys create NAME` or on the Keys page"
            )
        raise NoCredentials("the key sent is not a valid inference key (mistyped, or revoked)")
    if credentials.closed_by_revoked_keys:
        raise NoCredentials(
            f"/v1 on this server needs an inference key ({SEND_KEY}) or the admin token: its keys were all "
            "revoked, and it stays closed until its owner makes a new key (`vllm-manager keys create NAME`) or "
            "opens it again (`vllm-manager keys open-v1`)"
        )
    if is_loopback(settings.host) or settings.open_inference:
        return ANYONE
    raise NoCredentials(
        f"the manager listens on {settings.host}, so /v1 needs an inference key ({SEND_KEY}; make one with "
        "`vllm-manager keys create NAME`) or the admin token; to open /v1 to anyone who reaches this address, "
        "set VLLM_MANAGER_OPEN_INFERENCE=1"
    )


class CallerSource(Protocol):
    def caller(self, bearer: str | None, settings: Settings) -> Caller: ...


def inference_caller(request: Request, door: CallerSource, settings: Settings, throttles: Throttles) -> Caller:
    """Who may send requests to /v1: an inference key once any exists, else anyone on a loopback bind,
    and on a public bind the admin token unless /v1 was opened explicitly. Browsers on other sites are
    refused as for every other call: they must not make a visitor's machine run models. Answered from
    what the front door keeps of the store: no database session per request. ``throttles``: the wrong
    secrets per address (the manager's own; a forwarder process reaches them through the lease channel).
    """
    try:
        refuse_cross_site(request)
    except ManagerError as exc:
        raise NotAllowed(exc.message) from None
    sent = bearer(request)
    if sent is None:
        return door.caller(None, settings)
    # Guessing keys is slowed down as guessing the admin token is: the same limit per address, each
    # kind of secret counted apart.
    kind = kind_of(sent)
    try:
        refuse_while_throttled(request, kind, throttles)
    except TooManyAttempts as exc:
        raise TooManyWrongKeys(exc.message, int(exc.detail["retry_after_s"])) from None
    try:
        return door.caller(sent, settings)
    except KeyExpired:
        raise  # a real key, not a guess
    except NoCredentials:
        record_wrong_token(request, kind, throttles)
        raise
