"""One /v1 request from the route to the engine and back: its body read, its model found among those
its caller may use, a lease on a ready worker taken, the request sent and the answer streamed back.

The same path runs in the manager's process and in its forwarder processes
(``manager.frontdoor.forwarders``): what differs is where leases come from (``LeaseSource``: the
scheduler itself, or the manager's process over a socket), where a key's limits are counted
(``Admissions``) and where each request's outcome is counted (``Tally``: the metrics, the usage table
and the limits, here or there). A request of a key without limits is not admitted at all: no cost.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from starlette.requests import Request
from starlette.responses import Response

from manager.frontdoor import names, progress, proxy
from manager.frontdoor.access import ANYONE, Caller
from manager.frontdoor.errors import ClientLeft, EngineUnreachable, FrontDoorError, QueueFull
from manager.frontdoor.metering import Meter, Tokens, stream_options_to_send
from manager.frontdoor.replica_choice import affinity_of
from manager.frontdoor.upstream import EngineAnswer, Upstream


class Held(Protocol):
    """A request's hold on a ready worker: where its engine answers, and whether getting it waited."""

    worker_id: int
    port: int
    address: str
    queued: bool  # it waited for its model (a start, a swap, a drain, an adapter load)
    engine_key: str | None  # the API key the engine asks for (its config's --api-key)

    def release(self) -> None: ...


class LeaseSource(Protocol):
    async def acquire(
        self,
        config: str,
        adapter: str | None,
        affinity: str | None = None,
        avoid: tuple[int, ...] = (),
        caller: Caller = ANYONE,
    ) -> Held:
        """A lease on a ready worker of ``config`` with ``adapter`` loaded; FrontDoorError when none can be had.
        Of several replicas: the one ``affinity`` (the request's conversation) and the load say, passing
        over the workers in ``avoid``. While it waits, ``caller``'s key and priority set its place in line."""
        ...

    def adapter_missing(self, lease: Held, adapter: str) -> None:
        """The engine answered 404 for ``adapter`` (unloaded by hand): load it again next time."""
        ...

    async def loading(self, config: str) -> str:
        """What a request waiting for ``config`` waits for, in a few words ('loading qwen3-30b 42 %')."""
        ...


@dataclass(frozen=True)
class Outcome:
    """How one /v1 request ended, for the metrics and the usage per key and model."""

    key_id: int
    config: str | None  # None: its name matched no model
    status: int
    tokens: Tokens | None = None
    added_s: float | None = None  # the manager's own time in it; None when it never reached an engine
    key_name: str | None = None
    admitted: bool = False  # counted by its key's limits (in flight until now)
    queue_full: bool = False  # refused because its model's queue was full


class Admissions(Protocol):
    async def admit(self, caller: Caller, asked_tokens: int) -> dict[str, str]:
        """Count a request of a key with limits (OverKeyLimit when it is over one); the x-ratelimit
        headers to answer with. The request stays in flight until its Outcome (admitted) is recorded."""
        ...

    def let_go(self, key_id: int) -> None:
        """An admitted request ended with no outcome recorded (its client left before an answer)."""
        ...


def asked_tokens(payload: dict[str, Any]) -> int:
    """The most tokens a request may generate, as it says (for the budget); 1 when it does not."""
    for field in ("max_completion_tokens", "max_tokens", "max_output_tokens"):  # the last: /v1/responses
        value = payload.get(field)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return 1


class Tally(Protocol):
    def record(self, outcome: Outcome, lease: Held | None = None) -> None:
        """Count a request that ended, and end its lease (when it had one)."""
        ...


class Forwarding:
    def __init__(
        self,
        upstream: Upstream,
        max_body_bytes: int,
        resolve: Callable[[str, Caller], names.Target],
        leases: LeaseSource,
        tally: Tally,
        admissions: Admissions,
        # Whether a model config has loading progress on for its streamed requests (its loading_progress).
        loading_progress: Callable[[str], bool] = lambda config: False,
    ) -> None:
        self.loading_progress = loading_progress
        self.upstream = upstream
        self.max_body_bytes = max_body_bytes
        self.resolve = resolve
        self.leases = leases
        self.tally = tally
        self.admissions = admissions

    async def forward_json(self, request: Request, path: str, caller: Caller) -> Response:
        added = proxy.AddedTime()
        config: str | None = None
        rate_headers: dict[str, str] | None = None
        try:
            said = progress.asked(request)  # a bad value is refused before the body is read or a model named
            body = await proxy.read_body(request, self.max_body_bytes)
            payload, requested = proxy.json_model(body)
            target = self.resolve(requested, caller)
            config = target.config
            changes: dict[str, Any] = {}
            if target.upstream_model != requested:
                changes["model"] = target.upstream_model
            # Streams end with their token counts only when asked: ask, and take them out again.
            options = stream_options_to_send(path, payload)
            if options is not None:
                changes["stream_options"] = options
            forwarded = proxy.with_changes(payload, body, changes)
            content_type = request.headers.get("content-type") or "application/json"
            meter = Meter(take_usage_event=options is not None)
            if caller.limits is not None:
                rate_headers = await self.admissions.admit(caller, asked_tokens(payload))

            def encoded() -> tuple[bytes, str]:
                return forwarded, content_type

            shows_progress = progress.wanted(payload, said, self.loading_progress(target.config))
            return await self._forward(
                request, path, target, encoded, caller, meter, added, rate_headers, affinity_of(payload), shows_progress
            )
        except FrontDoorError as exc:
            self._refused(caller, config, exc, rate_headers is not None)
            raise
        except BaseException:
            if rate_headers is not None:
                self.admissions.let_go(caller.key_id)
            raise

    async def forward_multipart(self, request: Request, path: str, caller: Caller) -> Response:
        added = proxy.AddedTime()
        config: str | None = None
        rate_headers: dict[str, str] | None = None
        try:
            body = await proxy.read_body(request, self.max_body_bytes)
            requested, rewrite = await proxy.multipart_model(request, body)
            target = self.resolve(requested, caller)
            config = target.config
            if caller.limits is not None:
                rate_headers = await self.admissions.admit(caller, 1)
            return await self._forward(
                request, path, target, lambda: rewrite(target.upstream_model), caller, Meter(), added, rate_headers
            )
        except FrontDoorError as exc:
            self._refused(caller, config, exc, rate_headers is not None)
            raise
        except BaseException:
            if rate_headers is not None:
                self.admissions.let_go(caller.key_id)
            raise

    def _refused(self, caller: Caller, config: str | None, exc: FrontDoorError, admitted: bool) -> None:
        queue_full = isinstance(exc, QueueFull) or getattr(exc, "code", None) == QueueFull.code
        outcome = Outcome(
            caller.key_id, config, exc.status, key_name=caller.key_name, admitted=admitted, queue_full=queue_full
        )
        self.tally.record(outcome)

    async def _forward(
        self,
        request: Request,
        path: str,
        target: names.Target,
        encoded: Callable[[], tuple[bytes, str]],
        caller: Caller,
        meter: Meter,
        added: proxy.AddedTime,
        rate_headers: dict[str, str] | None,  # None: not admitted (its key has no limits)
        affinity: str | None = None,
        shows_progress: bool = False,
    ) -> Response:
        if shows_progress:
            sending = asyncio.ensure_future(self._send(request, path, target, encoded, added, affinity, caller))
            await asyncio.wait({sending}, timeout=progress.FIRST_AFTER_S)
            if not sending.done():
                return self._while_loading(sending, target, caller, meter, added, rate_headers)
            lease, upstream = sending.result()
        else:
            lease, upstream = await self._send(request, path, target, encoded, added, affinity, caller)
        try:
            status = upstream.status_code
            if target.adapter and status == 404:
                self.leases.adapter_missing(lease, target.adapter)
            ok = status < 400
            before_engine = added.before_engine() or 0.0

            def ended(after_engine: float | None) -> None:
                added_s = before_engine + (after_engine or 0.0)
                tokens = meter.tokens if ok else None
                outcome = Outcome(
                    caller.key_id, target.config, status, tokens, added_s, caller.key_name, rate_headers is not None
                )
                self.tally.record(outcome, lease)

            # Only a successful answer is read for its usage (an error passes on as the engine wrote it).
            content = meter.watch(upstream.chunks()) if ok and meter.readable(upstream.headers) else None
            return proxy.UpstreamResponse(upstream, ended, content, rate_headers)
        except BaseException:  # the response that would end the lease and the answer was not made
            upstream.close()
            lease.release()
            raise

    async def _send(
        self,
        request: Request,
        path: str,
        target: names.Target,
        encoded: Callable[[], tuple[bytes, str]],
        added: proxy.AddedTime,
        affinity: str | None,
        caller: Caller,
    ) -> tuple[Held, EngineAnswer]:
        """The request sent to a ready worker, and its lease. An engine that does not answer at all (it
        just crashed or stopped) is passed over once for another replica of the model, when there is one:
        nothing of the answer had reached the client."""
        avoid: tuple[int, ...] = ()
        unanswered: EngineUnreachable | None = None
        while True:
            asked = time.perf_counter()
            lease = await proxy.unless_client_leaves(
                request, self.leases.acquire(target.config, target.adapter, affinity, avoid, caller)
            )
            if lease.queued:
                added.waited += time.perf_counter() - asked
            if unanswered is not None and lease.worker_id in avoid:  # no other replica is ready
                lease.release()
                raise unanswered
            try:
                body, content_type = encoded()
                upstream = await proxy.send_upstream(
                    self.upstream,
                    lease.port,
                    request.method,
                    path,
                    body,
                    request,
                    content_type,
                    added,
                    lease.address,
                    lease.engine_key,
                )
            except EngineUnreachable as exc:
                lease.release()
                if unanswered is not None:
                    raise
                unanswered, avoid = exc, (lease.worker_id,)
                continue
            except BaseException:
                lease.release()
                raise
            return lease, upstream

    def _while_loading(
        self,
        sending: asyncio.Task[tuple[Held, EngineAnswer]],
        target: names.Target,
        caller: Caller,
        meter: Meter,
        added: proxy.AddedTime,
        rate_headers: dict[str, str] | None,
    ) -> progress.LoadingStream:
        """The answer of a streamed request that asked for loading progress and waits for its model
        (``manager.frontdoor.progress``): comments while it waits, then the engine's events."""
        admitted = rate_headers is not None
        got: list[tuple[Held, EngineAnswer]] = []
        recorded = False

        def record(status: int, tokens: Tokens | None = None, lease: Held | None = None) -> None:
            nonlocal recorded
            if not recorded:
                recorded = True
                added_s = added.before_engine() if lease is not None else None
                outcome = Outcome(caller.key_id, target.config, status, tokens, added_s, caller.key_name, admitted)
                self.tally.record(outcome, lease)

        async def body() -> AsyncIterator[bytes]:
            async for line in progress.comments(sending, lambda: self.leases.loading(target.config)):
                yield line
            try:
                lease, upstream = sending.result()
            except FrontDoorError as exc:
                record(exc.status)
                yield progress.error_event(exc.body())
                return
            got.append((lease, upstream))
            status = upstream.status_code
            if status >= 400 or not upstream.headers.get("content-type", "").startswith("text/event-stream"):
                raw = b""
                async for chunk in upstream.chunks():
                    raw += chunk
                    if len(raw) > progress.ERROR_BODY_LIMIT:
                        break
                record(status if status >= 400 else 502, lease=lease)
                yield progress.error_event(progress.engine_error(status, raw))
                return
            chunks = meter.watch(upstream.chunks()) if meter.readable(upstream.headers) else upstream.chunks()
            async for chunk in chunks:
                yield chunk
            record(status, meter.tokens, lease)

        def closed() -> None:
            if not sending.done():
                sending.cancel()  # the client left while it waited: it leaves the queue
            elif not got and not sending.cancelled() and sending.exception() is None:
                got.append(sending.result())  # served just as the client left
            for lease, upstream in got:
                upstream.close()
                record(upstream.status_code, meter.tokens if upstream.status_code < 400 else None, lease)
            record(ClientLeft.status)

        return progress.LoadingStream(body(), closed, rate_headers)
