"""Flat-buffer layout: pure functions from parameter sizes to offsets, buckets and partitions.

A flat buffer holds a group's params back to back in *flat order* (the order backward is expected
to produce their gradients: reverse registration order). The buffer is cut into **buckets** of at
most ``bucket_size`` elements (a param larger than that gets a bucket of its own); each bucket is
padded so its length divides by ``world_size * align``. Rank r owns the r-th contiguous slice of
every bucket, so one reduce-scatter of a bucket lands each rank's gradients exactly in its grad
shard, and one all-gather of a bucket rebuilds it from every rank's updated slice.

Invariants (tested with hypothesis):
- every flat element belongs to exactly one bucket and, in each bucket, to exactly one rank;
- all ranks' partitions (the union of their bucket slices) have the same size, ``shard_numel``;
- param views ``[offset, offset + numel)`` are disjoint, inside their bucket, and cover all data;
- ``total`` divides by ``world_size * align``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Bucket:
    index: int
    start: int  # flat offset of the bucket
    numel: int  # padded length, a multiple of world_size * align
    params: tuple[int, ...]  # indices (flat order) of the params inside
    slice_numel: int  # numel // world_size: what each rank owns of it
    shard_start: int  # where this bucket's slice sits in every rank's shard


@dataclass(frozen=True)
class Segment:
    """One contiguous piece of a rank's partition: flat[flat_start:+numel] <-> shard[shard_start:+numel]."""

    bucket: int
    flat_start: int
    shard_start: int
    numel: int


@dataclass(frozen=True)
class FlatLayout:
    numels: tuple[int, ...]
    offsets: tuple[int, ...]
    buckets: tuple[Bucket, ...]
    world_size: int
    align: int
    total: int

    @property
    def shard_numel(self) -> int:
        return self.total // self.world_size

    @property
    def data_numel(self) -> int:
        return sum(self.numels)

    def param_bucket(self) -> tuple[int, ...]:
        """Bucket index of every param."""
        out = [0] * len(self.numels)
        for b in self.buckets:
            for i in b.params:
                out[i] = b.index
        return tuple(out)

    def segments(self, rank: int) -> tuple[Segment, ...]:
        """Rank's partition as (flat range, shard range) pieces, one per bucket."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {rank}")
        return tuple(
            Segment(b.index, b.start + rank * b.slice_numel, b.shard_start, b.slice_numel)
            for b in self.buckets
        )

    def whole_segments(self) -> tuple[Segment, ...]:
        """The entire flat buffer as segments (stage 0: every rank updates everything)."""
        return tuple(Segment(b.index, b.start, b.start, b.numel) for b in self.buckets)

    def to_dict(self) -> dict:
        return {
            "numels": list(self.numels),
            "world_size": self.world_size,
            "align": self.align,
            "bucket_params": [list(b.params) for b in self.buckets],
        }


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def build_layout(
    numels: list[int] | tuple[int, ...],
    world_size: int,
    bucket_size: int,
    align: int = 16,
) -> FlatLayout:
    """Greedy bucketing in flat order; a param never straddles two buckets."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if bucket_size < 1:
        raise ValueError(f"bucket_size must be >= 1, got {bucket_size}")
    if align < 1:
        raise ValueError(f"align must be >= 1, got {align}")
    if any(n < 1 for n in numels):
        raise ValueError("every param must have at least one element")
    groups: list[list[int]] = []
    filled = 0
    for i, n in enumerate(numels):
        if groups and filled + n <= bucket_size:
            groups[-1].append(i)
            filled += n
        else:
            groups.append([i])
            filled = n
    return layout_from_buckets(numels, groups, world_size, align)


def build_unit_layout(
    numels: list[int] | tuple[int, ...],
    units: list[int] | tuple[int, ...],
    world_size: int,
    align: int = 16,
) -> FlatLayout:
    """Stage 3: one bucket per run of consecutive params of the same fetch unit (the module that
    owns them), so fetching a module is one all-gather of its bucket and its gradients are one
    reduce-scatter. ``units[i]`` is param i's unit id (flat order)."""
    if len(units) != len(numels):
        raise ValueError(f"units has {len(units)} entries for {len(numels)} params")
    groups: list[list[int]] = []
    for i, u in enumerate(units):
        if groups and units[groups[-1][-1]] == u:
            groups[-1].append(i)
        else:
            groups.append([i])
    return layout_from_buckets(numels, groups, world_size, align)


def layout_from_buckets(
    numels: list[int] | tuple[int, ...],
    bucket_params: list[list[int]],
    world_size: int,
    align: int,
) -> FlatLayout:
    """Rebuild a layout from an explicit bucket assignment (used when loading checkpoints)."""
    unit = world_size * align
    offsets = [0] * len(numels)
    buckets = []
    start = shard_start = 0
    for index, members in enumerate(bucket_params):
        pos = start
        for i in members:
            offsets[i] = pos
            pos += numels[i]
        padded = max(_round_up(pos - start, unit), unit)
        buckets.append(
            Bucket(index, start, padded, tuple(members), padded // world_size, shard_start)
        )
        start += padded
        shard_start += padded // world_size
    return FlatLayout(tuple(numels), tuple(offsets), tuple(buckets), world_size, align, start)
