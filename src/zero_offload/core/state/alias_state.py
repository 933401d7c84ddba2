"""The shard state with the optimizer beside the params: no master copy.

When the master is the params' own dtype (fp32 training; a bf16 master under
``bf16_master_weights_and_grads`` with bf16 params) and would live in the same memory, a separate
master is a second copy of the same numbers: the update writes the master, then copies it into
the params. ``AliasState`` instead takes the param home's own fp32 values as the master (stages
0-2: this rank's slices of the flat buffer; stage 3: the param shard, on the device, or in host
memory with both offloads, where the host kernel updates it in place), so the update writes the
params in place and only the Adam moments are allocated, in the state format's moment type
(``compact_moments.py``: fp32, bf16 or 8-bit): fp32 12 -> 8 bytes/param of optimizer-side
state, a bf16 master with bf16 moments 6 -> 4 (DeepSpeed keeps a cloned partition here).

Invariants:
- the master IS the home's values: ``read``/``write`` of "master" go through the home, and
  ``views("master", segs)`` are views of the home's storage, one per segment, in shard order;
- ``master`` is the whole shard as one tensor where the home stores it contiguously (stage 0,
  stage 3, stages 1/2 on one rank or one bucket), else None: a sharded flat buffer holds this
  rank's partition as one slice per bucket, which no single tensor views;
- nothing is allocated for the master: a checkpoint saves and loads it exactly as the params.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..layout import Segment
from .compact_moments import CompactMoments, Moment
from .format import FP32, StateFormat
from .shard_state import KINDS, Body, Chunk, InMemory


class AliasState(InMemory):
    aliased = True

    def parts(self) -> list:
        return [self]

    def close(self) -> None:
        """The params' own memory: nothing of its own to free."""

    def fill(self, master_of) -> None:
        """The master is the params already; the moments start zero."""

    def __init__(
        self,
        home,
        segments: tuple[Segment, ...],
        numel: int,
        moments: bool,
        fmt: StateFormat = FP32,
    ) -> None:
        """``home``: the param home (``read``/``write`` in shard coordinates, ``shard_views``
        and ``shard_tensor``); ``segments``: the shard optimizer's segments; ``fmt``: the state
        format, whose master is the home's dtype (its moments are kept in the format)."""
        self.home, self.numel, self.where = home, numel, home.where  # "device" or "host"
        self.format, self.master_dtype = fmt, fmt.master
        self._views = home.shard_views(segments)
        self.master: torch.Tensor | None = home.shard_tensor()
        device = self._views[0].device if self._views else torch.device("cpu")
        self.moments = CompactMoments(numel if moments else 0, device, fmt, self.where)

    @property
    def exp_avg(self) -> Moment:
        return self.moments.exp_avg

    @property
    def exp_avg_sq(self) -> Moment:
        return self.moments.exp_avg_sq

    def views(self, kind: str, segs: tuple[Segment, ...]) -> list[Moment]:
        """``kind`` as one view per segment (the fused update's operands: fp32 moments)."""
        if kind == "master":
            return list(self._views)
        return [self.moments.view(kind, s.shard_start, s.shard_start + s.numel) for s in segs]

    def update(
        self,
        chunks: list[Chunk],
        body: Body,
        write: bool = True,
        before_commit: Callable[[], None] | None = None,
        commit: bool = True,
    ) -> None:
        """As ``MemoryState.update`` (the moments as ``CompactState.update`` gives them, in
        their own type); a chunk of the master that no single view covers is read into a
        temporary of the home's dtype and, unless ``write`` is false, written back through the
        home."""
        for lo, hi in chunks:
            views = {k: self._view(k, lo, hi) for k in KINDS}
            body(lo, hi, views)
            m = views["master"]
            assert isinstance(m, torch.Tensor)
            if write and m._base is None:  # a temporary: the values go back to the home
                self.home.write(lo, m)
        if before_commit is not None:
            before_commit()

    def _view(self, kind: str, lo: int, hi: int) -> torch.Tensor | Moment:
        """The update's operand: the master in the home's dtype, a moment in its own type."""
        if kind == "master":
            return self.master[lo:hi] if self.master is not None else self.home.read(lo, hi)
        return self.moments.view(kind, lo, hi)

    def read(self, kind: str, lo: int, hi: int) -> torch.Tensor:
        """fp32 values (a view for fp32; a bf16 master or a compact moment: a copy)."""
        if kind != "master":
            return self.moments.read(kind, lo, hi)
        t = self._view("master", lo, hi)
        assert isinstance(t, torch.Tensor)
        return t if t.dtype == torch.float32 else t.float()

    def write(self, kind: str, lo: int, src: torch.Tensor) -> None:
        if kind == "master":
            self.home.write(lo, src)
        else:
            self.moments.write(kind, lo, src)

    def raw(self) -> dict[str, torch.Tensor]:
        return self.moments.raw()

    def load_raw(self, fetch: Callable[[str], torch.Tensor | None]) -> None:
        self.moments.load_raw(fetch)

    def nbytes(self) -> dict[str, int]:
        """No ``master_shard``: it is the params, counted once under their own name."""
        return {f"{self.where}.optimizer_state": self.moments.nbytes()}
