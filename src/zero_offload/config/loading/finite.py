"""Every number in a config must be finite and fit the machine types it reaches.

JSON reads ``1e999`` as infinity and a dict config can carry ``float("nan")``; either one, in a
learning rate or a scale, turns every weight into NaN at the first update with no message. The
typed fields reject non-finite values too, but some values reach the engine through looser
paths (per-group lists, sections that are accepted and ignored), so the whole raw config is
scanned once at load, naming every key that holds a non-finite number.
"""

from __future__ import annotations

import math
from typing import Any

from ..errors import join_path


def non_finite_numbers(raw: Any, path: str = "") -> list[str]:
    """One problem line per non-finite float anywhere in ``raw`` (dicts and lists walked)."""
    problems: list[str] = []
    if isinstance(raw, dict):
        for key, value in raw.items():
            problems.extend(non_finite_numbers(value, join_path(path, str(key))))
    elif isinstance(raw, list | tuple):
        for i, value in enumerate(raw):
            problems.extend(non_finite_numbers(value, f"{path}[{i}]"))
    elif isinstance(raw, float) and not math.isfinite(raw):
        shown = "NaN" if math.isnan(raw) else ("Infinity" if raw > 0 else "-Infinity")
        problems.append(
            f"{path or '<config>'}: expected a finite number, got {shown} "
            "(JSON reads an out-of-range literal such as 1e999 as infinity)"
        )
    return problems
