"""The optional compiled modules (host Adam, aio): imported when built, else None and why."""

from __future__ import annotations

import importlib
from types import ModuleType


def load_optional(name: str) -> tuple[ModuleType | None, str | None]:
    """``(module, None)``, or ``(None, reason)`` when ``name`` cannot be imported (not built, or
    an OSError from a broken .so). import_module, not ``from zero_offload import ...``: a missing
    module reports "No module named ...", also while zero_offload/__init__.py is initialising."""
    try:
        return importlib.import_module(name), None
    except Exception as exc:  # ImportError, or an OSError from a broken .so
        return None, f"{type(exc).__name__}: {exc}"
