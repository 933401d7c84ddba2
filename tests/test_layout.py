"""Layout invariants, for any parameter sizes, world size, bucket size and alignment."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zero_offload.core.layout import build_layout, layout_from_buckets

sizes = st.lists(st.integers(1, 3000), min_size=1, max_size=30)


@settings(max_examples=200, deadline=None)
@given(sizes, st.integers(1, 8), st.integers(1, 4000), st.sampled_from([1, 2, 16]))
def test_layout_invariants(numels, world, bucket_size, align):
    lay = build_layout(numels, world, bucket_size, align)
    assert lay.total % (world * align) == 0
    # Param views are disjoint, inside their bucket, and in flat order.
    owner_bucket = lay.param_bucket()
    covered = [0] * lay.total
    for i, (off, n) in enumerate(zip(lay.offsets, numels)):
        b = lay.buckets[owner_bucket[i]]
        assert b.start <= off and off + n <= b.start + b.numel
        for k in range(off, off + n):
            covered[k] += 1
    assert max(covered) == 1 and sum(covered) == sum(numels)
    # Buckets tile the buffer; a bucket exceeds bucket_size only when it holds one big param.
    pos = 0
    for b in lay.buckets:
        assert b.start == pos and b.numel % (world * align) == 0
        raw = sum(numels[i] for i in b.params)
        assert raw <= bucket_size or len(b.params) == 1
        pos += b.numel
    assert pos == lay.total
    # Every element is owned by exactly one rank; partitions are equal-sized and tile each shard.
    owners = [0] * lay.total
    for r in range(world):
        segs = lay.segments(r)
        assert sum(s.numel for s in segs) == lay.shard_numel
        shard_pos = 0
        for s in segs:
            assert s.shard_start == shard_pos
            shard_pos += s.numel
            for k in range(s.flat_start, s.flat_start + s.numel):
                owners[k] += 1
    assert owners == [1] * lay.total
    # Rebuilding from the bucket assignment gives the same layout (checkpoint metadata).
    again = layout_from_buckets(numels, [list(b.params) for b in lay.buckets], world, align)
    assert again == lay


def test_param_larger_than_bucket_and_partition():
    lay = build_layout([5, 1000, 3], world_size=4, bucket_size=100, align=1)
    assert [b.params for b in lay.buckets] == [(0,), (1,), (2,)]
    big = lay.buckets[1]
    assert big.numel == 1000 and big.slice_numel == 250  # straddles all four partitions


@pytest.mark.parametrize("bad", [dict(world_size=0), dict(bucket_size=0), dict(align=0)])
def test_layout_rejects_bad_arguments(bad):
    kw = dict(world_size=2, bucket_size=10, align=1) | bad
    with pytest.raises(ValueError, match=next(iter(bad))):
        build_layout([3, 4], **kw)
