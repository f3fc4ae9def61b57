"""LoRA management: a registry of adapters, checked on entry, loaded into running workers.

Plain library (no FastAPI): ``registry`` stores adapters, ``checks`` validates one against a model
config, ``engine_api`` talks to a worker's vLLM runtime LoRA endpoints, ``workers`` loads,
unloads and lists on a worker, ``pin_keeper`` re-loads pinned adapters after a worker restarts.
"""
