"""The master shard and Adam moments of one flat group, wherever they live.

``MemoryState`` keeps them as tensors (device or host memory); ``nvme/optimizer_state.py`` keeps
them in a swap file. Both answer the same three questions, so the update, checkpoints and the
fragment accessors do not care which:

- ``update(chunks, body, write=True)``: run ``body(lo, hi, views)`` over every chunk ``[lo, hi)``
  of the shard index space, ``views`` mapping each kind to that chunk's fp32 tensor, updated in
  place; the new values are the state once ``update`` returns (an NVMe state commits them all at
  once). ``write=False`` promises ``body`` only reads; ``before_commit`` runs after the last
  chunk, before an NVMe state commits (the param home's own writes land there);
- ``read(kind, lo, hi)``: elements ``[lo, hi)`` of ``kind`` (a view for tensors in memory);
- ``write(kind, lo, src)``: overwrite elements ``[lo, lo + len(src))`` of ``kind``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from .. import host_memory

KINDS = ("master", "exp_avg", "exp_avg_sq")

Chunk = tuple[int, int]
# A chunk's views: tensors in the state's element types (an 8-bit moment: ``QuantizedMoment``).
Body = Callable[[int, int, dict[str, Any]], object]
Fill = Callable[[int, int, torch.Tensor], object]
FILL_PIECE = 1 << 22  # elements per piece of an initial fill (bounded temporaries)


class ShardState(Protocol):
    """What every state kind declares (no caller probes for more): its size and place, whether
    its master is the params' own values (``aliased``), its parts (a twin's two; otherwise
    itself), ``close`` (a swap file's removal; nothing for memory)."""

    numel: int
    where: str  # "device", "host" or "nvme": the prefix of its memory report
    aliased: bool
    master_dtype: torch.dtype  # the master's element type (fp32; bf16 in a compact format)
    # A transactional state (NVMe) writes an update pending until ``commit`` or ``discard``
    # (``update(..., commit=False)``) and can ``read_ahead`` its first chunks.
    transactional: bool

    def parts(self) -> list[ShardState]: ...

    def close(self) -> None: ...

    def fill(self, master_of: Fill) -> None:
        """The initial state: moments zero, and ``master_of(lo, hi, out)`` writes master
        elements ``[lo, hi)`` into ``out`` (fp32), in pieces of the state's choosing."""
        ...

    def update(
        self,
        chunks: list[Chunk],
        body: Body,
        write: bool = True,
        before_commit: Callable[[], None] | None = None,
        commit: bool = True,
    ) -> None: ...

    def read(self, kind: str, lo: int, hi: int) -> torch.Tensor: ...

    def write(self, kind: str, lo: int, src: torch.Tensor) -> None: ...

    def nbytes(self) -> dict[str, int]: ...

    def whole(self, kind: str) -> torch.Tensor | None:
        """``kind`` over the whole shard as one fp32 tensor (a view of the state), or None
        where it is not stored as one (NVMe, a twin's two parts, a compact format's types)."""
        ...

    def read_ahead(self) -> None: ...

    def commit(self) -> None: ...

    def discard(self) -> None: ...

    def raw(self) -> dict[str, torch.Tensor]:
        """Stored tensors that ``read``'s fp32 does not give back exactly (8-bit codes and
        scales), name -> tensor, saved beside it so a resume is bitwise; none for the others."""
        ...

    def load_raw(self, fetch: Callable[[str], torch.Tensor | None]) -> None:
        """``raw`` back (same partition only); absent names leave the converted values."""
        ...


class InMemory:
    """What every state kind that is not transactional declares."""

    transactional = False
    master_dtype = torch.float32

    def whole(self, kind: str) -> torch.Tensor | None:
        """The attribute of that name where it is one fp32 tensor (the kinds in memory)."""
        t = getattr(self, kind, None)
        return t if isinstance(t, torch.Tensor) and t.dtype == torch.float32 else None

    def read_ahead(self) -> None:
        """Nothing to read: the state is in memory."""

    def commit(self) -> None:
        """An update in memory is committed as it runs."""

    def discard(self) -> None:
        raise RuntimeError("a state in memory has no pending update to discard")

    def raw(self) -> dict[str, torch.Tensor]:
        return {}

    def load_raw(self, fetch: Callable[[str], torch.Tensor | None]) -> None:
        """``read``/``write`` are exact: nothing beside them."""


class MemoryState(InMemory):
    """fp32 tensors on ``device`` (the accelerator, or the host CPU with ``offload_optimizer``
    "cpu"). ``moments=False`` (a client optimizer keeps its own state): empty moments. In host
    memory (``where`` "host") each is a mapping of its own, outside ``malloc``'s heap
    (``core/host_memory.py``); on the device, the device's allocator's (``offload_states``
    resizes those)."""

    aliased = False

    def parts(self) -> list[ShardState]:
        return [self]

    def close(self) -> None:
        """Memory: freed with the object."""

    def fill(self, master_of: Fill) -> None:
        for lo in range(0, self.numel, FILL_PIECE):
            hi = min(lo + FILL_PIECE, self.numel)
            master_of(lo, hi, self.master[lo:hi])

    def __init__(self, numel: int, device: torch.device, where: str, moments: bool) -> None:
        self.numel, self.where = numel, where
        alloc = host_memory if where == "host" else DeviceAlloc
        self.master = alloc.empty(numel, torch.float32, device)
        n = numel if moments else 0
        self.exp_avg = alloc.zeros(n, torch.float32, device)
        self.exp_avg_sq = alloc.zeros(n, torch.float32, device)

    def tensor(self, kind: str) -> torch.Tensor:
        return getattr(self, kind)

    def update(
        self,
        chunks: list[Chunk],
        body: Body,
        write: bool = True,
        before_commit: Callable[[], None] | None = None,
        commit: bool = True,
    ) -> None:
        """In place: ``commit`` has no meaning for tensors (an update is committed as it runs)."""
        for lo, hi in chunks:
            body(lo, hi, {k: self.tensor(k)[lo:hi] for k in KINDS})
        if before_commit is not None:
            before_commit()

    def read(self, kind: str, lo: int, hi: int) -> torch.Tensor:
        return self.tensor(kind)[lo:hi]

    def write(self, kind: str, lo: int, src: torch.Tensor) -> None:
        self.tensor(kind)[lo : lo + src.numel()].copy_(src)

    def nbytes(self) -> dict[str, int]:
        return {
            f"{self.where}.master_shard": self.master.numel() * 4,
            f"{self.where}.optimizer_state": (self.exp_avg.numel() + self.exp_avg_sq.numel()) * 4,
        }


class DeviceAlloc:
    """``host_memory``'s two calls on the device's own allocator (resizable storages)."""

    @staticmethod
    def empty(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, device=device)

    @staticmethod
    def zeros(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.zeros(numel, dtype=dtype, device=device)
