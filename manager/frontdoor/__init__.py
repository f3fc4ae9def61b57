"""The front door: one OpenAI-compatible endpoint (/v1) where a request's "model" picks the worker.

Library rooms, no FastAPI: ``names`` (which config a request names, and the /v1/models listing),
``scheduler`` (serve now, join a start under way, or make room and start, as ``manager.placement``
decides; idle unload) and ``proxy`` (forwarding to the engine,
streams chunk by chunk). ``manager/routes/v1.py`` only translates HTTP to these.
"""
