"""What an engine's answer says it used (its ``usage``), read as the answer passes, not after it.

A non-streamed answer carries ``usage`` near its end (vLLM writes it after the choices); a stream
carries it in its last event before ``[DONE]``, but only when the request asked for it
(``stream_options.include_usage``). The front door asks for it on every streamed chat or text
completion; when the client had not, that event is taken out again, so the client receives exactly
the stream it asked for.

Cheap by design: only the last ``TAIL_BYTES`` of an answer are kept and read as JSON once it has
ended. In a stream whose usage event must be taken out, each complete event is searched for the
bytes ``"usage"`` (a substring search) and only such an event is parsed.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

USAGE_PATHS = ("/v1/chat/completions", "/v1/completions")  # the endpoints whose streams take include_usage
TAIL_BYTES = 64 * 1024
USAGE = b'"usage"'
EVENT_END = b"\n\n"  # vLLM ends each Server-Sent Event with a blank line


@dataclass(frozen=True)
class Tokens:
    prompt: int
    completion: int


def stream_options_to_send(path: str, payload: dict[str, Any]) -> dict[str, Any] | None:
    """The ``stream_options`` that make a streamed completion end with its usage, when the client did
    not ask for it; None when the request is not such a stream or asks for usage already."""
    if path not in USAGE_PATHS or payload.get("stream") is not True:
        return None
    options = payload.get("stream_options")
    if options is None:
        return {"include_usage": True}
    if not isinstance(options, dict) or options.get("include_usage") is True:
        return None  # the engine answers a malformed value itself
    added: dict[str, Any] = {**options, "include_usage": True}
    if options.get("continuous_usage_stats"):
        added["continuous_usage_stats"] = False  # usage in every chunk would be more to take out
    return added


def usage_of(text: bytes) -> Tokens | None:
    """The tokens of the last ``"usage": {...}`` object in ``text``; None when there is none whole."""
    end = len(text)
    while (at := text.rfind(USAGE, 0, end)) >= 0:
        end = at
        rest = text[at + len(USAGE) :].lstrip()
        if not rest.startswith(b":"):
            continue
        rest = rest[1:].lstrip()
        if not rest.startswith(b"{"):
            continue
        try:
            found, _ = json.JSONDecoder().raw_decode(rest.decode("utf-8", "replace"))
        except ValueError:
            return None  # cut short: the answer ended (or the client left) mid-object
        return _tokens(found)
    return None


def _tokens(usage: Any) -> Tokens | None:
    if not isinstance(usage, dict):
        return None
    # Chat and text completions, embeddings: prompt/completion; the Responses API: input/output.
    prompt = _count(usage.get("prompt_tokens", usage.get("input_tokens")))
    completion = _count(usage.get("completion_tokens", usage.get("output_tokens")))
    if prompt is None and completion is None:
        return None
    return Tokens(prompt or 0, completion or 0)


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**53 else None


class Meter:
    """Watches one answer's bytes on their way to the client; ``tokens`` is known once it has ended.

    ``take_usage_event``: the request was sent with ``include_usage`` that the client did not ask
    for, so the stream's usage event is read and not passed on.
    """

    @staticmethod
    def readable(headers: Mapping[str, str]) -> bool:
        """The answer's bytes are its text (the engine did not compress them)."""
        return headers.get("content-encoding", "identity") == "identity"

    def __init__(self, take_usage_event: bool = False) -> None:
        self.take_usage_event = take_usage_event
        self.tokens: Tokens | None = None
        self._tail: deque[bytes] = deque()
        self._tail_size = 0

    async def watch(self, chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        if self.take_usage_event:
            async for out in self._without_usage_event(chunks):
                yield out
            return
        async for chunk in chunks:
            self._keep(chunk)
            yield chunk
        self.tokens = usage_of(b"".join(self._tail))

    def _keep(self, chunk: bytes) -> None:
        self._tail.append(chunk)
        self._tail_size += len(chunk)
        while len(self._tail) > 1 and self._tail_size - len(self._tail[0]) >= TAIL_BYTES:
            self._tail_size -= len(self._tail.popleft())

    async def _without_usage_event(self, chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        # Whole events only pass on (a client reads nothing of an event before its end anyway).
        pending = b""
        async for chunk in chunks:
            pending += chunk
            cut = pending.rfind(EVENT_END)
            if cut < 0:
                if len(pending) > TAIL_BYTES:  # not the events expected: pass it on as it is
                    yield pending
                    pending = b""
                continue
            whole, pending = pending[: cut + len(EVENT_END)], pending[cut + len(EVENT_END) :]
            if USAGE in whole:
                whole = self._take_out(whole)
            if whole:
                yield whole
        if pending:
            yield self._take_out(pending) if USAGE in pending else pending

    def _take_out(self, block: bytes) -> bytes:
        """``block`` without its usage event (read into ``tokens``), byte for byte otherwise."""
        events = block.split(EVENT_END)
        rest = events.pop()  # after the last blank line: empty, unless the stream ended mid-event
        kept = [event + EVENT_END for event in events if not self._is_usage_event(event)]
        if rest and not self._is_usage_event(rest):
            kept.append(rest)
        return b"".join(kept)

    def _is_usage_event(self, event: bytes) -> bool:
        if USAGE not in event:
            return False
        data = b"".join(line[5:].strip() for line in event.split(b"\n") if line.startswith(b"data:"))
        try:
            chunk = json.loads(data)
        except ValueError:
            return False
        # vLLM's usage event: no choices, only the usage of the whole request.
        if not isinstance(chunk, dict) or chunk.get("choices") != [] or not isinstance(chunk.get("usage"), dict):
            return False
        self.tokens = _tokens(chunk["usage"])
        return True
