"""What an engine's answer says it used (its ``usage``), read as the answer passes, not after it.

A non-streamed answer carries ``usage`` near its end (vLLM writes it after the choices); a stream
carries it in its last event before ``[DONE]``, but only when the request asked for it
(``stream_options.include_usage``). The front door asks for it on streamed chat and text completions
of one choice; when the client had not, that event is taken out again, and what asking changed in
the stream before it is undone, so the client receives exactly the stream it asked for. (Asking
moves vLLM's ``system_fingerprint`` from the choice's last chunk to the usage event: it is put back.)

Cheap by design: only the last ``TAIL_BYTES`` of an answer are kept and read as JSON once it has
ended. In a stream whose usage event must be taken out, each complete event is searched for the
bytes ``"usage"`` and ``"finish_reason":"`` (substring searches); only the usage event is parsed.
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
FINISHED = b'"finish_reason":"'  # in the chunk that ends a choice (in the others it is null)
FINGERPRINT = b'"system_fingerprint"'
EVENT_END = b"\n\n"  # vLLM ends each Server-Sent Event with a blank line


@dataclass(frozen=True)
class Tokens:
    prompt: int
    completion: int


def stream_options_to_send(path: str, payload: dict[str, Any]) -> dict[str, Any] | None:
    """The ``stream_options`` that make a streamed completion end with its usage, when the client did
    not ask for it; None when the request is not such a stream, asks for usage already, or streams
    several choices (whose last chunks could not all get their fingerprint back in time)."""
    if path not in USAGE_PATHS or payload.get("stream") is not True or not _one_choice(payload):
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


def _one_choice(payload: dict[str, Any]) -> bool:
    if payload.get("n") not in (None, 1) or payload.get("use_beam_search") or "prompt_embeds" in payload:
        return False
    prompt = payload.get("prompt")  # text completions take several prompts, one choice each
    if isinstance(prompt, list) and prompt and not all(isinstance(t, int) for t in prompt):
        return len(prompt) == 1
    return True


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
    for, so the stream's usage event is read and not passed on, and the fingerprint it carries goes
    back on the choice's last chunk (held until the next event shows whether the usage event follows).
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
        self._held: bytes | None = None  # the choice's last chunk, until the next event
        self._fingerprint: str | None = None

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
                    yield self._release() + pending
                    pending = b""
                continue
            whole, pending = pending[: cut + len(EVENT_END)], pending[cut + len(EVENT_END) :]
            if self._held is not None or USAGE in whole or FINISHED in whole:
                whole = self._sorted(whole)
            if whole:
                yield whole
        # The stream ended (maybe mid-event): what is held goes out as it is.
        rest = self._sorted(pending) if pending else b""
        out = rest + self._release()
        if out:
            yield out

    def _sorted(self, block: bytes) -> bytes:
        """What of ``block`` goes out now: byte for byte, less the usage event and a held last chunk."""
        parts = block.split(EVENT_END)
        rest = parts.pop()  # after the last blank line: empty, unless the stream ended mid-event
        events = [part + EVENT_END for part in parts] + ([rest] if rest else [])
        return b"".join(self._pass(event) for event in events)

    def _pass(self, event: bytes) -> bytes:
        if self._held is not None:
            held, self._held = self._held, None
            if self._is_usage_event(event):
                return self._with_fingerprint(held)
            return held + self._pass(event)
        if self._is_usage_event(event):
            return b""
        if FINISHED in event:
            self._held = event
            return b""
        return event

    def _release(self) -> bytes:
        held, self._held = self._held, None
        return held or b""

    def _with_fingerprint(self, event: bytes) -> bytes:
        """The chunk as vLLM writes it when no usage event follows: its fingerprint as the last field."""
        if self._fingerprint is None or FINGERPRINT in event:
            return event
        text = event.rstrip(b"\r\n")
        if not text.endswith(b"}"):
            return event
        field = b',"system_fingerprint":' + json.dumps(self._fingerprint, ensure_ascii=False).encode()
        return text[:-1] + field + b"}" + event[len(text) :]

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
        fingerprint = chunk.get("system_fingerprint")
        self._fingerprint = fingerprint if isinstance(fingerprint, str) else None
        return True
