"""Stage 2/3: the inputs of a bucket's reduce-scatter, each bounded by ``reduce_bucket_size``.

A bucket no larger than the cap (``reduce_bucket_size``, rounded up to ``world * align``) gets a
buffer of exactly its own size at its first gradient; the hooks copy gradients into it and free
``p.grad`` at once. A larger bucket (a param or a stage-3 unit bigger than the cap) keeps each
param's own full gradient until the bucket is launched, and is reduced in pieces of at most the
cap: piece j holds, for every rank r, the elements ``[r*S + j*c, r*S + (j+1)*c)`` of the bucket
(``S`` its per-rank slice, ``c`` the piece's per-rank length), so its reduce-scatter lands rank
r's elements exactly at ``[j*c, (j+1)*c)`` of its segment, the same bytes as one whole-bucket
reduce-scatter (same sums, same order: bitwise equal).

Invariants: no buffer is larger than its bucket or the cap; a buffer or held gradient is dropped
when its last collective completes (CUDA: ``record_stream`` on the reduce stream first, so the
caching allocator does not recycle it while the collective reads it). ``peak`` counts bytes a GPU
allocator would hold for these buffers and held gradients, by name.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from ...core.flat_group import FlatGroup
from ...core.layout import Bucket

ALIGN = 16


@dataclass
class Piece:
    """One collective's input: per rank ``numel`` elements starting ``lo`` into its slice."""

    lo: int
    numel: int
    inp: torch.Tensor  # world * numel elements (rank-major), or a view at world 1


class ReduceBuffers:
    def __init__(self, groups: list[FlatGroup], cap: int, world: int) -> None:
        unit = world * ALIGN
        self.cap = max(-(-cap // unit) * unit, unit)
        self.groups, self.world = groups, world
        self.buffers: dict[tuple[int, int], torch.Tensor] = {}  # whole buckets being filled
        self.held: dict[tuple[int, int], torch.Tensor] = {}  # (group, param) -> full gradient
        self.live = {"reduce_buffers": 0, "held_grads": 0}
        self.peak = {"reduce_buffers": 0, "held_grads": 0}
        self.peak_buffers = 0  # most reduce buffers alive at once
        self.largest_buffer = 0  # elements of the largest one allocated

    def bucket(self, key: tuple[int, int]) -> Bucket:
        return self.groups[key[0]].layout.buckets[key[1]]

    def whole(self, key: tuple[int, int]) -> bool:
        return self.bucket(key).numel <= self.cap

    # ---- filled by the hooks (compute stream) --------------------------------------------------
    def add(self, key: tuple[int, int], i: int, grad: torch.Tensor, again: bool) -> None:
        """Take param ``i``'s gradient into its bucket; the caller frees ``p.grad`` after."""
        g = self.groups[key[0]]
        if not self.whole(key):
            if again:
                self.held[(key[0], i)].add_(grad)
            else:
                self.held[(key[0], i)] = grad
                self._count_held()
            return
        buf = self.buffers.get(key)
        if buf is None:
            buf = self.buffers[key] = self._alloc(self.bucket(key).numel, g)
            buf.zero_()  # padding and params without a gradient reduce as zeros
        off = g.layout.offsets[i] - self.bucket(key).start
        dst = buf[off : off + grad.numel()]
        dst.add_(grad.reshape(-1)) if again else dst.copy_(grad.reshape(-1))

    # ---- consumed by the launch (reduce stream) ------------------------------------------------
    def count(self, key: tuple[int, int]) -> int:
        """How many collectives reduce the bucket."""
        return (
            1 if self.whole(key) else -(-self.bucket(key).slice_numel // (self.cap // self.world))
        )

    def pieces(self, key: tuple[int, int]) -> Iterator[Piece]:
        """The bucket's collective inputs in order (one for a whole bucket)."""
        b = self.bucket(key)
        if self.whole(key):
            yield Piece(0, b.slice_numel, self._take_buffer(key, b))
            return
        g = self.groups[key[0]]
        c = self.cap // self.world
        for lo in range(0, b.slice_numel, c):
            n = min(c, b.slice_numel - lo)
            view = self._own_view(g, b, lo, n) if self.world == 1 else None
            yield Piece(lo, n, view if view is not None else self._assemble(g, b, lo, n))

    def _take_buffer(self, key, b: Bucket) -> torch.Tensor:
        buf = self.buffers.pop(key, None)
        if buf is None:  # no param of the bucket got a gradient (unused): zeros
            buf = self._alloc(b.numel, self.groups[key[0]]).zero_()
        return buf

    def _own_view(self, g: FlatGroup, b: Bucket, lo: int, n: int) -> torch.Tensor | None:
        """World 1: the piece as a view of one param's own gradient, if it lies inside one."""
        for i in b.params:
            off = g.layout.offsets[i] - b.start
            grad = self.held.get((g.index, i))
            if grad is not None and off <= lo and lo + n <= off + g.layout.numels[i]:
                return grad.reshape(-1)[lo - off : lo - off + n]
        return None

    def _assemble(self, g: FlatGroup, b: Bucket, lo: int, n: int) -> torch.Tensor:
        """Rank-major piece buffer: rank r's part is the bucket's ``[r*S + lo, +n)``."""
        piece = self._alloc(self.world * n, g).zero_()
        for r in range(self.world):
            a, z = r * b.slice_numel + lo, r * b.slice_numel + lo + n
            for i in b.params:
                off = g.layout.offsets[i] - b.start
                s, e = max(a, off), min(z, off + g.layout.numels[i])
                grad = self.held.get((g.index, i))
                if s < e and grad is not None:
                    dst = piece[r * n + s - a : r * n + e - a]
                    dst.copy_(grad.reshape(-1)[s - off : e - off])
        return piece

    def release(self, key: tuple[int, int], piece: torch.Tensor, keep_alive) -> None:
        """A piece's collective completed: drop its buffer (not a view of a held gradient)."""
        if piece._base is None:
            keep_alive(piece)
            self._count("reduce_buffers", -piece.numel() * piece.element_size(), buffer=-1)

    def drop_held(self, key: tuple[int, int], keep_alive) -> None:
        """A bucket's last piece completed: free the full gradients it was reduced from."""
        for i in self.bucket(key).params:
            grad = self.held.pop((key[0], i), None)
            if grad is not None:
                keep_alive(grad)
        self._count_held()

    def clear(self) -> None:
        """An abandoned backward: nothing in flight any more, drop everything."""
        self.buffers.clear()
        self.held.clear()
        self.live = dict.fromkeys(self.live, 0)
        self._alive = 0

    # ---- accounting ----------------------------------------------------------------------------
    def bounds(self, esize: int) -> dict[str, int]:
        """The most bytes the config allows: two buffers of the largest bucket within the cap,
        and the full gradients of two of the largest bucket above it."""
        sizes = [b.numel for g in self.groups for b in g.layout.buckets]
        whole = max((n for n in sizes if n <= self.cap), default=0)
        held = max((n for n in sizes if n > self.cap), default=0)
        return {"reduce_buffers": 2 * whole * esize, "held_grads": 2 * held * esize}

    _alive = 0

    def reset_peak(self) -> None:
        """Start measuring peaks again from what is alive now."""
        self.peak = dict(self.live)
        self.peak_buffers = self._alive

    def _alloc(self, numel: int, g: FlatGroup) -> torch.Tensor:
        buf = torch.empty(numel, dtype=g.dtype, device=g.device)
        self.largest_buffer = max(self.largest_buffer, numel)
        self._count("reduce_buffers", numel * buf.element_size(), buffer=1)
        return buf

    def _count_held(self) -> None:
        """Held bytes are what the dict references (the truth, not a running sum)."""
        now = sum(g.numel() * g.element_size() for g in self.held.values())
        self._count("held_grads", now - self.live["held_grads"])

    def _count(self, name: str, nbytes: int, buffer: int = 0) -> None:
        self.live[name] += nbytes
        self.peak[name] = max(self.peak[name], self.live[name])
        self._alive += buffer
        self.peak_buffers = max(self.peak_buffers, self._alive)
