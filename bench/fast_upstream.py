"""A minimal, fast OpenAI-shaped server that the manager starts as if it were a vLLM worker.

It exists to isolate the proxy: it answers in tens of microseconds, so what a client sees through the
manager's /v1 on top of calling it directly is the manager's own cost. It takes vLLM's command line
(``-m vllm.entrypoints.openai.api_server --model M --served-model-name S --port P ...``, ignoring the
rest) and answers:

- ``POST /v1/completions`` and ``/v1/chat/completions``: a fixed answer; with ``"stream": true``,
  one SSE chunk per token (``max_tokens``, default 16): the first at once, then one every
  ``UPSTREAM_CHUNK_GAP_S`` seconds (default 0.005), then ``[DONE]``. Each chunk's text ends with
  ``@<unix time it was written>``, so a client on the same host can tell how long the chunk took to
  reach it, whoever stands in between;
- ``GET /health``, ``GET /v1/models``, and ``GET /metrics`` with vLLM's metric names.

A raw ASGI app under uvicorn (uvloop and httptools when installed), no framework, no access log.
``engine_python(path)`` writes the interpreter script a manager's ``VLLM_MANAGER_ENGINE_PYTHON``
points at, as the front door's tests do with their stand-in engine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

THIS = Path(__file__).resolve()


def engine_python(path: Path) -> str:
    """An "engine interpreter" that runs this server whatever module it is asked to run.

    A Python script rather than a shell one: its command line stays the same from spawn to exit, so
    the manager recognises the process as its own."""
    path.write_text(
        f"#!{sys.executable}\nimport runpy, sys\nsys.argv[0] = {str(THIS)!r}\n"
        f"runpy.run_path({str(THIS)!r}, run_name='__main__')\n"
    )
    path.chmod(0o755)
    return str(path)


JSON = [(b"content-type", b"application/json")]
SSE = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]


class Upstream:
    def __init__(self, served: str, root: str, gap_s: float) -> None:
        self.served = served
        self.root = root
        self.gap_s = gap_s
        self.running = 0
        self.finished = 0
        self.models = json.dumps(
            {"object": "list", "data": [{"id": served, "object": "model", "root": root, "parent": None}]}
        ).encode()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        path, method = scope["path"], scope["method"]
        if method == "POST" and path in ("/v1/completions", "/v1/chat/completions"):
            await self.generate(path.endswith("chat/completions"), await _body(receive), send)
        elif path == "/health":
            await _answer(send, 200, b"", [])
        elif path == "/v1/models":
            await _answer(send, 200, self.models, JSON)
        elif path == "/metrics":
            await _answer(send, 200, self.metrics(), [(b"content-type", b"text/plain; version=0.0.4")])
        else:
            await _answer(send, 404, b'{"detail":"Not Found"}', JSON)

    def metrics(self) -> bytes:
        labels = f'engine="0",model_name="{self.served}"'
        return (
            "# TYPE vllm:num_requests_running gauge\n"
            f"vllm:num_requests_running{{{labels}}} {float(self.running)}\n"
            "# TYPE vllm:num_requests_waiting gauge\n"
            f"vllm:num_requests_waiting{{{labels}}} 0.0\n"
            "# TYPE vllm:kv_cache_usage_perc gauge\n"
            f"vllm:kv_cache_usage_perc{{{labels}}} 0.0\n"
            "# TYPE vllm:request_success_total counter\n"
            f'vllm:request_success_total{{{labels},finished_reason="length"}} {float(self.finished)}\n'
        ).encode()

    async def generate(self, chat: bool, raw: bytes, send: Any) -> None:
        try:
            body = json.loads(raw)
        except ValueError:
            await _answer(send, 400, b'{"error":{"message":"the body is not JSON"}}', JSON)
            return
        model = body.get("model")
        if model != self.served:
            message = {"error": {"message": f"The model `{model}` does not exist.", "code": 404}}
            await _answer(send, 404, json.dumps(message).encode(), JSON)
            return
        tokens = int(body.get("max_tokens") or body.get("max_completion_tokens") or 16)
        self.running += 1
        try:
            if body.get("stream"):
                await self.stream(chat, model, tokens, send)
            else:
                await _answer(send, 200, json.dumps(_whole(chat, model, tokens)).encode(), JSON)
        finally:
            self.running -= 1
            self.finished += 1

    async def stream(self, chat: bool, model: str, tokens: int, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": SSE})
        for i in range(tokens):
            if i:
                await asyncio.sleep(self.gap_s)
            text = f"t{i}@{time.time():.6f} "
            choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
            chunk = {
                "id": "cmpl-bench",
                "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()),
                "model": model,
                "choices": [{**choice, "finish_reason": None if i < tokens - 1 else "length"}],
            }
            await send(
                {
                    "type": "http.response.body",
                    "body": b"data: " + json.dumps(chunk).encode() + b"\n\n",
                    "more_body": True,
                }
            )
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})


def _whole(chat: bool, model: str, tokens: int) -> dict:
    text = " ".join(f"t{i}" for i in range(tokens))
    choice = {"index": 0, "message": {"role": "assistant", "content": text}} if chat else {"index": 0, "text": text}
    return {
        "id": "cmpl-bench",
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{**choice, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 2, "completion_tokens": tokens, "total_tokens": tokens + 2},
    }


async def _body(receive: Any) -> bytes:
    parts = []
    while True:
        message = await receive()
        parts.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(parts)


async def _answer(send: Any, status: int, body: bytes, headers: list) -> None:
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def main(argv: list[str]) -> None:
    import uvicorn

    parser = argparse.ArgumentParser()
    parser.add_argument("-m")
    parser.add_argument("--model", required=True)
    parser.add_argument("--served-model-name")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args, _ = parser.parse_known_args(argv)
    app = Upstream(
        args.served_model_name or args.model, args.model, float(os.environ.get("UPSTREAM_CHUNK_GAP_S", "0.005"))
    )
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", access_log=False, lifespan="on")


if __name__ == "__main__":
    main(sys.argv[1:])
