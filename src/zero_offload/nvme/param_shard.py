"""One group's 16-bit param shard in a swap file (``offload_param`` "nvme", stage 3).

The file is the shard itself: element i at byte ``i * itemsize``, padded to 4096 bytes. A fetch
reads a slot's slice (this rank's piece of one fetch unit) from the 4096-byte blocks that cover
it into an aligned host buffer; those buffers are a cache shared by every shard of the model
(``param_cache.py``: at most ``buffer_count`` slices and ``max_in_cpu`` elements, DeepSpeed's
keys), least recently used first out. ``read_ahead`` starts the reads of the slots the fetch
schedule will gather next (its recorded order), so a fetch finds its slice in memory.

Invariants:
- a cached slice equals the file's bytes: every write drops the cached slices it overlaps first;
- a write covers whole 4096-byte blocks (direct I/O writes whole blocks only): a write of whole
  blocks is submitted and left in flight (``pending``); one with a partial first or last block
  is read-modify-write, after every pending write has finished. Every read of the file (a fetch,
  a read-ahead) first waits for the pending writes it overlaps, and ``flush`` waits for all:
  the file is current for every reader;
- a buffer is never reused or freed while a request on it is in flight (the cache and
  ``pending`` hold the request with its buffer until it was waited for); on the CPU a dropped
  buffer is kept for reuse (two per size: no page faults per fetch) while the cache and the kept
  buffers of every shard together stay within ``max_in_cpu`` elements (DeepSpeed's meaning: the
  param elements kept in host memory for the whole model), pinned ones go back to torch's pinned allocator, which knows when a
  non-blocking copy from them has finished;
- ``sums[j]`` is the checksum of what this run last wrote to block j of the file
  (``known[j]``: it wrote it), taken before the write is submitted; every read is checked
  against it, and every read first checks that the file is still the one this run created, so
  a file changed, truncated, removed or replaced underneath the run is an ``NvmeSwapError``.
  A write that fails puts its blocks' sums back as they were and is remembered per block
  (``failed``) until a later write of the block succeeds: a read that then does not match
  names that failed write, not another process.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..core.pinned_bytes import host_bytes, reserved
from .errors import NvmeSwapError
from .io.aio import ALIGN, AioEngine, SwapFile, aligned_empty
from .io.checksum import BLOCK, block_sums, first_mismatch
from .io.file_guard import RESTART, check_swap_file, hold
from .io.scratch import own_file
from .param_cache import ParamCache
from .swap_root import making

MAX_PENDING_WRITES = 4  # writes in flight per shard; a fifth waits for the oldest


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
        cache: ParamCache | None = None,
    ) -> None:
        """``cache``: the one shared with the model's other shards (default: one of its own,
        bounded by ``max_in_cpu`` alone)."""
        self.numel, self.dtype, self.aio, self.pin = numel, dtype, aio, pin
        self.itemsize = torch.empty((), dtype=dtype).element_size()
        self.shared = cache if cache is not None else ParamCache(max_in_cpu)
        self.shared.register(self)
        self.max_in_cpu = self.shared.max_in_cpu
        with making(folder):  # held before a reclaimer can see it (swap_root.py)
            self.file = SwapFile.create(folder / f"{name}.swp", max(ALIGN, numel * self.itemsize))
            hold(self.file)
        self.sums = torch.zeros(self.file.nbytes // BLOCK, dtype=torch.int64)
        self.known = torch.zeros(self.file.nbytes // BLOCK, dtype=torch.bool)
        self.pending: list = []  # (lo, hi, buffer, request, undo) of writes in flight
        self.failed: dict[int, str] = {}  # block -> this run's failed write of it
        self.ahead_hits = 0  # fetches served by a read-ahead (how well the guesses work)
        self._spare: dict[int, list[torch.Tensor]] = {}  # free buffers by size (CPU only)
        self.spare_bytes = 0  # bytes of the buffers in _spare
        self._target: tuple[int, int, torch.Tensor] | None = None  # write_target's, unsubmitted
        self.close = own_file(self, self.file)  # scratch: removed with this object or at exit

    # ---- addressing ----------------------------------------------------------------------------
    def _blocks(self, lo: int, hi: int) -> tuple[int, int]:
        """File byte range of the whole 4096-byte blocks covering elements [lo, hi)."""
        a = lo * self.itemsize // ALIGN * ALIGN
        b = -(-hi * self.itemsize // ALIGN) * ALIGN
        return a, b

    def charge(self, lo: int, hi: int) -> int:
        """Elements slice [lo, hi) counts against ``max_in_cpu``: its own, or with pinned
        buffers (CUDA) the element-equivalents of what its buffer reserves (a small one from
        the caching allocator is rounded up to a power of two)."""
        if not self.pin:
            return hi - lo
        a, b = self._blocks(lo, hi)
        return -(-reserved(b - a, True) // self.itemsize)

    def _wait(self, req, what: str, lo: int, hi: int) -> None:
        try:
            req.wait()
        except OSError as e:
            raise NvmeSwapError(
                f"{self.file.path}: {what} of param-shard elements {lo}..{hi} failed: {e}"
            ) from e

    def _verify(self, a: int, buf: torch.Tensor, lo: int, hi: int) -> None:
        """``buf``, read from byte ``a``, holds what this run wrote there."""
        j = a // BLOCK
        n = buf.numel() // BLOCK
        bad = first_mismatch(buf, self.sums[j : j + n], self.known[j : j + n])
        if bad is not None and j + bad in self.failed:
            raise NvmeSwapError(
                f"{self.file.path}: param-shard elements {lo}..{hi} (block {j + bad}) do not "
                f"hold what this run last wrote there: {self.failed[j + bad]}; the block's "
                f"contents are unknown; {RESTART}"
            )
        if bad is not None:
            raise NvmeSwapError(
                f"{self.file.path}: param-shard elements {lo}..{hi} (block {j + bad}) do not "
                "hold what this run wrote (checksum mismatch): the swap file was changed "
                f"underneath the run by another process or the disk; {RESTART}"
            )

    def _read_checked(self, a: int, buf: torch.Tensor, lo: int, hi: int) -> None:
        """A demanded read of the blocks from byte ``a`` into ``buf``, waited for and checked."""
        check_swap_file(self.file, "param-shard")
        self._wait(self.aio.read(self.file, a, buf, urgent=True), "read", lo, hi)
        self._verify(a, buf, lo, hi)

    def _buffer(self, nbytes: int) -> torch.Tensor:
        spare = self._spare.get(nbytes)
        if not spare:
            return aligned_empty(nbytes, self.pin)
        self._spare_change(-nbytes)
        return spare.pop()

    def _recycle(self, buf: torch.Tensor) -> None:
        spare = self._spare.setdefault(buf.numel(), [])
        shared = self.shared
        kept = shared.spare + buf.numel() // self.itemsize + shared.cached
        if not self.pin and len(spare) < 2 and kept <= self.max_in_cpu:
            spare.append(buf)
            self._spare_change(buf.numel())

    def _spare_change(self, nbytes: int) -> None:
        self.spare_bytes += nbytes
        self.shared.spare += nbytes // self.itemsize

    def trim_spares(self, excess: int) -> None:
        """Free kept buffers, largest first, until ``excess`` elements are freed (or none are
        left)."""
        for size in sorted(self._spare, reverse=True):
            bufs = self._spare[size]
            while bufs and excess > 0:
                bufs.pop()
                self._spare_change(-size)
                excess -= size // self.itemsize

    @property
    def cached(self) -> int:
        """Elements of this shard's slices in the shared cache."""
        return sum(self.charge(k[1], k[2]) for k in self.shared.entries if k[0] is self)

    def held_bytes(self) -> int:
        """Host bytes this shard holds now: its cached slices' buffers, its spares and the
        buffers of its writes in flight."""
        cached = sum(host_bytes(e[0]) for k, e in self.shared.entries.items() if k[0] is self)
        return cached + self.spare_bytes + sum(host_bytes(p[2]) for p in self.pending)

    def flush(self, lo: int = 0, hi: int | None = None) -> None:
        """Wait for the pending writes whose 4096-byte blocks overlap those of elements
        [lo, hi) (all by default): a write rewrites its blocks whole, neighbours included."""
        keep, first_error = [], None
        a, b = self._blocks(lo, self.numel if hi is None else hi)
        for entry in self.pending:
            wa, wb = self._blocks(entry[0], entry[1])
            if wa < b and wb > a:
                try:
                    self._finish(entry)
                except NvmeSwapError as e:
                    first_error = first_error or e
            else:
                keep.append(entry)
        self.pending = keep
        if first_error is not None:
            raise first_error

    # ---- reads ---------------------------------------------------------------------------------
    # A cache entry is [buffer, first byte of the slice in it, pending read or None, used]. A
    # read-ahead never evicts an entry not used yet (it would throw away its own earlier guess)
    # and is skipped when there is no room otherwise; a demanded read evicts what it must.

    def read_ahead(self, lo: int, hi: int) -> None:
        """Start reading [lo, hi) into the cache (no-op when cached or without room)."""
        key = (self, lo, hi)
        if key in self.shared.entries or hi <= lo:
            return
        if not self.shared.make_room(self.charge(lo, hi), used_only=True):
            return
        self.flush(lo, hi)
        check_swap_file(self.file, "param-shard")
        a, b = self._blocks(lo, hi)
        buf = self._buffer(b - a)
        req = self.aio.read(self.file, a, buf, urgent=True)  # before the optimizer's read-ahead
        self.shared.insert(key, [buf, lo * self.itemsize - a, req, False])

    def read(self, lo: int, hi: int, cache: bool = True) -> torch.Tensor:
        """Elements [lo, hi), a host tensor (from the cache when read ahead). ``cache=False``:
        a one-off read (set-up, checkpoints) that leaves the cache as it was."""
        if hi <= lo:
            return torch.empty(0, dtype=self.dtype)
        key = (self, lo, hi)
        entries = self.shared.entries
        hit = entries.get(key)
        if hit is None:
            self.flush(lo, hi)
            a, b = self._blocks(lo, hi)
            buf = aligned_empty(b - a, self.pin) if not cache else self._buffer(b - a)
            self._read_checked(a, buf, lo, hi)
            hit = [buf, lo * self.itemsize - a, None, True]
            if cache and self.shared.make_room(self.charge(lo, hi), used_only=False):
                self.shared.insert(key, hit)
        elif hit[2] is not None:
            try:
                self._wait(hit[2], "read", lo, hi)
                self._verify(lo * self.itemsize // ALIGN * ALIGN, hit[0], lo, hi)
            except NvmeSwapError:
                self.drop(key)
                raise
            hit[2] = None
        if key in entries:
            self.ahead_hits += not hit[3]
            hit[3] = True
            entries.move_to_end(key)
        buf, start = hit[0], hit[1]
        return buf[start : start + (hi - lo) * self.itemsize].view(self.dtype)

    def drop_cached(self) -> None:
        """Forget this shard's cached slices (the next fetches read the file)."""
        for key in [k for k in self.shared.entries if k[0] is self]:
            self.drop(key)

    def drop(self, key: tuple) -> None:
        buf, _, req, _ = self.shared.pop(key)
        if req is not None:
            try:
                req.wait()  # the buffer goes only after its read has finished
            except OSError:
                pass  # reported by the fetch that needs it, if any
        self._recycle(buf)

    # ---- writes --------------------------------------------------------------------------------
    def write(self, lo: int, src: torch.Tensor) -> None:
        """Elements [lo, lo + src.numel()) take ``src``'s values (``src`` may be reused as soon
        as this returns; the I/O may still be in flight, see the invariants)."""
        hi = lo + src.numel()
        if hi <= lo:
            return
        self._before_write(lo, hi)
        a, b = self._blocks(lo, hi)
        start, end = lo * self.itemsize - a, hi * self.itemsize - a
        partial = self._partial(lo, hi)
        if partial:  # keep the neighbours' bytes of the first and last block
            self.flush()
        buf = self._buffer(b - a)
        if partial:
            self._read_checked(a, buf, lo, hi)
        else:
            buf[end:].zero_()  # the file's padding after the shard's last element
        buf[start:end].view(self.dtype).copy_(src.detach().reshape(-1))
        self._submit_write(lo, hi, buf)

    def write_target(self, lo: int, hi: int) -> torch.Tensor | None:
        """A host tensor for elements [lo, hi) that the caller fills, then submits with
        ``finish_write`` (the host update's kernel writes its 16-bit output there: no staging
        copy); None where [lo, hi) has a partial 4096-byte block (``write`` it instead)."""
        if hi <= lo or self._partial(lo, hi):
            return None
        self._before_write(lo, hi)
        a, b = self._blocks(lo, hi)
        buf = self._buffer(b - a)
        buf[(hi - lo) * self.itemsize :].zero_()  # the file's padding after the last element
        self._target = (lo, hi, buf)
        return buf[: (hi - lo) * self.itemsize].view(self.dtype)

    def finish_write(self) -> None:
        """Submit the tensor of the last ``write_target``, now filled."""
        assert self._target is not None, "finish_write without write_target"
        (lo, hi, buf), self._target = self._target, None
        self._submit_write(lo, hi, buf)

    def _partial(self, lo: int, hi: int) -> bool:
        """[lo, hi) covers its first or last 4096-byte block only in part (the shard's padding
        after its last element excepted)."""
        a, b = self._blocks(lo, hi)
        return bool(lo * self.itemsize - a or (hi * self.itemsize - a != b - a and hi < self.numel))

    def _before_write(self, lo: int, hi: int) -> None:
        for key in [k for k in self.shared.entries if k[0] is self and k[1] < hi and k[2] > lo]:
            self.drop(key)
        self.flush(lo, hi)  # two writes of one block in flight could land in either order

    def _submit_write(self, lo: int, hi: int, buf: torch.Tensor) -> None:
        while len(self.pending) >= MAX_PENDING_WRITES:  # bounded host memory for writes
            self._finish(self.pending.pop(0))
        a = self._blocks(lo, hi)[0]
        j0, j1 = a // BLOCK, (a + buf.numel()) // BLOCK
        undo = (j0, self.sums[j0:j1].clone(), self.known[j0:j1].clone())
        self.sums[j0:j1] = block_sums(buf)
        self.known[j0:j1] = True
        try:
            req = self.aio.write(self.file, a, buf)
        except OSError as e:
            self._failed_write(undo, lo, hi, e)
            raise NvmeSwapError(
                f"{self.file.path}: write of param-shard elements {lo}..{hi} failed: {e}"
            ) from e
        self.pending.append((lo, hi, buf, req, undo))
        self.shared.note()

    def _finish(self, entry) -> None:
        wlo, whi, buf, req, undo = entry
        try:
            self._wait(req, "write", wlo, whi)
        except NvmeSwapError as e:
            self._failed_write(undo, wlo, whi, e.__cause__ or e)
            raise
        finally:
            self._recycle(buf)
        for j in range(undo[0], undo[0] + undo[1].numel()):
            self.failed.pop(j, None)  # the block holds what this run wrote: known again

    def _failed_write(self, undo: tuple, lo: int, hi: int, error: BaseException) -> None:
        """The blocks' sums as before the write that failed; the failure kept per block."""
        j0, sums, known = undo
        self.sums[j0 : j0 + sums.numel()] = sums
        self.known[j0 : j0 + known.numel()] = known
        why = f"this run's write of elements {lo}..{hi} failed ({error})"
        for j in range(j0, j0 + sums.numel()):
            self.failed[j] = why

    def nbytes(self) -> dict[str, int]:
        return {
            "host.param_cache": self.cached * self.itemsize,
            "host.param_spares": self.spare_bytes,
        }


@dataclass(frozen=True)
class NvmeParams:
    """Where a store's NVMe param shards go and how they are read; every shard made by
    :meth:`shard` shares one :class:`ParamCache` (``max_in_cpu`` elements and ``depth`` slices
    for the whole model)."""

    folder: Path
    aio: AioEngine
    max_in_cpu: int
    depth: int = 5  # slots read ahead of the gathers (offload_param.buffer_count)
    cache: ParamCache = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "cache", ParamCache(self.max_in_cpu, self.depth))

    def shard(self, name: str, numel: int, dtype: torch.dtype, pin: bool) -> NvmeParamShard:
        return NvmeParamShard(
            self.folder, name, numel, dtype, self.aio, pin, self.max_in_cpu, self.cache
        )
