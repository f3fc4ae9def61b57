"""Readiness and health of a vLLM server, through its own endpoints."""

from __future__ import annotations

from dataclasses import dataclass

import httpx

from manager.launch.engine_key import bearer


@dataclass(frozen=True)
class Probe:
    healthy: bool  # GET /health answered 200
    serves: bool  # GET /v1/models lists the served name
    detail: str


async def probe(
    client: httpx.AsyncClient, port: int, served_name: str, address: str = "127.0.0.1", key: str | None = None
) -> Probe:
    """``key``: the engine's API key, which its /v1/models asks for (its /health does not)."""
    base = f"http://{address}:{port}"
    try:
        health = await client.get(f"{base}/health", timeout=5)
    except httpx.TransportError as exc:
        # Refused while loading is normal: vLLM binds its port before it accepts connections.
        return Probe(False, False, f"/health: {type(exc).__name__}")
    if health.status_code != 200:
        return Probe(False, False, f"/health answered {health.status_code}")
    try:
        listing = await client.get(f"{base}/v1/models", headers=bearer(key), timeout=5)
        if listing.status_code == 401:
            return Probe(
                True, False, "/v1/models answered 401: the engine asks for an API key its config does not give"
            )
        names = {m.get("id") for m in listing.json().get("data", [])}
    except (httpx.HTTPError, ValueError) as exc:
        return Probe(True, False, f"/v1/models: {type(exc).__name__}")
    if served_name not in names:
        return Probe(True, False, f"/v1/models lists {sorted(n for n in names if n)}, not {served_name!r}")
    return Probe(True, True, "ready")
