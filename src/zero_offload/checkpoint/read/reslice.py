"""Re-slicing: pure functions from one flat layout's shards to another's, by param name.

A shard (one rank's master, exp_avg or exp_avg_sq) is a list of segments of a flat buffer; which
model element sits at each shard position depends on the world size, the bucket size and the
alignment at the time. The canonical identity of an element is (param name, index in the param's
flattened data). Loading a checkpoint under another layout is then:

1. ``shard_pieces``: for every old shard and for the new shard, the runs of consecutive elements
   of one param, as (name, element range, shard position) ``Piece``s (padding is in no piece);
2. ``plan_reads``: intersect each wanted piece with the old pieces of the same name, giving
   ``Read``s (old shard index, old shard range, new shard position), merged where contiguous;
3. ``gaps``: the new shard positions no piece covers (padding), which the loader zero-fills.

Invariant (tested with hypothesis): executing the reads of every new shard reproduces exactly the
shard a fresh engine would build from the same per-param data, whatever the two layouts.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

from ...core.layout import FlatLayout, Segment


@dataclass(frozen=True)
class Piece:
    """Elements [lo, hi) of param ``key``'s flattened data sit at shard[pos : pos + hi - lo]."""

    key: str
    lo: int
    hi: int
    pos: int


@dataclass(frozen=True)
class Read:
    """Copy old shard ``source``[src : src + numel] to new shard[dst : dst + numel]."""

    source: int
    src: int
    dst: int
    numel: int


def shard_pieces(
    layout: FlatLayout, segments: Sequence[Segment], keys: Sequence[str]
) -> list[Piece]:
    """The param data inside ``segments`` of ``layout`` (flat order), as pieces in shard order."""
    if len(keys) != len(layout.numels):
        raise ValueError(
            f"keys: expected {len(layout.numels)} names (one per param), got {len(keys)}"
        )
    out = []
    for s in segments:
        seg_lo, seg_hi = s.flat_start, s.flat_start + s.numel
        for i in layout.buckets[s.bucket].params:
            off = layout.offsets[i]
            lo, hi = max(off, seg_lo), min(off + layout.numels[i], seg_hi)
            if lo < hi:
                out.append(Piece(keys[i], lo - off, hi - off, s.shard_start + lo - seg_lo))
    return out


def source_segments(layout: FlatLayout, sharded: bool) -> list[tuple[Segment, ...]]:
    """The shards a checkpoint holds: one per rank when sharded, else one whole copy (rank 0's)."""
    if sharded:
        return [layout.segments(r) for r in range(layout.world_size)]
    return [layout.whole_segments()]


class SourceIndex:
    """The old shards' pieces indexed by param name, built once and queried per wanted piece."""

    def __init__(self, sources: Sequence[Sequence[Piece]]) -> None:
        self.runs: dict[
            str, list[tuple[int, int, int, int]]
        ] = {}  # key -> sorted (lo, hi, source, pos)
        for src, pieces in enumerate(sources):
            for p in pieces:
                self.runs.setdefault(p.key, []).append((p.lo, p.hi, src, p.pos))
        self.starts: dict[str, list[int]] = {}
        for key, runs in self.runs.items():
            runs.sort()
            self.starts[key] = [r[0] for r in runs]

    def reads(self, wanted: Sequence[Piece]) -> list[Read]:
        """Reads that fill every wanted piece. Raises ValueError naming the param and the element
        range when the old shards do not cover a wanted piece."""
        out = []
        for w in wanted:
            runs = self.runs.get(w.key)
            if runs is None:
                raise ValueError(f"param {w.key!r}: not in the checkpoint's shards")
            at = w.lo
            k = max(0, bisect.bisect_right(self.starts[w.key], w.lo) - 1)
            while at < w.hi:
                # Old pieces of one param never overlap, so the run holding ``at`` starts at or
                # before it and the next one starts exactly where this one ends.
                if k >= len(runs) or runs[k][0] > at or runs[k][1] <= at:
                    raise ValueError(
                        f"param {w.key!r}: elements [{at}, {w.hi}) are in no shard of the checkpoint"
                    )
                lo, hi, src, pos = runs[k]
                end = min(hi, w.hi)
                out.append(Read(src, pos + at - lo, w.pos + at - w.lo, end - at))
                at = end
                k += 1
        return coalesce(out)


def plan_reads(sources: Sequence[Sequence[Piece]], wanted: Sequence[Piece]) -> list[Read]:
    """Reads that fill every wanted piece from the old shards (see ``SourceIndex.reads``)."""
    return SourceIndex(sources).reads(wanted)


def coalesce(reads: Sequence[Read]) -> list[Read]:
    """Merge reads that continue each other in both shards (adjacent params of one bucket)."""
    out: list[Read] = []
    for r in reads:
        last = out[-1] if out else None
        if (
            last
            and last.source == r.source
            and last.src + last.numel == r.src
            and last.dst + last.numel == r.dst
        ):
            out[-1] = Read(last.source, last.src, last.dst, last.numel + r.numel)
        else:
            out.append(r)
    return out


def gaps(total: int, pieces: Sequence[Piece]) -> list[tuple[int, int]]:
    """Shard positions in [0, total) that no piece covers: the padding."""
    covered = sorted((p.pos, p.pos + p.hi - p.lo) for p in pieces)
    out, at = [], 0
    for lo, hi in covered:
        if lo > at:
            out.append((at, lo))
        at = max(at, hi)
    if at < total:
        out.append((at, total))
    return out
