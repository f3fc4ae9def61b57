"""/v1 on a real port with stand-in engines that take a few seconds to start: a load whose client left
is cancelled and the next request gets the GPU; a streamed request that asked for loading progress gets
SSE comment lines while it waits, then the model's answer (or an error event when the start fails)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from manager.app import create_app
from tests.frontdoor.conftest import served

START_S = 4.0  # each stand-in engine takes this long to listen


@pytest.fixture
def url(door_settings) -> Iterator[str]:
    with served(create_app(door_settings)) as address:
        yield address


def add_model(url: str, name: str, start_s: float = START_S, **fields: object) -> None:
    body = {"name": name, "model": f"org/{name}", "gpu_ids": [0], "start_timeout_s": 60, **fields}
    body["env"] = {"STAND_IN_START_S": str(start_s), **dict(fields.get("env") or {})}  # type: ignore[call-overload]
    answer = httpx.post(f"{url}/api/models", json=body)
    assert answer.status_code == 201, answer.text


def states(url: str) -> dict[str, str]:
    return {w["model"]: w["state"] for w in httpx.get(f"{url}/api/workers").json()}


def events(url: str) -> list[dict]:
    return httpx.get(f"{url}/api/events?limit=1000").json()


def wait_for(check, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def stream_lines(url: str, model: str, headers: dict[str, str] | None = None) -> tuple[int, list[str]]:
    """A streamed completion read raw: its status and every line, the comments included."""
    body = {"model": model, "prompt": "hi", "max_tokens": 3, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=headers or {}, timeout=60) as answer:
        return answer.status_code, [line for line in answer.iter_lines() if line]


ASKS = {"X-Loading-Progress": "1"}


# ---- a load nobody waits for ---------------------------------------------------------------------------
def test_a_start_whose_client_left_is_cancelled_and_the_waiting_request_for_another_model_starts(url):
    add_model(url, "a", start_s=60)  # a and b share GPU 0
    add_model(url, "b", start_s=0)
    completion = {"prompt": "hi", "max_tokens": 2}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up during a's start and disconnects
        httpx.post(f"{url}/v1/completions", json={"model": "a", **completion}, timeout=1.5)
    wait_for(lambda: states(url).get("a") == "stopped", 10, "the start of a nobody waits for was not cancelled")
    cancelled = [e for e in events(url) if e["kind"] == "cancelled"]
    assert [e["message"] for e in cancelled] == ["start of a cancelled: no request waits for it any more"]
    answer = httpx.post(f"{url}/v1/completions", json={"model": "b", **completion}, timeout=30)
    assert answer.status_code == 200, answer.text
    assert states(url) == {"a": "stopped", "b": "ready"}


def test_a_request_for_another_model_that_waited_gets_the_gpu_once_the_client_left(url):
    add_model(url, "a", start_s=60)
    add_model(url, "b", start_s=0)
    completion = {"prompt": "hi", "max_tokens": 2}
    for_b: dict[str, httpx.Response] = {}

    def ask_b() -> None:
        for_b["answer"] = httpx.post(f"{url}/v1/completions", json={"model": "b", **completion}, timeout=30)

    with pytest.raises(httpx.ReadTimeout):
        waiting = threading.Thread(target=ask_b)
        # b's request comes while a starts for its client: it waits for a (GPU 0 is a's).
        threading.Timer(0.5, waiting.start).start()
        httpx.post(f"{url}/v1/completions", json={"model": "a", **completion}, timeout=2.0)
    waiting.join(30)
    assert for_b["answer"].status_code == 200, for_b["answer"].text
    assert states(url) == {"a": "stopped", "b": "ready"}


# ---- loading progress --------------------------------------------------------------------------------
def test_a_raw_stream_that_asks_sees_loading_comments_before_the_first_chunk(url):
    add_model(url, "a")
    status, lines = stream_lines(url, "a", ASKS)
    assert status == 200
    first_data = next(i for i, line in enumerate(lines) if line.startswith("data:"))
    comments = lines[:first_data]
    assert comments and all(line.startswith(": starting a, ") and line.endswith(" s") for line in comments), lines
    assert len(comments) <= 1 + START_S / 3 + 1  # one at once, then one every few seconds
    assert lines[-1] == "data: [DONE]" and not [line for line in lines[first_data:] if line.startswith(":")]

    # Its start is measured now: the next start says how far it is against that time, below 100 %.
    workers = httpx.get(f"{url}/api/workers").json()
    assert httpx.post(f"{url}/api/workers/{workers[0]['id']}/stop").status_code == 200
    wait_for(lambda: states(url)["a"] == "stopped", 30, "a did not stop")
    _, again = stream_lines(url, "a", ASKS)
    shares = [int(line.split()[-2]) for line in again if line.startswith(": loading a ")]
    assert shares and all(0 <= share <= 99 for share in shares), again


def test_the_openai_client_streams_the_answer_while_comments_were_sent(url):
    add_model(url, "a", loading_progress=True)  # on for the config: no header needed
    raw: list[bytes] = []

    def keep(response: httpx.Response) -> None:
        raw.append(response.read())

    http = httpx.Client(event_hooks={"response": [keep]}, timeout=60)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, http_client=http)
    stream = client.completions.create(model="a", prompt="hello", max_tokens=3, stream=True)
    texts = [choice.text for chunk in stream for choice in chunk.choices]
    assert len([t for t in texts if t]) == 3
    assert b"\n: starting a, " in b"\n" + raw[0]


def _starts_with_comments(lines: list[str], saying: str) -> bool:
    """Comment lines come before the first chunk, and one of them says this (the first may say the
    request waits for the model before it: the model it replaces may be held by its residency)."""
    comments = [line for line in lines if line.startswith(":")]
    first_data = next(i for i, line in enumerate(lines) if line.startswith("data:"))
    return (
        bool(comments)
        and lines[: len(comments)] == comments
        and first_data == len(comments)
        and any(c.startswith(saying) for c in comments)
    )


def test_only_a_stream_that_asks_gets_comments(url):
    add_model(url, "a")
    add_model(url, "b")
    status, lines = stream_lines(url, "a")  # today's stream, byte for byte: no comment
    assert status == 200 and lines[0].startswith("data:") and not [line for line in lines if line.startswith(":")]
    _, lines = stream_lines(url, "b", ASKS)
    assert _starts_with_comments(lines, ": starting b, ")


def test_a_request_may_turn_off_what_its_config_turned_on(url):
    add_model(url, "a", loading_progress=True)
    add_model(url, "b", loading_progress=True)
    _, lines = stream_lines(url, "a", {"X-Loading-Progress": "0"})
    assert lines[0].startswith("data:") and not [line for line in lines if line.startswith(":")]
    _, lines = stream_lines(url, "b")
    assert _starts_with_comments(lines, ": starting b, ")


def test_a_start_that_fails_after_the_stream_began_ends_it_with_an_error_event(url):
    add_model(url, "a", start_s=60, start_timeout_s=3)
    status, lines = stream_lines(url, "a", ASKS)
    assert status == 200
    assert lines[0].startswith(": starting a, ")
    assert lines[-1].startswith("data: ")
    error = json.loads(lines[-1].removeprefix("data: "))["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == "model_start_timeout"

    # The official client raises it as the stream's error (not as an HTTP status: that was 200).
    add_model(url, "b", start_s=60, start_timeout_s=3)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
    with pytest.raises(openai.APIError, match="start_timeout_s|start timeout") as raised:
        list(client.completions.create(model="b", prompt="hi", max_tokens=1, stream=True, extra_headers=ASKS))
    assert not isinstance(raised.value, openai.APIStatusError)


def test_the_openapi_document_declares_the_header_on_the_json_endpoints_with_exactly_the_values_it_takes(door):
    paths = door.get("/openapi.json").json()["paths"]
    chat = paths["/v1/chat/completions"]["post"]
    assert [p["name"] for p in chat.get("parameters", [])] == ["X-Loading-Progress"]
    assert not paths["/v1/audio/transcriptions"]["post"].get("parameters")
    declared = chat["parameters"][0]["schema"]["enum"]
    assert declared == ["1", "true", "0", "false"]
    assert "X-Loading-Progress is not one of 1, true, 0, false" in chat["responses"]["400"]["description"]
    for value in declared:  # each is taken: a request that does not stream is answered as without it
        answer = door.post(
            "/v1/completions", json={"model": "a", "prompt": "hi"}, headers={"X-Loading-Progress": value}
        )
        assert answer.status_code == 200, (value, answer.text)


def test_a_value_the_header_does_not_take_is_refused_before_any_worker_starts(door):
    for value in ("maybe", "", "2", "yes", "True"):
        for stream in (True, False):
            body = {"model": "a", "prompt": "hi", "stream": stream}
            answer = door.post("/v1/completions", json=body, headers={"X-Loading-Progress": value})
            assert answer.status_code == 400, (value, answer.text)
            error = answer.json()["error"]
            assert error["message"].startswith(f"X-Loading-Progress: {value!r} is not a value it takes; "), error
            assert "1 or true" in error["message"] and "0 or false" in error["message"], error
            assert (error["type"], error["param"]) == ("invalid_request_error", "X-Loading-Progress")
    assert door.get("/api/workers").json() == []
