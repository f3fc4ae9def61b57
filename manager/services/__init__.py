"""The store: model configs, offload profiles, API tokens, export and import; usable without FastAPI."""
