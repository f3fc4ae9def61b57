"""Leases and outcomes between the forwarder processes and the manager's own, over a Unix socket.

The scheduler lives in the manager's process alone (one owner of what runs where). A forwarder asks
it for a lease on a ready worker for each request it forwards, and tells it how each request ended;
the rest (reading the request, sending it to the engine, streaming the answer back) is the
forwarder's own work, which is what one process could not do fast enough for many clients.

One JSON object per line, each way. A forwarder sends
  {"op": "acquire", "id": N, "config": C, "adapter": A|null, "key": K, "priority": P}
  {"op": "release", "lease": L}
  {"op": "done", "lease": L|null, "key": K, "name": NAME|null, "config": C|null, "status": S,
   "tokens": [P, C]|null, "added": X|null, "admitted": B, "queue_full": B}
  {"op": "admit", "id": N, "key": K, "name": NAME, "limits": [RPM, TPM, CONCURRENT, BUDGET, PERIOD], "asked": T}
  {"op": "let_go", "key": K}
  {"op": "adapter_missing", "lease": L, "adapter": A}
  {"op": "give_up", "id": N}   (the client of acquire N left while it waited: it leaves the queue here too)
  {"op": "loading", "id": N, "config": C}   (what a request waiting for C waits for: loading progress)
  {"op": "wrong_token", "kind": K, "address": A}
and the manager answers an acquire with
  {"id": N, "lease": L, "port": P, "address": H, "queued": B, "engine_key": K|null}
  or   {"id": N, "refused": {"status", "body", "headers"}}
a loading with {"id": N, "loading": TEXT},
and an admit (a request of a key with limits, counted here so that a limit is one for all processes) with
  {"id": N, "headers": {...}}   or   {"id": N, "refused": {...}}
(the engine's API key passes here: the socket lives in the manager's private run folder)
and tells every forwarder when an address has sent too many wrong secrets of a kind (an admin token or
an inference key, K: manager.auth.throttle.KINDS; to /v1 through any of them, to the API or to the
login page): {"op": "throttled", "kind": K, "address": A, "retry_after_s": S}. The counts are the
manager's alone, so the limits are the same with forwarders as without.
A forwarder that goes away gives back every lease it held.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import json
import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from manager.auth.throttle import KINDS, WrongTokenThrottle
from manager.frontdoor.access import ANYONE, Caller
from manager.frontdoor.errors import FrontDoorError, ModelUnavailable
from manager.frontdoor.forwarding import Admissions, Held, LeaseSource, Outcome, Tally
from manager.frontdoor.limits import KeyLimits
from manager.frontdoor.metering import Tokens
from manager.schemas.usage import NO_KEY

log = logging.getLogger("vllm_manager.frontdoor")

MAX_THROTTLED = 10_000  # addresses a forwarder remembers as waiting, as the manager's own limit


class Door(LeaseSource, Tally, Admissions, Protocol):
    """The manager's side: its LeaseSource, Tally and Admissions (``FrontDoor``)."""


class Refused(FrontDoorError):
    """A refusal the manager's process answered a forwarder's acquire with, passed on as it was made."""

    def __init__(self, status: int, body: dict[str, Any], headers: dict[str, str]) -> None:
        error = body.get("error", {})
        super().__init__(str(error.get("message", "")), param=error.get("param"), headers=headers)
        self.status = status
        self.type = str(error.get("type", "server_error"))
        self.code = error.get("code")


def _line(message: dict[str, Any]) -> bytes:
    return json.dumps(message, separators=(",", ":")).encode() + b"\n"


# ---- the manager's side ---------------------------------------------------------------------------------
class LeaseServer:
    def __init__(self, door: Door, path: Path, throttles: Mapping[str, WrongTokenThrottle] | None = None) -> None:
        self.door = door
        self.path = path
        self.throttles = {kind: WrongTokenThrottle() for kind in KINDS} if throttles is None else dict(throttles)
        self._listening: list[tuple[WrongTokenThrottle, Callable[[str, int], None]]] = []
        for kind, throttle in self.throttles.items():
            listener = functools.partial(self._throttled, kind)
            throttle.on_limit.append(listener)
            self._listening.append((throttle, listener))
        self._server: asyncio.Server | None = None
        self._numbers = itertools.count(1)
        self._writers: set[asyncio.StreamWriter] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_unix_server(self._serve, path=str(self.path))

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for writer in list(self._writers):
            writer.close()
        for throttle, listener in self._listening:
            if listener in throttle.on_limit:
                throttle.on_limit.remove(listener)
        self._listening.clear()

    def _throttled(self, kind: str, address: str, wait_s: int) -> None:
        told = _line({"op": "throttled", "kind": kind, "address": address, "retry_after_s": wait_s})
        for writer in self._writers:
            if not writer.is_closing():
                writer.write(told)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held: dict[int, Held] = {}
        in_flight: dict[int, int] = {}  # admitted requests per key, given back if the forwarder goes away
        asking: dict[int, asyncio.Task[None]] = {}  # the acquires waiting, by the forwarder's id
        self._writers.add(writer)
        try:
            while line := await reader.readline():
                message = json.loads(line)
                op = message.get("op")
                if op == "acquire":
                    task = asyncio.create_task(self._acquire(message, held, writer))
                    asking[message["id"]] = task
                    task.add_done_callback(functools.partial(_forget, asking, message["id"]))
                elif op == "give_up":
                    given_up = asking.pop(message["id"], None)
                    if given_up is not None:
                        given_up.cancel()
                elif op == "loading":
                    waits_for = await self.door.loading(str(message["config"]))
                    writer.write(_line({"id": message["id"], "loading": waits_for}))
                elif op == "release":
                    lease = held.pop(message["lease"], None)
                    if lease is not None:
                        lease.release()
                elif op == "done":
                    tokens = message.get("tokens")
                    outcome = Outcome(
                        message["key"],
                        message.get("config"),
                        message["status"],
                        Tokens(*tokens) if tokens else None,
                        message.get("added"),
                        message.get("name"),
                        _landed(in_flight, message["key"]) if message.get("admitted") else False,
                        bool(message.get("queue_full")),
                    )
                    self.door.record(outcome, held.pop(message.get("lease"), None))
                elif op == "admit":
                    writer.write(_line(await self._admit(message, in_flight)))
                elif op == "let_go":
                    if _landed(in_flight, message["key"]):
                        self.door.let_go(message["key"])
                elif op == "wrong_token":
                    self.throttles[str(message["kind"])].record_failure(str(message["address"]))
                elif op == "adapter_missing":
                    lease = held.get(message["lease"])
                    if lease is not None:
                        self.door.adapter_missing(lease, message["adapter"])
        except (ConnectionError, ValueError, KeyError, TypeError) as exc:
            log.warning("a forwarder's lease channel failed (%s): its leases are given back", exc)
        finally:
            for task in list(asking.values()):
                task.cancel()
            for lease in held.values():
                lease.release()
            held.clear()
            for key_id, count in in_flight.items():
                for _ in range(count):  # at most the requests the forwarder had in flight
                    self.door.let_go(key_id)
            self._writers.discard(writer)
            writer.close()

    async def _admit(self, message: dict[str, Any], in_flight: dict[int, int]) -> dict[str, Any]:
        rpm, tpm, concurrent, budget, period = message["limits"]
        key_id = int(message["key"])
        caller = Caller(key_id, message.get("name"), limits=KeyLimits(rpm, tpm, concurrent, budget, period))
        try:
            headers = await self.door.admit(caller, int(message["asked"]))
        except FrontDoorError as exc:
            return {"id": message["id"], "refused": {"status": exc.status, "body": exc.body(), "headers": exc.headers}}
        in_flight[key_id] = in_flight.get(key_id, 0) + 1
        return {"id": message["id"], "key": key_id, "headers": headers}

    async def _acquire(self, message: dict[str, Any], held: dict[int, Held], writer: asyncio.StreamWriter) -> None:
        asked = message["id"]
        try:
            avoid = tuple(int(w) for w in message.get("avoid") or ())
            # The caller's key and priority place the request in line; its models were checked by the forwarder.
            caller = Caller(
                key_id=int(message.get("key", NO_KEY)), priority=str(message.get("priority", "interactive"))
            )
            lease = await self.door.acquire(
                message["config"], message.get("adapter"), message.get("affinity"), avoid, caller
            )
        except FrontDoorError as exc:
            answer: dict[str, Any] = {
                "id": asked,
                "refused": {"status": exc.status, "body": exc.body(), "headers": exc.headers},
            }
        except Exception as exc:  # the forwarder's client must hear why, and the channel must go on
            log.exception("a lease for %s failed", message.get("config"))
            refusal = ModelUnavailable(f"the manager could not serve {message.get('config')!r}: {exc}")
            answer = {"id": asked, "refused": {"status": refusal.status, "body": refusal.body(), "headers": {}}}
        else:
            if writer.is_closing():
                lease.release()
                return
            number = next(self._numbers)
            held[number] = lease
            answer = {
                "id": asked,
                "lease": number,
                "worker_id": lease.worker_id,
                "port": lease.port,
                "address": lease.address,
                "queued": lease.queued,
                "engine_key": lease.engine_key,
            }
        if not writer.is_closing():
            writer.write(_line(answer))


def _forget(asking: dict[int, asyncio.Task[None]], asked: int, _: asyncio.Task[None]) -> None:
    asking.pop(asked, None)


def _landed(in_flight: dict[int, int], key_id: int) -> bool:
    """Take one of the key's admitted requests off; False when it had none here."""
    count = in_flight.get(key_id, 0)
    if count <= 0:
        return False
    if count == 1:
        del in_flight[key_id]
    else:
        in_flight[key_id] = count - 1
    return True


# ---- a forwarder's side ---------------------------------------------------------------------------------
@dataclass
class RemoteLease:
    number: int
    worker_id: int
    port: int
    address: str
    queued: bool
    _client: LeaseClient = field(repr=False)
    engine_key: str | None = field(default=None, repr=False)
    released: bool = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self._client.send({"op": "release", "lease": self.number})


class PushedThrottle:
    """A forwarder's view of one of the manager's limits on wrong secrets (``kind``): its wrong ones are
    told to the manager, which counts them, and the addresses it says must wait are refused here until
    then."""

    def __init__(self, client: LeaseClient, kind: str) -> None:
        self._client = client
        self.kind = kind
        self._until: dict[str, float] = {}

    def retry_after(self, address: str) -> int | None:
        until = self._until.get(address)
        if until is None:
            return None
        left = until - time.monotonic()
        if left <= 0:
            del self._until[address]
            return None
        return max(1, math.ceil(left))

    def record_failure(self, address: str) -> None:
        self._client.send({"op": "wrong_token", "kind": self.kind, "address": address})

    def limit_reached(self, address: str, wait_s: float) -> None:
        if len(self._until) > MAX_THROTTLED:
            now = time.monotonic()
            self._until = {a: t for a, t in self._until.items() if t > now}
        self._until[address] = time.monotonic() + wait_s


class ChannelLost(Exception):
    """The manager's process no longer answers on the lease channel."""


class LeaseClient:
    """A forwarder's LeaseSource and Tally: each lease asked of the manager's process, each outcome told to it."""

    def __init__(self) -> None:
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._asked: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._numbers = itertools.count(1)
        self._reading: asyncio.Task[None] | None = None
        self.lost = asyncio.Event()
        self.throttles = {kind: PushedThrottle(self, kind) for kind in KINDS}

    async def connect(self, path: Path, timeout_s: float = 30.0) -> None:
        """Connect, retrying while the manager's process is still starting its channel."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            try:
                self._reader, self._writer = await asyncio.open_unix_connection(str(path))
                break
            except (FileNotFoundError, ConnectionRefusedError):
                if loop.time() > deadline:
                    raise ChannelLost(
                        f"the manager's lease channel at {path} did not open in {timeout_s:g} s"
                    ) from None
                await asyncio.sleep(0.05)
        self._reading = asyncio.create_task(self._read())

    async def close(self) -> None:
        if self._reading is not None:
            self._reading.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reading
        if self._writer is not None:
            self._writer.close()

    def send(self, message: dict[str, Any]) -> None:
        if self._writer is not None and not self._writer.is_closing():
            self._writer.write(_line(message))

    async def _read(self) -> None:
        assert self._reader is not None
        try:
            while line := await self._reader.readline():
                answer = json.loads(line)
                if answer.get("op") == "throttled":
                    pushed = self.throttles[str(answer["kind"])]
                    pushed.limit_reached(str(answer["address"]), float(answer["retry_after_s"]))
                    continue
                asked = self._asked.pop(answer["id"], None)
                if asked is not None and not asked.done():
                    asked.set_result(answer)
                elif "lease" in answer:  # its request gave up waiting (the client left): not needed
                    self.send({"op": "release", "lease": answer["lease"]})
                elif "headers" in answer:  # admitted for a client that left
                    self.send({"op": "let_go", "key": answer["key"]})
        except (ConnectionError, ValueError, KeyError) as exc:
            log.error("the lease channel to the manager failed: %s", exc)
        finally:
            for asked in self._asked.values():
                if not asked.done():
                    asked.set_exception(ChannelLost("the manager's process closed the lease channel"))
            self._asked.clear()
            self.lost.set()

    async def admit(self, caller: Caller, asked_tokens: int) -> dict[str, str]:
        limits = caller.limits
        if limits is None:
            return {}
        if self.lost.is_set():
            raise ModelUnavailable("the manager's main process is not answering this forwarder; retry")
        number = next(self._numbers)
        answer_of: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._asked[number] = answer_of
        counts = [limits.rpm, limits.tpm, limits.max_concurrent, limits.token_budget, limits.budget_period]
        self.send(
            {"op": "admit", "id": number, "key": caller.key_id, "name": caller.key_name, "limits": counts,
             "asked": asked_tokens}
        )  # fmt: skip
        try:
            answer = await answer_of
        except ChannelLost:
            raise ModelUnavailable("the manager's main process stopped answering this forwarder; retry") from None
        except asyncio.CancelledError:
            # Admitted just now, for a client that left: not in flight after all.
            if answer_of.done() and not answer_of.cancelled() and "headers" in answer_of.result():
                self.let_go(caller.key_id)
            raise
        refused = answer.get("refused")
        if refused is not None:
            raise Refused(refused["status"], refused["body"], refused["headers"])
        return dict(answer["headers"])

    def let_go(self, key_id: int) -> None:
        self.send({"op": "let_go", "key": key_id})

    async def acquire(
        self,
        config: str,
        adapter: str | None,
        affinity: str | None = None,
        avoid: tuple[int, ...] = (),
        caller: Caller = ANYONE,
    ) -> Held:
        if self.lost.is_set():
            raise ModelUnavailable("the manager's main process is not answering this forwarder; retry")
        number = next(self._numbers)
        answer_of: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._asked[number] = answer_of
        self.send(
            {
                "op": "acquire",
                "id": number,
                "config": config,
                "adapter": adapter,
                "affinity": affinity,
                "avoid": avoid,
                "key": caller.key_id,
                "priority": caller.priority,
            }
        )
        try:
            answer = await answer_of
        except ChannelLost:
            raise ModelUnavailable("the manager's main process stopped answering this forwarder; retry") from None
        except asyncio.CancelledError:
            # The client left: the manager's process stops waiting for it too (its queue, and a load
            # made for it alone). An answer still to come finds no one asking, and its lease is given
            # back (``_read``); one that came just now is given back here.
            if answer_of.done() and not answer_of.cancelled() and answer_of.exception() is None:
                given = answer_of.result().get("lease")
                if given is not None:
                    self.send({"op": "release", "lease": given})
            else:
                self.send({"op": "give_up", "id": number})
            raise
        refused = answer.get("refused")
        if refused is not None:
            raise Refused(refused["status"], refused["body"], refused["headers"])
        return RemoteLease(
            answer["lease"],
            answer["worker_id"],
            answer["port"],
            answer["address"],
            answer["queued"],
            self,
            answer.get("engine_key"),
        )

    async def loading(self, config: str) -> str:
        if self.lost.is_set():
            return f"waiting for {config}"
        number = next(self._numbers)
        answer_of: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._asked[number] = answer_of
        self.send({"op": "loading", "id": number, "config": config})
        try:
            answer = await answer_of
        except ChannelLost:
            return f"waiting for {config}"
        return str(answer.get("loading") or f"waiting for {config}")

    def adapter_missing(self, lease: Held, adapter: str) -> None:
        assert isinstance(lease, RemoteLease)
        self.send({"op": "adapter_missing", "lease": lease.number, "adapter": adapter})

    def record(self, outcome: Outcome, lease: Held | None = None) -> None:
        number = None
        if isinstance(lease, RemoteLease) and not lease.released:
            lease.released = True
            number = lease.number
        tokens = [outcome.tokens.prompt, outcome.tokens.completion] if outcome.tokens else None
        self.send(
            {
                "op": "done",
                "lease": number,
                "key": outcome.key_id,
                "config": outcome.config,
                "status": outcome.status,
                "tokens": tokens,
                "added": outcome.added_s,
                "name": outcome.key_name,
                "admitted": outcome.admitted,
                "queue_full": outcome.queue_full,
            }
        )
