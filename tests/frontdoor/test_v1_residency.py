"""Two clients, each with its own model, both models on GPU 0, through the whole manager on a real port
with stand-in engines: with min_residency_s the models take turns in batches, without it every request
swaps; every request is answered either way."""

from __future__ import annotations

import asyncio

import httpx

from manager.app import create_app
from tests.frontdoor.conftest import served

REQUESTS = 4  # per client


def swaps_and_answers(url: str, min_residency_s: float) -> tuple[int, list[int]]:
    """Two models with this min_residency_s on GPU 0 (as well as any earlier ones), a client for each."""
    pair = (f"a{min_residency_s:g}", f"b{min_residency_s:g}")
    for name in pair:
        body = {"name": name, "model": f"org/{name}", "gpu_ids": [0], "min_residency_s": min_residency_s}
        assert httpx.post(f"{url}/api/models", json=body).status_code == 201

    refused: list[str] = []

    async def client(http: httpx.AsyncClient, model: str) -> list[int]:
        codes = []
        for _ in range(REQUESTS):  # each asks again as soon as it is answered
            resp = await http.post(
                f"{url}/v1/chat/completions",
                json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
            )
            codes.append(resp.status_code)
            if resp.status_code != 200:
                refused.append(f"{model}: {resp.text}")
        return codes

    async def both() -> list[int]:
        async with httpx.AsyncClient(timeout=60) as http:
            a, b = await asyncio.gather(*(client(http, name) for name in pair))
            return a + b

    codes = asyncio.run(asyncio.wait_for(both(), 120))
    assert not refused, refused
    events = httpx.get(f"{url}/api/events").json()
    swaps = sum(1 for e in events if e["kind"] == "swapped_in" and e["message"].split()[1] in pair)
    return swaps, codes


def test_a_residency_turns_a_swap_per_request_into_a_turn_per_batch(door_settings):
    with served(create_app(door_settings)) as url:
        thrashing, answered_without = swaps_and_answers(url, 0)
        batched, answered_with = swaps_and_answers(url, 30)
    assert answered_without == answered_with == [200] * (2 * REQUESTS)
    assert thrashing >= REQUESTS, (thrashing, batched)  # a swap for (nearly) every request
    assert batched == 2, (thrashing, batched)  # each model in once: its client's requests answered in one batch
    assert batched < thrashing
