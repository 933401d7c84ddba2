"""The shard state of fp32 training with the optimizer beside the params: no master copy.

When the model params are fp32 and the master shard would live in the same memory, a separate
master is a second copy of the same numbers: the update writes the master, then copies it into
the params. ``AliasState`` instead takes the param home's own fp32 values as the master (stages
0-2: this rank's slices of the flat buffer; stage 3: the param shard, on the device, or in host
memory with both offloads, where the host kernel updates it in place), so the update writes the
params in place and only the Adam moments are allocated (12 -> 8 bytes/param of optimizer-side
state; DeepSpeed keeps a cloned fp32 partition here).

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

from .. import host_memory
from ..layout import Segment
from .shard_state import KINDS, Body, Chunk, DeviceAlloc


class AliasState:
    aliased = True

    def parts(self) -> list:
        return [self]

    def close(self) -> None:
        """The params' own memory: nothing of its own to free."""

    def fill(self, master_of) -> None:
        """The master is the params already; the moments start zero."""

    def __init__(self, home, segments: tuple[Segment, ...], numel: int, moments: bool) -> None:
        """``home``: the param home (``read``/``write`` in shard coordinates, ``shard_views``
        and ``shard_tensor``); ``segments``: the shard optimizer's segments."""
        self.home, self.numel, self.where = home, numel, home.where  # "device" or "host"
        self._views = home.shard_views(segments)
        self.master: torch.Tensor | None = home.shard_tensor()
        device = self._views[0].device if self._views else torch.device("cpu")
        n = numel if moments else 0
        # Host moments are mappings of their own, outside malloc's heap (core/host_memory.py);
        # device ones stay with the device's allocator (offload_states resizes those).
        alloc = host_memory if self.where == "host" else DeviceAlloc
        self.exp_avg = alloc.zeros(n, torch.float32, device)
        self.exp_avg_sq = alloc.zeros(n, torch.float32, device)

    def views(self, kind: str, segs: tuple[Segment, ...]) -> list[torch.Tensor]:
        """``kind`` as one view per segment (the fused update's operands)."""
        if kind == "master":
            return list(self._views)
        t = getattr(self, kind)
        return [t[s.shard_start : s.shard_start + s.numel] for s in segs]

    def update(
        self,
        chunks: list[Chunk],
        body: Body,
        write: bool = True,
        before_commit: Callable[[], None] | None = None,
        commit: bool = True,
    ) -> None:
        """As ``MemoryState.update``; a chunk of the master that no single view covers is read
        into a temporary and, unless ``write`` is false, written back through the home."""
        for lo, hi in chunks:
            views = {k: self.read(k, lo, hi) for k in KINDS}
            body(lo, hi, views)
            m = views["master"]
            if write and m._base is None:  # a temporary: the values go back to the home
                self.home.write(lo, m)
        if before_commit is not None:
            before_commit()

    def read(self, kind: str, lo: int, hi: int) -> torch.Tensor:
        if kind == "master":
            return self.master[lo:hi] if self.master is not None else self.home.read(lo, hi)
        return getattr(self, kind)[lo:hi]

    def write(self, kind: str, lo: int, src: torch.Tensor) -> None:
        if kind == "master":
            self.home.write(lo, src)
        else:
            getattr(self, kind)[lo : lo + src.numel()].copy_(src)

    def nbytes(self) -> dict[str, int]:
        """No ``master_shard``: it is the params, counted once under their own name."""
        moments = (self.exp_avg.numel() + self.exp_avg_sq.numel()) * 4
        return {f"{self.where}.optimizer_state": moments}
