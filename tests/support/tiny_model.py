"""Tiny local models for tests; the maker lives in the package so the CPU demo image can use it too."""

from manager.tiny_model import ensure_tiny_llama, make_tiny_llama, make_tiny_qwen3_moe

__all__ = ["ensure_tiny_llama", "make_tiny_llama", "make_tiny_qwen3_moe"]
