"""The arithmetic and the table of ``pcie_bandwidth.py``, apart from CUDA so they test on a CPU.

A transfer kind is a direction and a kind of host memory (``h2d_pinned``, ``d2h_pinned``,
``h2d_pageable``, ``d2h_pageable``) or both directions at once on two streams from pinned memory
(``bidir_pinned``: its time is the later of the two copies' ends, its bytes both copies').
``measure`` runs a timing function over sizes and kinds and keeps every repeat; ``summarize``
turns the repeats into median seconds and GB/s (10^9 bytes per second).
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Callable, Iterable
from typing import Any

KINDS = ("h2d_pinned", "d2h_pinned", "h2d_pageable", "d2h_pageable", "bidir_pinned")
HEADERS = {
    "h2d_pinned": "H2D pinned",
    "d2h_pinned": "D2H pinned",
    "h2d_pageable": "H2D pageable",
    "d2h_pageable": "D2H pageable",
    "bidir_pinned": "both ways pinned (sum)",
}

_UNITS = {
    "": 1,
    "b": 1,
    "k": 2**10,
    "kib": 2**10,
    "m": 2**20,
    "mib": 2**20,
    "g": 2**30,
    "gib": 2**30,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
}


def parse_size(text: str) -> int:
    """Bytes from "1MiB", "64K", "1GiB", "2G" (K/M/G and KiB/MiB/GiB: powers of 1024), "10MB"
    (KB/MB/GB: powers of 1000) or a plain number of bytes; case-insensitive."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise ValueError(f"not a size: {text!r} (e.g. 4096, 64KiB, 1MiB, 1GiB, 10MB)")
    n = float(m.group(1)) * _UNITS[unit]
    if n < 1 or n != int(n):
        raise ValueError(f"a size must be a whole number of bytes >= 1, got {text!r}")
    return int(n)


def format_size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


def size_range(lo: int, hi: int) -> list[int]:
    """lo, 2 lo, 4 lo, ... up to hi (hi itself included even when not lo times a power of 2)."""
    if lo < 1 or hi < lo:
        raise ValueError(f"sizes need 1 <= min <= max, got {lo} and {hi}")
    out, n = [], lo
    while n <= hi:
        out.append(n)
        n *= 2
    if out[-1] != hi:
        out.append(hi)
    return out


def gbps(nbytes: float, seconds: float) -> float:
    """Decimal GB/s."""
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


def moved_bytes(kind: str, size: int) -> int:
    """Bytes one transfer of ``kind`` moves: both directions count for ``bidir``."""
    return 2 * size if kind.startswith("bidir") else size


def measure(
    sizes: Iterable[int], kinds: Iterable[str], time_fn: Callable[[str, int], list[float]]
) -> dict[str, dict[int, list[float]]]:
    """``time_fn(kind, size)`` -> seconds of each repeat, for every kind and size."""
    kinds = list(kinds)
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        raise ValueError(f"unknown transfer kinds {unknown}; choose from {KINDS}")
    return {kind: {size: list(time_fn(kind, size)) for size in sizes} for kind in kinds}


def summarize(raw: dict[str, dict[int, list[float]]]) -> dict[str, Any]:
    """Median seconds and GB/s per kind and size, and each kind's peak (the best median)."""
    out: dict[str, Any] = {"kinds": {}, "peak_gbps": {}}
    for kind, by_size in raw.items():
        rows = {}
        for size, times in by_size.items():
            med = statistics.median(times)
            rows[size] = {
                "bytes": moved_bytes(kind, size),
                "median_s": med,
                "gbps": gbps(moved_bytes(kind, size), med),
                "repeats": len(times),
                "min_s": min(times),
                "max_s": max(times),
            }
        out["kinds"][kind] = rows
        out["peak_gbps"][kind] = max((r["gbps"] for r in rows.values()), default=None)
    return out


def table(summary: dict[str, Any]) -> str:
    """Markdown: one row per size, one GB/s column per kind, and a last row of peaks."""
    kinds = list(summary["kinds"])
    sizes = sorted({s for rows in summary["kinds"].values() for s in rows})
    lines = [
        "| size | " + " | ".join(f"{HEADERS[k]} GB/s" for k in kinds) + " |",
        "|---|" + "---|" * len(kinds),
    ]
    for size in sizes:
        cells = []
        for k in kinds:
            r = summary["kinds"][k].get(size)
            cells.append("-" if r is None else f"{r['gbps']:.1f}")
        lines.append(f"| {format_size(size)} | " + " | ".join(cells) + " |")
    peaks = [summary["peak_gbps"][k] for k in kinds]
    lines.append(
        "| **peak** | " + " | ".join("-" if p is None else f"**{p:.1f}**" for p in peaks) + " |"
    )
    return "\n".join(lines)
