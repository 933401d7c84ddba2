"""Re-slicing, for any two layouts (world size, bucket size, alignment, sharded or whole): the
reads planned for every new shard rebuild exactly the shard built directly from per-param data."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zero_offload.checkpoint.read.reslice import (
    Piece,
    Read,
    coalesce,
    gaps,
    plan_reads,
    shard_pieces,
    source_segments,
)
from zero_offload.core.layout import build_layout


def _params(numels: list[int]) -> dict[str, torch.Tensor]:
    """Distinct values for every element of every param (name -> flattened data)."""
    out, base = {}, 1
    for i, n in enumerate(numels):
        out[f"p{i}"] = torch.arange(base, base + n, dtype=torch.float64)
        base += n
    return out


def _build_shard(layout, segments, names, data) -> torch.Tensor:
    """The shard a fresh engine holds: flat buffer with params at their offsets, padding 0."""
    flat = torch.zeros(layout.total, dtype=torch.float64)
    for i, name in enumerate(names):
        flat[layout.offsets[i] : layout.offsets[i] + layout.numels[i]] = data[name]
    numel = sum(s.numel for s in segments)
    shard = torch.full((numel,), float("nan"), dtype=torch.float64)
    for s in segments:
        shard[s.shard_start : s.shard_start + s.numel] = flat[s.flat_start : s.flat_start + s.numel]
    return shard


layout_args = st.tuples(
    st.integers(1, 6), st.integers(1, 500), st.sampled_from([1, 2, 16]), st.booleans()
)


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.integers(1, 300), min_size=1, max_size=12), layout_args, layout_args, st.randoms()
)
def test_reads_rebuild_every_new_shard(numels, old_args, new_args, rnd):
    names = [f"p{i}" for i in range(len(numels))]
    data = _params(numels)
    ow, obucket, oalign, osharded = old_args
    old = build_layout(numels, ow, obucket, oalign)
    sources = source_segments(old, osharded)
    old_shards = [_build_shard(old, segs, names, data) for segs in sources]
    old_pieces = [shard_pieces(old, segs, names) for segs in sources]

    nw, nbucket, nalign, nsharded = new_args
    new = build_layout(numels, nw, nbucket, nalign)
    ranks = range(nw) if nsharded else [rnd.randrange(nw)]
    for r in ranks:
        segs = new.segments(r) if nsharded else new.whole_segments()
        want = _build_shard(new, segs, names, data)
        wanted = shard_pieces(new, segs, names)
        got = torch.full_like(want, float("nan"))
        for rd in plan_reads(old_pieces, wanted):
            assert rd.numel > 0
            dst = got[rd.dst : rd.dst + rd.numel]
            assert dst.isnan().all(), "an element is written twice"
            dst.copy_(old_shards[rd.source][rd.src : rd.src + rd.numel])
        for lo, hi in gaps(want.numel(), wanted):
            assert got[lo:hi].isnan().all()
            got[lo:hi] = 0.0
        assert torch.equal(got, want)


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.integers(1, 300), min_size=1, max_size=12),
    st.integers(1, 6),
    st.integers(1, 500),
    st.sampled_from([1, 2, 16]),
)
def test_pieces_cover_params_exactly_once(numels, world, bucket, align):
    layout = build_layout(numels, world, bucket, align)
    names = [f"p{i}" for i in range(len(numels))]
    seen = {n: [0] * k for n, k in zip(names, numels)}
    for segs in source_segments(layout, True):
        pieces = shard_pieces(layout, segs, names)
        total = sum(s.numel for s in segs)
        covered = sum(p.hi - p.lo for p in pieces) + sum(hi - lo for lo, hi in gaps(total, pieces))
        assert covered == total  # pieces and padding tile the shard
        for p in pieces:
            for k in range(p.lo, p.hi):
                seen[p.key][k] += 1
    assert all(c == 1 for counts in seen.values() for c in counts)


def test_identical_layout_reads_one_run_per_bucket():
    layout = build_layout([5, 7, 30, 2], world_size=2, bucket_size=12, align=4)
    names = ["a", "b", "c", "d"]
    old = [shard_pieces(layout, layout.segments(r), names) for r in range(2)]
    reads = plan_reads(old, shard_pieces(layout, layout.segments(1), names))
    assert all(r.source == 1 and r.src == r.dst for r in reads)
    assert len(reads) <= len(layout.buckets)


def test_coalesce_merges_only_continuations():
    reads = [Read(0, 0, 10, 4), Read(0, 4, 14, 2), Read(1, 6, 16, 1), Read(1, 8, 17, 1)]
    assert coalesce(reads) == [Read(0, 0, 10, 6), Read(1, 6, 16, 1), Read(1, 8, 17, 1)]


def test_missing_coverage_names_the_param():
    old = [[Piece("w", 0, 10, 0)]]
    with pytest.raises(ValueError, match=r"param 'w': elements \[10, 12\)"):
        plan_reads(old, [Piece("w", 5, 12, 0)])
    with pytest.raises(ValueError, match="param 'v': not in the checkpoint"):
        plan_reads(old, [Piece("v", 0, 1, 0)])


def test_shard_pieces_rejects_wrong_names():
    layout = build_layout([3, 4], 1, 100)
    with pytest.raises(ValueError, match="keys: expected 2 names"):
        shard_pieces(layout, layout.segments(0), ["only-one"])
