"""Thin adapters that patch vLLM 0.32 functions to use the torch-only core.

Each module has ``install(...)`` (idempotent) and imports vllm only when called. The functions
they replace keep a ``__wrapped__`` pointing at vLLM's original, which they call.
"""
