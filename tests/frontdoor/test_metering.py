"""Reading an answer's usage on its way to the client: the tokens found, and the client's bytes."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

from manager.frontdoor.metering import TAIL_BYTES, Meter, Tokens, stream_options_to_send, usage_of


def event(data: dict | str) -> bytes:
    text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {text}\n\n".encode()


def token(i: int) -> bytes:
    return event(
        {"id": "c", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": f"t{i}"}}]}
    )


USAGE_EVENT = event(
    {"id": "c", "object": "chat.completion.chunk", "choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3}}
)
DONE = event("[DONE]")


def run(meter: Meter, chunks: list[bytes]) -> bytes:
    async def source() -> AsyncIterator[bytes]:
        for chunk in chunks:
            yield chunk

    async def collect() -> bytes:
        return b"".join([c async for c in meter.watch(source())])

    return asyncio.run(collect())


def split_every(data: bytes, size: int) -> list[bytes]:
    return [data[i : i + size] for i in range(0, len(data), size)]


def test_usage_is_asked_for_only_on_streamed_completions_that_did_not_ask():
    chat = {"model": "a", "stream": True}
    assert stream_options_to_send("/v1/chat/completions", chat) == {"include_usage": True}
    assert stream_options_to_send("/v1/completions", chat) == {"include_usage": True}
    assert stream_options_to_send("/v1/chat/completions", {"model": "a"}) is None  # not streamed
    assert stream_options_to_send("/v1/embeddings", chat) is None
    asked = {**chat, "stream_options": {"include_usage": True}}
    assert stream_options_to_send("/v1/chat/completions", asked) is None
    declined = {**chat, "stream_options": {"include_usage": False, "continuous_usage_stats": True}}
    assert stream_options_to_send("/v1/chat/completions", declined) == {
        "include_usage": True,
        "continuous_usage_stats": False,
    }
    assert stream_options_to_send("/v1/chat/completions", {**chat, "stream_options": "yes"}) is None
    # Several choices: their last chunks would lose the fingerprint before the usage event came.
    assert stream_options_to_send("/v1/chat/completions", {**chat, "n": 2}) is None
    assert stream_options_to_send("/v1/completions", {**chat, "prompt": ["x", "y"]}) is None
    for one in ("x", ["x"], [1, 2, 3], [[1, 2, 3]]):
        assert stream_options_to_send("/v1/completions", {**chat, "prompt": one, "n": 1}) is not None


def test_usage_of_an_answer_reads_the_last_usage_object():
    body = json.dumps({"id": "x", "choices": [{"text": '"usage": {"prompt_tokens": 99}'}], "usage": {
        "prompt_tokens": 12, "completion_tokens": 5, "total_tokens": 17}}).encode()  # fmt: skip
    assert usage_of(body) == Tokens(12, 5)
    assert usage_of(b'{"data": [], "usage": {"prompt_tokens": 4, "total_tokens": 4}}') == Tokens(4, 0)  # embeddings
    responses = b'{"response": {"usage": {"input_tokens": 9, "output_tokens": 2}}}'  # the Responses API
    assert usage_of(responses) == Tokens(9, 2)
    assert usage_of(b'{"usage": null, "x": 1}') is None
    assert usage_of(b'{"usage": {"prompt_tokens": 4, "completion_tok') is None  # cut short
    assert usage_of(b'{"usage": {"prompt_tokens": -1, "completion_tokens": true}}') is None
    assert usage_of(b"no json at all") is None


def test_a_stream_that_asked_for_usage_passes_unchanged_and_is_counted():
    stream = b"".join([token(0), token(1), USAGE_EVENT, DONE])
    for size in (1, 7, 64, len(stream)):
        meter = Meter()
        assert run(meter, split_every(stream, size)) == stream
        assert meter.tokens == Tokens(7, 3)


def test_the_usage_event_the_client_did_not_ask_for_is_taken_out_however_the_bytes_are_cut():
    asked = b"".join([token(0), token(1), USAGE_EVENT, DONE])
    wanted = b"".join([token(0), token(1), DONE])
    for size in (1, 5, 13, 100, len(asked)):
        meter = Meter(take_usage_event=True)
        assert run(meter, split_every(asked, size)) == wanted, size
        assert meter.tokens == Tokens(7, 3)


def last_token(fingerprint: bool) -> bytes:
    chunk: dict = {"id": "c", "choices": [{"index": 0, "delta": {"content": "!"}, "finish_reason": "stop"}]}
    if fingerprint:
        chunk["system_fingerprint"] = "fp-1"
    return event(chunk)


def test_the_fingerprint_goes_back_on_the_last_chunk_as_the_engine_writes_it_unasked():
    usage_with_fingerprint = event(
        {"id": "c", "choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 2}, "system_fingerprint": "fp-1"}
    )
    asked = b"".join([token(0), last_token(fingerprint=False), usage_with_fingerprint, DONE])
    unasked = b"".join([token(0), last_token(fingerprint=True), DONE])
    for size in (1, 9, 64, len(asked)):
        meter = Meter(take_usage_event=True)
        assert run(meter, split_every(asked, size)) == unasked, size
        assert meter.tokens == Tokens(1, 2)
    # No usage event after it (an engine that does not write one): the last chunk goes out as it came.
    plain = b"".join([token(0), last_token(fingerprint=False), DONE])
    assert run(Meter(take_usage_event=True), split_every(plain, 7)) == plain
    cut = token(0) + last_token(fingerprint=False)
    assert run(Meter(take_usage_event=True), [cut]) == cut


def test_taking_out_keeps_events_that_only_mention_usage():
    text = event({"id": "c", "choices": [{"index": 0, "delta": {"content": "usage"}}], "usage": None})
    stream = text + DONE
    meter = Meter(take_usage_event=True)
    assert run(meter, [stream]) == stream and meter.tokens is None


def test_a_stream_cut_before_its_usage_has_no_tokens():
    meter = Meter(take_usage_event=True)
    assert run(meter, [token(0), token(1)[:10]]) == token(0) + token(1)[:10]
    assert meter.tokens is None


def test_the_usage_at_the_end_of_a_long_answer_is_found():
    meter = Meter()
    chunks = [b"x" * 1000] * 500 + [b'{"usage": {"prompt_tokens": 1, "completion_tokens": 2}}']
    assert run(meter, chunks) == b"".join(chunks)
    assert meter.tokens == Tokens(1, 2)


def test_bytes_that_are_not_events_pass_on_whole():
    meter = Meter(take_usage_event=True)
    blob = [b"y" * 4096] * ((TAIL_BYTES // 4096) + 4)
    assert run(meter, blob) == b"".join(blob)
