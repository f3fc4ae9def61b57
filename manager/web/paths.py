"""Where the templates and static files are: inside an installed wheel or in the source tree.

The wheel force-includes the top-level ``templates/`` and ``static/`` as ``manager/_web/``; an
editable install (or a plain checkout on PYTHONPATH) reads them from the repository root.
"""

from __future__ import annotations

from pathlib import Path

import manager

_PACKAGE = Path(manager.__file__).resolve().parent


def _find(name: str) -> Path:
    for candidate in (_PACKAGE / "_web" / name, _PACKAGE.parent / name):
        if candidate.is_dir():
            return candidate
    raise RuntimeError(
        f"the dashboard's {name}/ folder is missing: looked in {_PACKAGE / '_web' / name} (wheel) "
        f"and {_PACKAGE.parent / name} (source tree); reinstall vllm-manager"
    )


def templates_dir() -> Path:
    return _find("templates")


def static_dir() -> Path:
    return _find("static")
