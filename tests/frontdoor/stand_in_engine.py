"""A stand-in for a vLLM OpenAI server, started by the manager as if it were one (no model, no torch).

It takes vLLM's command line (``-m vllm.entrypoints.openai.api_server --model M --served-model-name S
--port P ...``, ignoring what it does not need) and answers the endpoints the front door uses the way
vLLM 0.32 does: /health, /v1/models (adapters with their parent), the OpenAI routes (SSE when
``stream`` is true, one compact JSON chunk per token, the last one with its finish reason and vLLM's
system fingerprint, or, when ``stream_options.include_usage`` is on, the fingerprint on one more chunk
with the usage), the runtime LoRA endpoints, and /metrics with
``vllm:num_requests_running``, and sleep mode (with VLLM_SERVER_DEV_MODE=1: /sleep, /wake_up,
/is_sleeping, /collective_rpc; /sleep fails without --enable-sleep-mode; after a level-2 sleep the
weights must be reloaded before the model answers sensibly). Every answer echoes what the engine
received, and every path it was asked for is kept (GET /stand-in/seen), so tests can check what the
proxy and the manager sent.

With an API key (``--api-key`` or, without that flag, VLLM_API_KEY, as vLLM 0.32 reads them), requests
under /v1 without ``Authorization: Bearer <key>`` get vLLM's 401; /health, /metrics and the dev
endpoints stay open, as in vLLM.

Environment: STAND_IN_START_S (seconds before it listens), STAND_IN_FAIL (print this and exit 1,
as vLLM does on a bad config), STAND_IN_TOKEN_S (delay between streamed tokens).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import AsyncIterator

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

FINGERPRINT = "fp-stand-in"


def build(served: str, root: str, sleep_mode: bool = False, api_key: str | None = None) -> ASGIApp:
    token_s = float(os.environ.get("STAND_IN_TOKEN_S", "0.02"))
    # sleeping: the level, or 0 awake; asleep: the memory (tags) not yet taken back
    state: dict = {"running": 0, "seen": [], "adapters": {}, "sleeping": 0, "asleep": set(), "weights_ok": True}

    async def health(_: Request) -> Response:
        return Response(status_code=200)

    async def models(_: Request) -> Response:
        data = [{"id": served, "object": "model", "root": root, "parent": None}]
        data += [{"id": n, "object": "model", "root": p, "parent": served} for n, p in state["adapters"].items()]
        return JSONResponse({"object": "list", "data": data})

    def known(model: str) -> bool:
        return model == served or model in state["adapters"]

    def missing(model: str) -> Response:
        body = {"error": {"message": f"The model `{model}` does not exist.", "type": "NotFoundError", "code": 404}}
        return JSONResponse(body, status_code=404)

    def unusable() -> Response | None:
        if state["asleep"]:
            return JSONResponse({"error": {"message": "the engine is sleeping"}}, status_code=500)
        if not state["weights_ok"]:
            return JSONResponse({"error": {"message": "weights were discarded and not reloaded"}}, status_code=500)
        return None

    async def generate(request: Request) -> Response:
        body = await request.json()
        state["seen"].append(
            {"path": request.url.path, "model": body.get("model"), "stream_options": body.get("stream_options")}
        )
        if not known(body.get("model")):
            return missing(body.get("model"))
        refusal = unusable()
        if refusal is not None:
            return refusal
        tokens = int(body.get("max_tokens") or body.get("max_completion_tokens") or 4)
        chat = request.url.path.endswith("chat/completions")
        if not body.get("stream"):
            text = " ".join(f"t{i}" for i in range(tokens))
            choice = (
                {"index": 0, "message": {"role": "assistant", "content": text}} if chat else {"index": 0, "text": text}
            )
            return JSONResponse(
                {
                    "id": "cmpl-1",
                    "object": "chat.completion" if chat else "text_completion",
                    "created": int(time.time()),
                    "model": body["model"],
                    "choices": [{**choice, "finish_reason": "length"}],
                    "usage": {"prompt_tokens": 2, "completion_tokens": tokens, "total_tokens": tokens + 2},
                }
            )

        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        created = int(time.time())

        def sse(chunk: dict) -> bytes:
            return f"data: {json.dumps(chunk, separators=(',', ':'))}\n\n".encode()  # compact, as vLLM's pydantic

        async def events() -> AsyncIterator[bytes]:
            state["running"] += 1
            head = {"id": "cmpl-1", "object": "chat.completion.chunk" if chat else "text_completion",
                    "created": created, "model": body["model"]}  # fmt: skip
            try:
                for i in range(tokens):
                    await asyncio.sleep(token_s)
                    delta = {"delta": {"content": f"t{i} "}} if chat else {"text": f"t{i} "}
                    last = i == tokens - 1
                    chunk = {**head, "choices": [{"index": 0, **delta, "finish_reason": "length" if last else None}]}
                    if last and not include_usage:
                        chunk["system_fingerprint"] = FINGERPRINT  # as vLLM: on the last chunk ...
                    yield sse(chunk)
                if include_usage:
                    # ... or, when usage is asked for, on one more chunk without choices, with the usage.
                    usage = {"prompt_tokens": 2, "completion_tokens": tokens, "total_tokens": tokens + 2}
                    yield sse({**head, "choices": [], "usage": usage, "system_fingerprint": FINGERPRINT})
                yield b"data: [DONE]\n\n"
            finally:
                state["running"] -= 1

        return StreamingResponse(events(), media_type="text/event-stream")

    async def echo(request: Request) -> Response:
        body = await request.json()
        state["seen"].append({"path": request.url.path, "model": body.get("model")})
        if not known(body.get("model")):
            return missing(body.get("model"))
        refusal = unusable()
        if refusal is not None:
            return refusal
        return JSONResponse({"model": body.get("model"), "path": request.url.path, "received": body})

    async def transcribe(request: Request) -> Response:
        form = await request.form()
        upload = form.get("file")
        size = len(await upload.read()) if upload is not None and not isinstance(upload, str) else 0
        state["seen"].append({"path": request.url.path, "model": form.get("model")})
        return JSONResponse(
            {"text": f"{size} bytes heard", "model": form.get("model"), "language": form.get("language")}
        )

    async def load_lora(request: Request) -> Response:
        body = await request.json()
        state["seen"].append({"path": request.url.path, "model": body.get("lora_name")})
        if body["lora_name"] in state["adapters"]:
            return JSONResponse({"error": {"message": "The lora adapter has already been loaded."}}, status_code=400)
        state["adapters"][body["lora_name"]] = body["lora_path"]
        return PlainTextResponse("Success: LoRA adapter added successfully.")

    async def unload_lora(request: Request) -> Response:
        body = await request.json()
        state["seen"].append({"path": request.url.path, "model": body.get("lora_name")})
        if state["adapters"].pop(body["lora_name"], None) is None:
            message = f"The lora adapter '{body['lora_name']}' cannot be found."
            return JSONResponse({"error": {"message": message}}, status_code=404)
        return PlainTextResponse("Success: LoRA adapter removed successfully.")

    async def metrics(_: Request) -> Response:
        labels = f'engine="0",model_name="{served}"'
        return PlainTextResponse(
            "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
            "# TYPE vllm:num_requests_running gauge\n"
            f"vllm:num_requests_running{{{labels}}} {float(state['running'])}\n"
        )

    async def seen(_: Request) -> Response:
        return JSONResponse(state["seen"])

    async def sleep(request: Request) -> Response:
        level = int(request.query_params.get("level", "1"))
        state["seen"].append({"path": "/sleep", "model": None, "level": level})
        if not sleep_mode:
            return JSONResponse({"error": {"message": "Sleep mode is not enabled"}}, status_code=500)
        state["sleeping"], state["asleep"] = level, {"weights", "kv_cache"}
        if level >= 2:
            state["weights_ok"] = False
        return JSONResponse({"status": "sleeping", "level": level})

    async def wake_up(request: Request) -> Response:
        tags = request.query_params.getlist("tags") or ["weights", "kv_cache"]
        state["seen"].append({"path": "/wake_up", "model": None, "tags": tags})
        state["asleep"] -= set(tags)
        if not state["asleep"]:
            state["sleeping"] = 0
        return JSONResponse({"status": "sleeping" if state["asleep"] else "awake", "tags": tags})

    async def is_sleeping(_: Request) -> Response:
        return JSONResponse({"is_sleeping": bool(state["asleep"])})

    async def collective_rpc(request: Request) -> Response:
        body = await request.json()
        state["seen"].append({"path": "/collective_rpc", "model": None, "method": body.get("method")})
        if body.get("method") == "reload_weights":
            if "weights" in state["asleep"]:
                return JSONResponse({"error": {"message": "weights memory is not allocated"}}, status_code=500)
            state["weights_ok"] = True
        return JSONResponse({"results": [None]})

    routes = [
        Route("/health", health),
        Route("/v1/models", models),
        Route("/v1/chat/completions", generate, methods=["POST"]),
        Route("/v1/completions", generate, methods=["POST"]),
        Route("/v1/audio/transcriptions", transcribe, methods=["POST"]),
        Route("/v1/load_lora_adapter", load_lora, methods=["POST"]),
        Route("/v1/unload_lora_adapter", unload_lora, methods=["POST"]),
        Route("/metrics", metrics),
        Route("/stand-in/seen", seen),
    ]
    if os.environ.get("VLLM_SERVER_DEV_MODE") == "1":
        routes += [
            Route("/sleep", sleep, methods=["POST"]),
            Route("/wake_up", wake_up, methods=["POST"]),
            Route("/is_sleeping", is_sleeping),
            Route("/collective_rpc", collective_rpc, methods=["POST"]),
        ]
    for path in ("/v1/embeddings", "/v1/responses", "/v1/score", "/v1/rerank", "/tokenize", "/detokenize"):
        routes.append(Route(path, echo, methods=["POST"]))
    app = Starlette(routes=routes)
    if not api_key:
        return app

    async def guarded(scope: Scope, receive: Receive, send: Send) -> None:
        given = dict(scope.get("headers") or []).get(b"authorization")
        if scope["type"] == "http" and scope["path"].startswith("/v1") and given != f"Bearer {api_key}".encode():
            state["seen"].append({"path": scope["path"], "model": None, "refused": 401})
            await JSONResponse({"error": "Unauthorized"}, status_code=401)(scope, receive, send)
            return
        await app(scope, receive, send)

    return guarded


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("-m")
    parser.add_argument("--model", required=True)
    parser.add_argument("--served-model-name")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--enable-sleep-mode", action="store_true")
    parser.add_argument("--api-key", nargs="+")
    args, _ = parser.parse_known_args(argv)
    print(f"stand-in engine for {args.model} starting", flush=True)
    failure = os.environ.get("STAND_IN_FAIL")
    if failure:
        print(failure, flush=True)
        sys.exit(1)
    time.sleep(float(os.environ.get("STAND_IN_START_S", "0")))
    api_key = (args.api_key or [os.environ.get("VLLM_API_KEY")])[0]
    app = build(args.served_model_name or args.model, args.model, args.enable_sleep_mode, api_key)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main(sys.argv[1:])
