"""Overlap analysis of one torch.profiler run, from its exported Chrome trace (pure Python).

The trace (``prof.export_chrome_trace``; plain or gzipped JSON with a ``traceEvents`` list) holds
complete events (``"ph": "X"``, ``ts``/``dur`` in microseconds, host and GPU on one clock). Each is
sorted into a class:

- ``compute``: GPU kernels (``cat`` "kernel") but NCCL's; ``collective``: NCCL's kernels;
- ``h2d`` / ``d2h`` / ``d2d``: GPU copies (``cat`` "gpu_memcpy", named like
  "Memcpy HtoD (Pinned -> Device)"), each with ``args["bytes"]``;
- host ranges (any other category but the GPU-side copies of ranges, ``gpu_user_annotation``):
  the engine's labels ``zero_offload.<what>`` become class ``<what>`` (``host_update``,
  ``grad_d2h``, ``grad_wait``, ``param_h2d``, ``fetch``, ``reduce``); the benchmark's ranges
  ``bench.step`` (one per step: the windows) and ``bench.forward`` / ``bench.backward`` /
  ``bench.optimizer`` (phases inside a step).

Per step window it reports each class's busy time (the length of the union of its intervals inside
the window) and busy fraction, how much of one class's busy time another class overlaps
(intersection of the two unions), the bytes each copy direction moved (an event straddling the
window's edge counts pro rata) and the achieved GB/s (bytes / busy time of that direction), and
which host range issued each copy (through the copy's ``correlation`` id and the CUDA runtime call
that carries the same id).

    python benchmarks/_trace.py TRACE.json[.gz]    # the summary of a saved trace, as JSON
"""

from __future__ import annotations

import bisect
import gzip
import json
import statistics
import sys
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

Interval = tuple[float, float]

LABEL_PREFIX = "zero_offload."
HOST_UPDATE = "zero_offload.host_update"  # core/labels.py
STEP = "bench.step"
PHASES = ("bench.forward", "bench.backward", "bench.optimizer")
COPIES = ("h2d", "d2h", "d2d")
_COPY_KIND = {"HtoD": "h2d", "DtoH": "d2h", "DtoD": "d2d"}

# Overlaps reported per step: name -> (class whose busy time is the base, the overlapping class,
# the phase it is restricted to or None for the whole step).
OVERLAPS: dict[str, tuple[str, str, str | None]] = {
    "d2h_compute_backward": ("d2h", "compute", "bench.backward"),
    "h2d_host_update": ("h2d", "host_update", None),
    "h2d_compute": ("h2d", "compute", None),
    "host_update_compute": ("host_update", "compute", None),
}


# ---- intervals ----------------------------------------------------------------------------------
def union(intervals: Iterable[Interval]) -> list[Interval]:
    """Sorted, disjoint intervals covering the same points (empty and reversed ones dropped)."""
    out: list[list[float]] = []
    for lo, hi in sorted(iv for iv in intervals if iv[1] > iv[0]):
        if out and lo <= out[-1][1]:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return [(lo, hi) for lo, hi in out]


def total(u: Iterable[Interval]) -> float:
    return sum(hi - lo for lo, hi in u)


def intersect(a: list[Interval], b: list[Interval]) -> list[Interval]:
    """The intersection of two unions (each sorted and disjoint, as ``union`` returns)."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if hi > lo:
            out.append((lo, hi))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def clip(u: list[Interval], lo: float, hi: float) -> list[Interval]:
    """The part of a union inside [lo, hi]."""
    return intersect(u, [(lo, hi)]) if hi > lo else []


# ---- events -------------------------------------------------------------------------------------
def load(path: str | Path) -> list[dict[str, Any]]:
    """The events of a Chrome trace file (``.json`` or ``.json.gz``)."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def copy_kind(name: str) -> str | None:
    """'h2d', 'd2h' or 'd2d' from a memcpy event's name ("Memcpy HtoD (Pinned -> Device)")."""
    for key, kind in _COPY_KIND.items():
        if key in name:
            return kind
    return None


def is_host_range(ev: dict[str, Any]) -> bool:
    cat = str(ev.get("cat", "")).lower()
    return not cat.startswith("gpu_") and cat not in ("kernel", "memcpy", "memset")


def classify(ev: dict[str, Any]) -> str | None:
    """The class of one event (see the module docstring), or None when no class takes it."""
    if ev.get("ph") != "X":
        return None
    cat, name = str(ev.get("cat", "")).lower(), str(ev.get("name", ""))
    if cat == "kernel":
        return "collective" if name.lower().startswith("nccl") else "compute"
    if cat in ("gpu_memcpy", "memcpy"):
        return copy_kind(name)
    if not is_host_range(ev):
        return None
    if name.startswith(LABEL_PREFIX):
        return name[len(LABEL_PREFIX) :]
    if name == STEP or name in PHASES:
        return name
    return None


def _span(ev: dict[str, Any]) -> Interval:
    ts = float(ev["ts"])
    return ts, ts + float(ev.get("dur", 0.0))


def _bytes(ev: dict[str, Any]) -> float | None:
    b = (ev.get("args") or {}).get("bytes")
    return float(b) if isinstance(b, int | float) else None


class Trace:
    """One trace, its events sorted into classes: ``unions[cls]`` (busy intervals) and ``copies``
    (start, end, direction, bytes or None, correlation id or None) of every GPU copy."""

    def __init__(self, events: list[dict[str, Any]]) -> None:
        raw: dict[str, list[Interval]] = {}
        self.copies: list[tuple[float, float, str, float | None, Any]] = []
        self.steps: list[Interval] = []
        self.phases: dict[str, list[Interval]] = {p: [] for p in PHASES}
        self.host_ranges: list[tuple[Any, float, float, str]] = []  # (tid, start, end, name)
        self.runtime: dict[Any, tuple[Any, float]] = {}  # correlation -> (tid, ts) of the call
        self.has_gpu = False
        for ev in events:
            if ev.get("ph") != "X":
                continue
            cls = classify(ev)
            cat = str(ev.get("cat", "")).lower()
            args = ev.get("args") or {}
            if cat in ("cuda_runtime", "cuda_driver") and "correlation" in args:
                self.runtime[args["correlation"]] = (ev.get("tid"), float(ev["ts"]))
            if cls is None:
                continue
            span = _span(ev)
            if cls == STEP:
                self.steps.append(span)
            elif cls in PHASES:
                self.phases[cls].append(span)
            else:
                raw.setdefault(cls, []).append(span)
            if cls in COPIES or cls in ("compute", "collective"):
                self.has_gpu = True
            if cls in COPIES:
                self.copies.append((*span, cls, _bytes(ev), args.get("correlation")))
            elif cls not in ("compute", "collective"):
                self.host_ranges.append((ev.get("tid"), *span, str(ev["name"])))
        self.unions = {cls: union(v) for cls, v in raw.items()}
        self.steps.sort()
        self.phase_unions = {p: union(v) for p, v in self.phases.items()}
        self._by_tid: dict[Any, list[tuple[float, float, str]]] = {}
        # by start, and of two ranges starting together the enclosing (longer) one first
        for tid, lo, hi, name in sorted(self.host_ranges, key=lambda r: (r[1], -r[2])):
            self._by_tid.setdefault(tid, []).append((lo, hi, name))
        self._starts = {tid: [r[0] for r in rs] for tid, rs in self._by_tid.items()}

    def busy(self, cls: str, lo: float, hi: float) -> list[Interval]:
        return clip(self.unions.get(cls, []), lo, hi)

    def issuer(self, correlation: Any) -> str | None:
        """The innermost labelled host range (``zero_offload.*`` or ``bench.*``) around the runtime
        call that queued the copy with this correlation id, on the same thread; None if unknown."""
        call = self.runtime.get(correlation)
        if call is None:
            return None
        tid, ts = call
        ranges = self._by_tid.get(tid, [])
        # Ranges of one thread nest: the innermost one around ts is the latest-starting one that
        # has not ended by ts.
        for k in range(bisect.bisect_right(self._starts.get(tid, []), ts) - 1, -1, -1):
            lo, hi, name = ranges[k]
            if hi >= ts:
                return name
        return None


# ---- summaries ----------------------------------------------------------------------------------
def _share(part: float, whole: float) -> float | None:
    return part / whole if whole > 0 else None


def step_summary(t: Trace, lo: float, hi: float) -> dict[str, Any]:
    """Busy time (ms), busy fraction, overlaps, bytes and GB/s of one window [lo, hi] (us)."""
    width = hi - lo
    busy = {cls: total(t.busy(cls, lo, hi)) for cls in t.unions}
    out: dict[str, Any] = {
        "window_ms": width / 1e3,
        "busy_ms": {c: v / 1e3 for c, v in busy.items()},
        "busy_frac": {c: (v / width if width > 0 else 0.0) for c, v in busy.items()},
        "phase_ms": {p: total(clip(u, lo, hi)) / 1e3 for p, u in t.phase_unions.items() if u},
    }
    overlaps: dict[str, float | None] = {}
    overlap_ms: dict[str, float] = {}
    for name, (base, other, phase) in OVERLAPS.items():
        region = [(lo, hi)] if phase is None else clip(t.phase_unions.get(phase, []), lo, hi)
        b = intersect(t.busy(base, lo, hi), region)
        both = intersect(b, t.busy(other, lo, hi))
        overlaps[name] = _share(total(both), total(b))
        overlap_ms[name] = total(both) / 1e3
    out["overlap"], out["overlap_ms"] = overlaps, overlap_ms
    moved: dict[str, float | None] = {}
    by_issuer: dict[str, dict[str, float]] = {}
    for c_lo, c_hi, kind, nbytes, corr in t.copies:
        inside = min(c_hi, hi) - max(c_lo, lo)
        if inside <= 0 and not (c_hi == c_lo and lo <= c_lo <= hi):
            continue
        if nbytes is None:
            moved[kind] = None
            continue
        part = nbytes * (inside / (c_hi - c_lo) if c_hi > c_lo else 1.0)
        if moved.get(kind, 0.0) is not None:
            moved[kind] = moved.get(kind, 0.0) + part
        who = t.issuer(corr) if corr is not None else None
        per = by_issuer.setdefault(kind, {})
        per[who or "-"] = per.get(who or "-", 0.0) + part
    out["bytes"] = moved
    out["bytes_by_issuer"] = by_issuer
    out["gbps"] = {
        k: (v / (busy[k] * 1e-6) / 1e9 if v is not None and busy.get(k, 0) > 0 else None)
        for k, v in moved.items()
    }
    return out


def _median(values: list[Any]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def _median_of(steps: list[dict[str, Any]], key: str) -> dict[str, float | None]:
    names = sorted({n for s in steps for n in s[key]})
    return {n: _median([s[key].get(n) for s in steps]) for n in names}


def summarize(events: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-step summaries of every ``bench.step`` window, and their medians."""
    t = Trace(events)
    steps = [step_summary(t, lo, hi) for lo, hi in t.steps]
    median: dict[str, Any] = {"window_ms": _median([s["window_ms"] for s in steps])}
    for key in ("busy_ms", "busy_frac", "phase_ms", "overlap", "overlap_ms", "bytes", "gbps"):
        median[key] = _median_of(steps, key)
    cats = Counter(str(ev.get("cat")) for ev in events if ev.get("ph") == "X")
    copy_names = Counter(
        str(ev.get("name")) for ev in events if ev.get("ph") == "X" and classify(ev) in COPIES
    )
    return {
        "steps": steps,
        "median": median,
        "has_gpu": t.has_gpu,
        "classes": sorted(t.unions),
        "categories": dict(sorted(cats.items())),  # what the trace holds, to check the classes
        "copy_names": dict(sorted(copy_names.items())),
    }


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: _trace.py TRACE.json[.gz]", file=sys.stderr)
        return 2
    print(json.dumps(summarize(load(argv[0])), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
