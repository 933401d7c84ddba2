"""Stage 2/3: the inputs of a bucket's reduce-scatter, each bounded by ``reduce_bucket_size``.

A bucket no larger than the cap (``reduce_bucket_size``, rounded up to ``world * align``) gets a
buffer of exactly its own size at its first gradient; the hooks copy gradients into it and free
``p.grad`` at once. A larger bucket (a param or a stage-3 unit bigger than the cap) keeps each
param's own full gradient until the bucket is launched, and is reduced in pieces of at most the
cap: piece j holds, for every rank r, the elements ``[r*S + j*c, r*S + (j+1)*c)`` of the bucket
(``S`` its per-rank slice, ``c`` the piece's per-rank length), so its reduce-scatter lands rank
r's elements exactly at ``[j*c, (j+1)*c)`` of its segment, the same bytes as one whole-bucket
reduce-scatter (same sums, same order: bitwise equal).

One rank, a bucket within the cap whose result has a place of its own (the device grad shard on
the micro-step that writes it): the hooks fill that place directly, no buffer at all. Otherwise
buffers come from a pool kept for the run (``buffer_pool.py``: two, reused bucket after bucket),
and only what no gradient overwrites is zeroed: a bucket's padding when its buffer is taken, the
range of a param that got no gradient when the bucket is launched, a piece only when its params
do not cover it.

Invariants: no buffer is larger than its bucket or the cap; a buffer goes back to the pool (a
temporary beyond it, or a held gradient, is dropped) when its last collective completes (CUDA:
the pool's events, or ``record_stream``, keep it from reuse while a stream still reads it).
``peak`` counts bytes a GPU allocator would hold for these buffers (the pool's, in use or not)
and held gradients, by name.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from ...core.flat_group import FlatGroup
from ...core.layout import Bucket
from .buffer_pool import BufferPool

ALIGN = 16


@dataclass
class Piece:
    """One collective's input: per rank ``numel`` elements starting ``lo`` into its slice."""

    lo: int
    numel: int
    inp: torch.Tensor  # world * numel elements (rank-major), or a view at world 1


class ReduceBuffers:
    def __init__(
        self, groups: list[FlatGroup], cap: int, world: int, readers=(), direct=None
    ) -> None:
        """``readers``: the streams that read a reduced buffer (CUDA: reduce, d2h);
        ``direct(key)``: where a whole bucket's reduced result goes when that place may be
        filled as the buffer itself (one rank: the reduction is the identity), else None."""
        unit = world * ALIGN
        self.cap = max(-(-cap // unit) * unit, unit)
        self.groups, self.world = groups, world
        self.pool, self.readers = BufferPool(keep=2), [r for r in readers if r is not None]
        self.direct = direct or (lambda key: None)
        self.buffers: dict[tuple[int, int], torch.Tensor] = {}  # whole buckets being filled
        self.filled: dict[tuple[int, int], set[int]] = {}  # params copied into each
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
            b = self.bucket(key)
            buf = self.direct(key)
            buf = self.buffers[key] = buf if buf is not None else self._alloc(b.numel, g)
            buf[self._data_end(g, b) :].zero_()  # padding reduces as zeros
            self.filled[key] = set()
        off = g.layout.offsets[i] - self.bucket(key).start
        dst = buf[off : off + grad.numel()]
        dst.add_(grad.reshape(-1)) if again else dst.copy_(grad.reshape(-1))
        self.filled[key].add(i)

    @staticmethod
    def _data_end(g: FlatGroup, b: Bucket) -> int:
        """Where the bucket's params end inside it (they sit back to back from its start)."""
        return sum(g.layout.numels[i] for i in b.params)

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
        g = self.groups[key[0]]
        if buf is None:  # no param of the bucket got a gradient (unused): zeros
            return self._alloc(b.numel, g).zero_()
        filled = self.filled.pop(key)
        for i in b.params:  # a param without a gradient (unused) reduces as zeros
            if i not in filled:
                off = g.layout.offsets[i] - b.start
                buf[off : off + g.layout.numels[i]].zero_()
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
        piece = self._alloc(self.world * n, g)
        copies = []  # (piece offset, gradient view)
        for r in range(self.world):
            a, z = r * b.slice_numel + lo, r * b.slice_numel + lo + n
            for i in b.params:
                off = g.layout.offsets[i] - b.start
                s, e = max(a, off), min(z, off + g.layout.numels[i])
                grad = self.held.get((g.index, i))
                if s < e and grad is not None:
                    copies.append((r * n + s - a, grad.reshape(-1)[s - off : e - off]))
        if sum(src.numel() for _, src in copies) < piece.numel():
            piece.zero_()  # padding or a param without a gradient in it: zeros there
        for at, src in copies:
            piece[at : at + src.numel()].copy_(src)
        return piece

    def release(self, key: tuple[int, int], piece: torch.Tensor, keep_alive) -> None:
        """A piece's collective completed: its buffer goes back to the pool, or is dropped (a
        temporary); a view of a held gradient is dropped with the gradient."""
        if self.pool.owns(piece):
            self.pool.give(piece, self.readers)
        elif piece._base is None:
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
        """End of a backward, or an abandoned one: nothing in flight any more, drop everything
        but the pool, whose buffers are all free again."""
        self.buffers.clear()
        self.filled.clear()
        self.held.clear()
        self.pool.reset()
        self.live = {"reduce_buffers": self.pool.nbytes(), "held_grads": 0}
        self._alive = len(self.pool.bases)

    # ---- accounting ----------------------------------------------------------------------------
    def bounds(self, esize: int) -> dict[str, int]:
        """The most bytes the config allows: the pool's two buffers of the largest request (a
        bucket within the cap, or a piece, at most the cap, of one above it), and the full
        gradients of two of the largest bucket above the cap."""
        sizes = [b.numel for g in self.groups for b in g.layout.buckets]
        largest = min(self.cap, max(sizes, default=0))
        held = max((n for n in sizes if n > self.cap), default=0)
        return {"reduce_buffers": 2 * largest * esize, "held_grads": 2 * held * esize}

    _alive = 0

    def reset_peak(self) -> None:
        """Start measuring peaks again from what is alive now."""
        self.peak = dict(self.live)
        self.peak_buffers = self._alive

    def _alloc(self, numel: int, g: FlatGroup) -> torch.Tensor:
        """A buffer from the pool (contents undefined); what it newly allocated is counted."""
        before, bases = self.pool.nbytes(), len(self.pool.bases)
        buf = self.pool.take(numel, g.dtype, g.device)
        self.largest_buffer = max(self.largest_buffer, numel)
        if self.pool.owns(buf):
            self._count("reduce_buffers", self.pool.nbytes() - before, len(self.pool.bases) - bases)
        else:  # a temporary beyond the pool
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
