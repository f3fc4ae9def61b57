"""The front door: one OpenAI-compatible endpoint (/v1) where a request's "model" picks the worker.

Library rooms, no FastAPI: ``names`` (which config a request names, and the /v1/models listing),
``scheduler`` (serve now, join a start under way, or make room and start; requests that wait go in
``fair_queue``'s order), with ``room`` (which workers go for a start, as ``manager.placement``
decides), ``slots`` (each config's requests and last use), ``upkeep`` (idle unload, replica scaling) and ``placements`` (what it knows of each config), and
``proxy`` (forwarding to the engine, streams chunk by chunk), ``progress`` and ``loading`` (SSE comment
lines for a streamed request that waits for its model). ``manager/routes/v1.py`` only translates
HTTP to these.
"""
