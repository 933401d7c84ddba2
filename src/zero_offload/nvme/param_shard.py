"""One group's 16-bit param shard in a swap file (``offload_param`` "nvme", stage 3).

The file is the shard itself: element i at byte ``i * itemsize``, padded to 4096 bytes. A fetch
reads a slot's slice (this rank's piece of one fetch unit) from the 4096-byte blocks that cover
it into an aligned host buffer; those buffers are a cache of at most ``max_in_cpu`` elements
(DeepSpeed's key), least recently used first out. ``read_ahead`` starts the reads of the slots
the fetch schedule will gather next (its recorded order), so a fetch finds its slice in memory.

Invariants:
- a cached slice equals the file's bytes: every write drops the cached slices it overlaps first;
- a write is read-modify-write of whole covering blocks (direct I/O writes whole blocks only),
  finished before it returns: the file is current whenever no write call is running;
- a buffer is never reused or freed while a read into it is in flight (the cache holds the
  request with its buffer until it was waited for).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from pathlib import Path

import torch

from .aio import ALIGN, AioEngine, SwapFile, aligned_empty
from .errors import NvmeSwapError
from .scratch import own_file


class NvmeParamShard:
    def __init__(
        self,
        folder: Path,
        name: str,
        numel: int,
        dtype: torch.dtype,
        aio: AioEngine,
        pin: bool,
        max_in_cpu: int,
    ) -> None:
        self.numel, self.dtype, self.aio, self.pin = numel, dtype, aio, pin
        self.itemsize = torch.empty((), dtype=dtype).element_size()
        self.max_in_cpu = max_in_cpu
        folder.mkdir(parents=True, exist_ok=True)
        self.file = SwapFile.create(folder / f"{name}.swp", max(ALIGN, numel * self.itemsize))
        # (lo, hi) -> (buffer, first byte of the slice in it, pending request or None)
        self.cache: collections.OrderedDict = collections.OrderedDict()
        self.cached = 0  # elements held by the cache
        self.close = own_file(self, self.file)  # scratch: removed with this object or at exit

    # ---- addressing ----------------------------------------------------------------------------
    def _blocks(self, lo: int, hi: int) -> tuple[int, int]:
        """File byte range of the whole 4096-byte blocks covering elements [lo, hi)."""
        a = lo * self.itemsize // ALIGN * ALIGN
        b = -(-hi * self.itemsize // ALIGN) * ALIGN
        return a, b

    def _wait(self, req, what: str, lo: int, hi: int) -> None:
        try:
            req.wait()
        except OSError as e:
            raise NvmeSwapError(
                f"{self.file.path}: {what} of param-shard elements {lo}..{hi} failed: {e}"
            ) from e

    # ---- reads ---------------------------------------------------------------------------------
    def read_ahead(self, lo: int, hi: int) -> None:
        """Start reading [lo, hi) into the cache; a no-op when cached, or when it would not fit
        beside what is cached (a guess never evicts a slice that may be used first)."""
        if (lo, hi) in self.cache or hi <= lo or self.cached + hi - lo > self.max_in_cpu:
            return
        a, b = self._blocks(lo, hi)
        buf = aligned_empty(b - a, self.pin)
        req = self.aio.read(self.file, a, buf)
        self._insert((lo, hi), (buf, lo * self.itemsize - a, req))

    def read(self, lo: int, hi: int) -> torch.Tensor:
        """Elements [lo, hi), a host tensor (from the cache when read ahead)."""
        if hi <= lo:
            return torch.empty(0, dtype=self.dtype)
        hit = self.cache.get((lo, hi))
        if hit is None:
            a, b = self._blocks(lo, hi)
            buf = aligned_empty(b - a, self.pin)
            self._wait(self.aio.read(self.file, a, buf), "read", lo, hi)
            hit = (buf, lo * self.itemsize - a, None)
            if hi - lo <= self.max_in_cpu:
                self._insert((lo, hi), hit)
        elif hit[2] is not None:
            try:
                self._wait(hit[2], "read", lo, hi)
            except NvmeSwapError:
                self._drop((lo, hi))
                raise
            hit = self.cache[(lo, hi)] = (hit[0], hit[1], None)
        if (lo, hi) in self.cache:
            self.cache.move_to_end((lo, hi))
        buf, start, _ = hit
        return buf[start : start + (hi - lo) * self.itemsize].view(self.dtype)

    def _insert(self, key: tuple[int, int], entry) -> None:
        self.cache[key] = entry
        self.cached += key[1] - key[0]
        while self.cached > self.max_in_cpu and len(self.cache) > 1:
            self._drop(next(iter(self.cache)))

    def _drop(self, key: tuple[int, int]) -> None:
        buf, _, req = self.cache.pop(key)
        if req is not None:
            try:
                req.wait()  # the buffer goes only after its read has finished
            except OSError:
                pass  # reported by the fetch that needs it, if any
        self.cached -= key[1] - key[0]

    # ---- writes --------------------------------------------------------------------------------
    def write(self, lo: int, src: torch.Tensor) -> None:
        """Elements [lo, lo + src.numel()) take ``src``'s values, on disk, before returning."""
        hi = lo + src.numel()
        if hi <= lo:
            return
        for key in [k for k in self.cache if k[0] < hi and k[1] > lo]:
            self._drop(key)
        a, b = self._blocks(lo, hi)
        buf = aligned_empty(b - a, self.pin)
        start, end = lo * self.itemsize - a, hi * self.itemsize - a
        if start or end != b - a:  # partial first or last block: keep the neighbours' bytes
            self._wait(self.aio.read(self.file, a, buf), "read", lo, hi)
        buf[start:end].view(self.dtype).copy_(src.detach().reshape(-1))
        self._wait(self.aio.write(self.file, a, buf), "write", lo, hi)

    def nbytes(self) -> dict[str, int]:
        return {"host.param_cache": self.cached * self.itemsize}


@dataclass(frozen=True)
class NvmeParams:
    """Where a store's NVMe param shards go and how they are read."""

    folder: Path
    aio: AioEngine
    max_in_cpu: int
    depth: int = 5  # slots read ahead of the gathers (offload_param.buffer_count)

    def shard(self, name: str, numel: int, dtype: torch.dtype, pin: bool) -> NvmeParamShard:
        return NvmeParamShard(self.folder, name, numel, dtype, self.aio, pin, self.max_in_cpu)
