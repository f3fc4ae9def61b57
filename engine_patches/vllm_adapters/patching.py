"""Replace one attribute with a wrapper around it, once, remembering the original."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

MARK = "__engine_patches__"

# (owner, name) -> the original attribute as it sat in the owner's __dict__
_originals: dict[tuple[int, str], tuple[Any, Any]] = {}


def is_patched(owner: Any, name: str) -> bool:
    raw = owner.__dict__.get(name) if isinstance(owner, type) else getattr(owner, name, None)
    func = getattr(raw, "__func__", raw)
    return bool(getattr(func, MARK, False))


def wrap(owner: Any, name: str, make_wrapper: Callable[[Callable[..., Any]], Callable[..., Any]]) -> bool:
    """Set ``owner.name = make_wrapper(original)``; False when it was already patched.

    Works for module functions, methods, classmethods and staticmethods. The wrapper gets
    ``__wrapped__`` (vLLM's original function) so tests and readers can find what it delegates to.
    """
    if is_patched(owner, name):
        return False
    raw = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
    kind = type(raw) if isinstance(raw, (classmethod, staticmethod)) else None
    original = raw.__func__ if kind else raw
    wrapper = make_wrapper(original)
    functools.update_wrapper(wrapper, original)
    wrapper.__wrapped__ = original  # type: ignore[attr-defined]
    setattr(wrapper, MARK, True)
    _originals[(id(owner), name)] = (owner, raw)
    setattr(owner, name, kind(wrapper) if kind else wrapper)
    return True


def unwrap_all() -> None:
    """Put every original back (tests only)."""
    for (_, name), (owner, raw) in list(_originals.items()):
        setattr(owner, name, raw)
    _originals.clear()
