"""A model's max_concurrent through the whole manager on a real port, with a stand-in engine: a request
beyond it waits, a key with too many waiting gets 429 and one that waits too long 504, in OpenAI's shape."""

from __future__ import annotations

import asyncio

import httpx

from manager.app import create_app
from tests.frontdoor.conftest import served

SLOW = {"STAND_IN_TOKEN_S": "0.1"}  # a stream of 20 tokens holds its place for about 2 s


def test_requests_beyond_max_concurrent_wait_and_are_refused_in_openais_shape(door_settings):
    settings = door_settings.model_copy(update={"queue_timeout_s": 0.5, "max_queue_per_key": 1})
    with served(create_app(settings)) as url:
        body = {"name": "a", "model": "org/a", "gpu_ids": [0], "max_concurrent": 1, "env": SLOW}
        assert httpx.post(f"{url}/api/models", json=body).status_code == 201
        secrets = [httpx.post(f"{url}/api/keys", json={"name": name}).json()["key"] for name in ("big", "small")]

        async def ask(http: httpx.AsyncClient, secret: str, tokens: int) -> httpx.Response:
            return await http.post(
                f"{url}/v1/completions",
                json={"model": "a", "prompt": "hi", "max_tokens": tokens, "stream": True},
                headers={"Authorization": f"Bearer {secret}"},
            )

        async def body_of_test() -> None:
            async with httpx.AsyncClient(timeout=60) as http:
                assert (await ask(http, secrets[0], 1)).status_code == 200  # started, and free again
                holding = asyncio.create_task(ask(http, secrets[0], 20))
                await asyncio.sleep(0.5)
                waiting = asyncio.create_task(ask(http, secrets[1], 1))
                await asyncio.sleep(0.1)
                # The small key has one request waiting already: its limit per key.
                full = await ask(http, secrets[1], 1)
                assert full.status_code == 429 and full.headers["retry-after"]
                assert full.json()["error"]["code"] == "queue_full" and "limit per key is 1" in full.text
                late = await waiting
                assert late.status_code == 504, late.text
                error = late.json()["error"]
                assert set(error) == {"message", "type", "param", "code"} and error["code"] == "queue_timeout"
                assert (await holding).status_code == 200
                assert (await ask(http, secrets[1], 1)).status_code == 200

        asyncio.run(asyncio.wait_for(body_of_test(), 60))
