"""The shard state in a compact format (``format.py``): a bf16 master (DeepSpeed's
``bf16_master_weights_and_grads``) and/or bf16 moments (``bf16_optimizer_states``) or 8-bit
moments (``Adam8bit`` / ``AdamW8bit``: uint8 codes plus one fp32 absmax per block), in host
memory (``offload_optimizer`` "cpu", the SIMD kernel of ``kernels/adam_states.py``) or on the
device (the same arithmetic in PyTorch). Where the master would be the params' own values in
their own memory, ``alias_state.py`` keeps the moments in the format instead, with no master.

Invariants:
- ``update`` gives the body each chunk's views in their own element types (a bf16 tensor, or a
  ``QuantizedMoment`` whose codes and scales are views of whole blocks: every chunk but the
  last is a multiple of the block); the rule's kernel takes them as they are;
- ``read`` and ``write`` speak fp32 (checkpoints, the fragment API, conversions); the moments'
  are ``compact_moments.py``'s;
- the memory report counts what is allocated: master, codes and scales.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .. import host_memory
from .compact_moments import CompactMoments, Moment
from .format import StateFormat
from .shard_state import FILL_PIECE, KINDS, Body, Chunk, DeviceAlloc, Fill, InMemory


class CompactState(InMemory):
    aliased = False

    def __init__(self, numel: int, device: torch.device, where: str, fmt: StateFormat) -> None:
        self.numel, self.where, self.format = numel, where, fmt
        self.master_dtype = fmt.master
        alloc = host_memory if where == "host" else DeviceAlloc
        self.master = alloc.empty(numel, fmt.master, device)
        self.moments = CompactMoments(numel, device, fmt, where)

    @property
    def exp_avg(self) -> Moment:
        return self.moments.exp_avg

    @property
    def exp_avg_sq(self) -> Moment:
        return self.moments.exp_avg_sq

    def parts(self) -> list:
        return [self]

    def close(self) -> None:
        """Memory: freed with the object."""

    def fill(self, master_of: Fill) -> None:
        for lo in range(0, self.numel, FILL_PIECE):
            hi = min(lo + FILL_PIECE, self.numel)
            if self.master.dtype == torch.float32:
                master_of(lo, hi, self.master[lo:hi])
            else:  # the 16-bit home's values are bf16 already: exact either way
                tmp = torch.empty(hi - lo, dtype=torch.float32, device=self.master.device)
                master_of(lo, hi, tmp)
                self.master[lo:hi].copy_(tmp)

    def tensor(self, kind: str) -> Moment:
        return getattr(self, kind)

    def _view(self, kind: str, lo: int, hi: int) -> Moment:
        return self.master[lo:hi] if kind == "master" else self.moments.view(kind, lo, hi)

    def update(
        self,
        chunks: list[Chunk],
        body: Body,
        write: bool = True,
        before_commit: Callable[[], None] | None = None,
        commit: bool = True,
    ) -> None:
        for lo, hi in chunks:
            body(lo, hi, {k: self._view(k, lo, hi) for k in KINDS})  # type: ignore[misc]
        if before_commit is not None:
            before_commit()

    def read(self, kind: str, lo: int, hi: int) -> torch.Tensor:
        """Elements ``[lo, hi)`` of ``kind`` in fp32 (a copy unless the kind is fp32)."""
        if kind == "master":
            t = self.master[lo:hi]
            return t if t.dtype == torch.float32 else t.float()
        return self.moments.read(kind, lo, hi)

    def write(self, kind: str, lo: int, src: torch.Tensor) -> None:
        if kind == "master":
            self.master[lo : lo + src.numel()].copy_(src)
        else:
            self.moments.write(kind, lo, src)

    def raw(self) -> dict[str, torch.Tensor]:
        return self.moments.raw()

    def load_raw(self, fetch: Callable[[str], torch.Tensor | None]) -> None:
        self.moments.load_raw(fetch)

    def nbytes(self) -> dict[str, int]:
        return {
            f"{self.where}.master_shard": self.master.numel() * self.master.element_size(),
            f"{self.where}.optimizer_state": self.moments.nbytes(),
        }
