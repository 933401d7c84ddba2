"""What a timeline of ``trace.py`` says: per phase of each training step (from one mark to the
next), how long the disk was busy (at least one request in flight), how long idle, the longest
idle gap, the bytes read and written by the requests submitted in it, and how long threads
waited for unfinished requests, per swap folder (optimizer/, param/): the I/O that held the
step up."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Phase:
    name: str
    start: float
    end: float
    busy: float = 0.0  # seconds with at least one request in flight
    reading: float = 0.0  # seconds with at least one read in flight
    writing: float = 0.0
    longest_gap: float = 0.0  # the longest stretch with nothing in flight
    read_bytes: int = 0
    write_bytes: int = 0
    stalled: dict[str, float] = field(default_factory=dict)  # folder -> s a thread waited

    @property
    def wall(self) -> float:
        return self.end - self.start


def load(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def _union(spans: list[tuple[float, float]], lo: float, hi: float) -> list[tuple[float, float]]:
    """The union of ``spans`` clipped to [lo, hi], as sorted disjoint intervals."""
    out: list[tuple[float, float]] = []
    for a, b in sorted((max(a, lo), min(b, hi)) for a, b in spans):
        if b <= a:
            continue
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _fill(phase: Phase, requests: list[dict[str, Any]]) -> None:
    def spans(op: str | None) -> list[tuple[float, float]]:
        return [(r["submit"], r["done"]) for r in requests if op is None or r["op"] == op]

    busy = _union(spans(None), phase.start, phase.end)
    phase.busy = sum(b - a for a, b in busy)
    phase.reading = sum(b - a for a, b in _union(spans("read"), phase.start, phase.end))
    phase.writing = sum(b - a for a, b in _union(spans("write"), phase.start, phase.end))
    edges = [phase.start, *[t for span in busy for t in span], phase.end]
    phase.longest_gap = max(b - a for a, b in zip(edges[::2], edges[1::2]))
    for kind in sorted({r["file"].split("/")[0] for r in requests}):
        mine = [r for r in requests if "stall" in r and r["file"].startswith(kind + "/")]
        waits = [(r["stall"], r["done"]) for r in mine]
        phase.stalled[kind] = sum(b - a for a, b in _union(waits, phase.start, phase.end))
    for r in requests:
        if phase.start <= r["submit"] < phase.end:
            key = "read_bytes" if r["op"] == "read" else "write_bytes"
            setattr(phase, key, getattr(phase, key) + r["bytes"])


def phases(events: list[dict[str, Any]]) -> list[Phase]:
    """One :class:`Phase` per stretch between consecutive marks (named after the first); the
    stretch after the last mark ends with the last completion."""
    marks = [(e["t"], e["mark"]) for e in events if "mark" in e]
    requests = [e for e in events if "op" in e]
    for r in requests:  # never seen completing: the run ended first
        if r["done"] is None:
            r["done"] = r["submit"]
    end = max([r["done"] for r in requests] + [t for t, _ in marks] + [0.0])
    out = []
    for i, (t, name) in enumerate(marks):
        phase = Phase(name, t, marks[i + 1][0] if i + 1 < len(marks) else end)
        _fill(phase, requests)
        out.append(phase)
    return out


def steps(found: list[Phase]) -> list[list[Phase]]:
    """The phases grouped per training step: each group starts at a "forward" mark."""
    groups: list[list[Phase]] = []
    for p in found:
        if p.name == "forward" or not groups:
            groups.append([])
        groups[-1].append(p)
    return groups


def table(found: list[Phase]) -> str:
    """One line per phase of each step: wall, busy %, idle, longest gap, GB read / written,
    and how long the threads waited for requests of each folder (the I/O on the critical
    path)."""
    rows = []
    for i, group in enumerate(steps(found)):
        for p in group:
            pct = 100 * p.busy / p.wall if p.wall > 0 else 0.0
            rows.append(
                f"step {i} {p.name:9} {p.wall:7.3f} s  disk busy {pct:5.1f}% (reading "
                f"{p.reading:6.3f} s, writing {p.writing:6.3f} s)  idle {p.wall - p.busy:6.3f} s "
                f"longest gap {p.longest_gap:6.3f} s  read {p.read_bytes / 1e9:6.3f} GB  "
                f"written {p.write_bytes / 1e9:6.3f} GB  waited for I/O: "
                + ", ".join(f"{k} {v:.3f} s" for k, v in p.stalled.items())
            )
    return "\n".join(rows)
