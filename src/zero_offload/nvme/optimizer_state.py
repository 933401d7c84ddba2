"""The master shard and Adam moments of one flat group in a swap file (``offload_optimizer``
"nvme"): the state of ``core/state/shard_state.py`` with host memory bounded by a buffer pool.

File layout: the shard index space is cut into chunks of ``chunk`` elements (the host update's
unit, a multiple of 2048); chunk k has a *record* of three regions (master, exp_avg, exp_avg_sq),
``chunk * 4`` bytes each, and two versions of it, at ``(2k + v) * record`` bytes. ``current[k]``
is the version holding chunk k's committed state.

Invariants:
- an update reads every chunk's current version and writes the other one; only when every chunk
  was updated and written does it flip ``current`` for all chunks at once. A failure anywhere in
  a step (a read or write error, disk trouble, an exception in the kernel) leaves every chunk's
  committed state as it was before the step: the master weights are never half-updated;
- at most ``len(pool)`` records are in host memory (the pool's aligned, pinned-on-CUDA buffers);
  the update reads chunk k+1 ahead while chunk k is computed and chunk k-1 written back;
- ``read_ahead`` (the engine calls it as the step's backward begins) reads the first
  ``len(pool)`` records into the pool before the update starts, so the disk works while the
  backward computes; those early reads hold the committed versions, and anything that changes
  the committed state or borrows ``pool[0]`` first (``read``, ``write``, ``fill``, ``commit``)
  drops them. ``pool[0]`` is also the element cache of ``read`` and ``write``;
- during the update the read of chunk k+1 is in flight before chunk k computes (the disk never
  waits for the kernel), and a buffer goes back to reading as soon as its write is done;
- every I/O is one record or one region: offsets and sizes are multiples of 4096 bytes, as
  direct I/O needs;
- ``sums[v, k]`` holds the block checksums of what this run last wrote to version v of chunk
  k (``known[v, k]``: it wrote it); every read is checked against them, so a record changed
  underneath the run is an ``NvmeSwapError``, never master weights or moments silently
  replaced.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from pathlib import Path

import torch

from ..core.pinned_bytes import host_bytes
from ..core.state.shard_state import KINDS, Body, Chunk
from .errors import NvmeSwapError
from .io.aio import ALIGN, AioEngine, SwapFile, aligned_empty
from .io.checksum import BLOCK, block_sums, first_mismatch
from .io.file_guard import check_swap_file, hold
from .io.scratch import own_file
from .swap_root import making


class NvmeOptimizerState:
    where = "nvme"
    aliased = False
    transactional = True

    def whole(self, kind: str) -> torch.Tensor | None:
        """Records in a file: no tensor holds a kind whole."""
        return None

    def raw(self) -> dict[str, torch.Tensor]:
        """fp32 records: ``read`` is exact."""
        return {}

    def load_raw(self, fetch) -> None:
        """fp32 records: nothing beside them."""

    master_dtype = torch.float32

    def parts(self) -> list:
        return [self]

    def __init__(
        self,
        folder: Path,
        name: str,
        numel: int,
        chunk: int,
        buffers: int,
        aio: AioEngine,
        pin: bool,
    ) -> None:
        assert chunk % (ALIGN // 2) == 0, "a chunk's regions must be whole 4096-byte blocks"
        self.numel, self.chunk, self.aio = numel, chunk, aio
        self.region = chunk * 4
        self.record = len(KINDS) * self.region
        self.nchunks = max(1, -(-numel // chunk))
        with making(folder):  # held before a reclaimer can see it (swap_root.py)
            self.file = SwapFile.create(folder / f"{name}.swp", 2 * self.nchunks * self.record)
            hold(self.file)
        self.current = [0] * self.nchunks
        self.sums = torch.zeros(2, self.nchunks, self.record // BLOCK, dtype=torch.int64)
        self.known = torch.zeros(2, self.nchunks, dtype=torch.bool)
        self.pool = [aligned_empty(self.record, pin) for _ in range(max(2, buffers))]
        self._dirty: tuple[int, int] | None = None  # (chunk, kind) cached in pool[0] by write
        self._early: dict[int, tuple[torch.Tensor, object]] = {}  # chunk -> (buffer, read)
        self._written = False  # an update wrote the other versions, not committed yet
        self.close = own_file(self, self.file)  # scratch: removed with this object or at exit

    # ---- addressing ----------------------------------------------------------------------------
    def _offset(self, k: int, version: int, kind: int = 0) -> int:
        return (2 * k + version) * self.record + kind * self.region

    def _views(self, buf: torch.Tensor, n: int) -> dict[str, torch.Tensor]:
        f = buf.view(torch.float32)
        per = self.chunk
        return {kind: f[i * per : i * per + n] for i, kind in enumerate(KINDS)}

    def _fail(self, what: str, k: int, err: OSError) -> NvmeSwapError:
        lo = k * self.chunk
        hi = min(lo + self.chunk, self.numel)
        return NvmeSwapError(
            f"{self.file.path}: {what} of optimizer-state chunk {k} (elements {lo}..{hi}) "
            f"failed: {err}; the master weights and moments are those of the last completed "
            "step (nothing of this step was committed)"
        )

    def check(self) -> None:
        """The swap file is still the one this state created (an open file that was unlinked
        keeps working, but something is deleting this run's scratch: stop before the next step
        depends on it)."""
        check_swap_file(self.file, "optimizer-state")

    # ---- checksums -----------------------------------------------------------------------------
    def _blocks_of(self, kind: int | None) -> slice:
        per = self.region // BLOCK
        return slice(0, 3 * per) if kind is None else slice(kind * per, (kind + 1) * per)

    def _wrote(self, k: int, version: int, buf: torch.Tensor, kind: int | None = None) -> None:
        """Record the checksums of ``buf`` (the record, or region ``kind``), about to be written."""
        self.sums[version, k, self._blocks_of(kind)] = block_sums(buf)
        self.known[version, k] = True

    def _verify(self, k: int, version: int, buf: torch.Tensor, kind: int | None = None) -> None:
        if not bool(self.known[version, k]):
            return
        blocks = self._blocks_of(kind)
        want = self.sums[version, k, blocks]
        bad = first_mismatch(buf, want, torch.ones_like(want, dtype=torch.bool))
        if bad is not None:
            region = KINDS[(bad + (blocks.start or 0)) * BLOCK // self.region]
            lo = k * self.chunk
            raise NvmeSwapError(
                f"{self.file.path}: optimizer-state chunk {k} (elements {lo}.."
                f"{min(lo + self.chunk, self.numel)}, {region}) does not hold what this run "
                "wrote (checksum mismatch): the swap file was changed underneath the run by "
                "another process or the disk; nothing of this step was committed; keep "
                "nvme_path for this run alone and restart from the last checkpoint"
            )

    # ---- the streamed update -------------------------------------------------------------------
    def update(
        self,
        chunks: list[Chunk],
        body: Body,
        write: bool = True,
        before_commit: Callable[[], None] | None = None,
        commit: bool = True,
    ) -> None:
        """``chunks`` must be this state's own chunks, in order (the caller's host-update plan).
        ``write=False``: a read-only pass (nothing written back, nothing committed).
        ``before_commit``: runs after the last write-back, before the commit (a failure there
        commits nothing either). ``commit=False``: the new versions are written but the state
        stays the old one until ``commit()`` (``discard()`` forgets them): the engine commits
        every group's step at once, after every rank succeeded."""
        assert [lo for lo, _ in chunks] == [k * self.chunk for k in range(len(chunks))]
        assert not self._written, "an update is waiting for commit() or discard()"
        if len(chunks) != self.nchunks:
            self._drop_early()
        self.flush()
        self.check()
        self._stream(chunks, body, write)  # every request waited for when it returns or raises
        if before_commit is not None:
            before_commit()
        if write:
            self._written = True
            if commit:
                self.commit()

    def _stream(self, chunks: list[Chunk], body: Body, write: bool) -> None:
        """The pipeline over the record pool: chunk k computes while later chunks are read ahead
        and earlier ones written behind (into the other version of each record). Before chunk k
        computes, the read of chunk k+1 is in flight (waiting for the oldest write's buffer if
        it must), so the disk never idles through a computation; a buffer whose write is done
        goes back to reading at once, and free buffers read further ahead."""
        n = len(chunks)
        reads, self._early = self._early, {}  # the records read ahead during the backward
        busy = {id(buf) for buf, _ in reads.values()}
        free = collections.deque(b for b in self.pool if id(b) not in busy)
        writes: collections.deque = collections.deque()
        nxt = len(reads)  # the next chunk to read (those read ahead are 0..len(reads)-1)

        def reclaim(block: bool) -> bool:
            """The oldest write's buffer back to ``free``: if done, or (``block``) once it is."""
            if not writes or not (block or writes[0][2].done()):
                return False
            k, buf, req = writes.popleft()
            self._wait(req, "write", k)
            free.append(buf)
            return True

        try:
            for k, (lo, hi) in enumerate(chunks):
                while reclaim(block=False):
                    pass
                while nxt < n and (free or (nxt <= k + 1 and reclaim(block=True))):
                    buf = free.popleft()
                    off = self._offset(nxt, self.current[nxt])
                    reads[nxt] = (buf, self.aio.read(self.file, off, buf))
                    nxt += 1
                buf, req = reads.pop(k)
                self._wait(req, "read", k)
                self._verify(k, self.current[k], buf)
                body(lo, hi, self._views(buf, hi - lo))
                if not write:
                    free.append(buf)
                    continue
                off = self._offset(k, 1 - self.current[k])
                self._wrote(k, 1 - self.current[k], buf)
                writes.append((k, buf, self.aio.write(self.file, off, buf)))
            while writes:
                reclaim(block=True)
        finally:  # on failure: let every request finish before its buffer can be reused
            for _, req in reads.values():
                _quiet_wait(req)
            for _, _, req in writes:
                _quiet_wait(req)

    # ---- the read-ahead before the update -------------------------------------------------------
    def read_ahead(self) -> None:
        """Start reading the first records of the next update into the pool (see the
        invariants); a no-op while they are in flight or an update waits for its commit. Never
        raises: a failed read is the update's error (a step failure, rolled back)."""
        if self._early or self._written:
            return
        try:
            self.flush()  # pool[0]'s cached region goes back before the records are read
            self.check()
            for k in range(min(len(self.pool), self.nchunks)):
                buf = self.pool[k]
                off = self._offset(k, self.current[k])
                self._early[k] = (buf, self.aio.read(self.file, off, buf))
        except Exception:
            # The update meets the same trouble and fails the step on every rank at once
            # (rolled back); a backward raising on one rank would leave the others waiting.
            self._drop_early()

    def _drop_early(self) -> None:
        """Forget the records read ahead (their reads finish first: the buffers are reused)."""
        for _, req in self._early.values():
            _quiet_wait(req)
        self._early.clear()

    def commit(self) -> None:
        """The versions the last update wrote become the state, every chunk at once."""
        self._drop_early()
        if self._written:
            self.current = [1 - v for v in self.current]
            self._written = False

    def discard(self) -> None:
        """Forget an uncommitted update: the state stays the last committed one."""
        self._written = False

    def _wait(self, req, what: str, k: int) -> None:
        try:
            req.wait()
        except OSError as e:
            raise self._fail(what, k, e) from e

    # ---- element access (set-up, checkpoints, accessors) ---------------------------------------
    def _regions(self, lo: int, hi: int):
        """(chunk, start in chunk, end in chunk, start in the caller's range) covering [lo, hi)."""
        pos = lo
        while pos < hi:
            k = pos // self.chunk
            a = pos - k * self.chunk
            b = min(hi - k * self.chunk, self.chunk)
            yield k, a, b, pos - lo
            pos = k * self.chunk + b

    def read(self, kind: str, lo: int, hi: int) -> torch.Tensor:
        self._drop_early()  # pool[0] may hold a record read ahead
        self.flush()
        out = torch.empty(hi - lo, dtype=torch.float32)
        i = KINDS.index(kind)
        buf = self.pool[0].view(torch.float32)[: self.chunk]
        region = self.pool[0][: self.region]
        for k, a, b, at in self._regions(lo, hi):
            v = self.current[k]
            self._wait(self.aio.read(self.file, self._offset(k, v, i), region), "read", k)
            self._verify(k, v, region, i)
            out[at : at + b - a].copy_(buf[a:b])
        return out

    def write(self, kind: str, lo: int, src: torch.Tensor) -> None:
        """Into the committed version (not a step): one region is cached in ``pool[0]`` and
        written back when another region is touched or at ``flush`` (which every read, update
        and fill runs first), so many small consecutive writes cost one read and one write."""
        self._drop_early()
        i = KINDS.index(kind)
        src = src.detach().reshape(-1).to("cpu", torch.float32)
        buf = self.pool[0].view(torch.float32)[: self.chunk]
        for k, a, b, at in self._regions(lo, lo + src.numel()):
            if self._dirty != (k, i):
                self.flush()
                off = self._offset(k, self.current[k], i)
                self._wait(self.aio.read(self.file, off, self.pool[0][: self.region]), "read", k)
                self._verify(k, self.current[k], self.pool[0][: self.region], i)
                self._dirty = (k, i)
            buf[a:b].copy_(src[at : at + b - a])

    def flush(self) -> None:
        """Write the cached region of ``write`` back, if any."""
        if self._dirty is None:
            return
        (k, i), self._dirty = self._dirty, None
        off = self._offset(k, self.current[k], i)
        self._wrote(k, self.current[k], self.pool[0][: self.region], i)
        self._wait(self.aio.write(self.file, off, self.pool[0][: self.region]), "write", k)

    def fill(self, master_of: Callable[[int, int, torch.Tensor], object]) -> None:
        """Initial state, one chunk at a time: moments zero, ``master_of(lo, hi, out)`` writes
        elements ``[lo, hi)`` of the master into ``out`` (fp32, host)."""
        self._dirty = None  # every region is rewritten
        self._drop_early()
        buf = self.pool[0]
        for k in range(self.nchunks):
            lo = k * self.chunk
            hi = min(lo + self.chunk, self.numel)
            buf.zero_()
            master_of(lo, hi, self._views(buf, hi - lo)["master"])
            off = self._offset(k, self.current[k])
            self._wrote(k, self.current[k], buf)
            self._wait(self.aio.write(self.file, off, buf), "write", k)

    def nbytes(self) -> dict[str, int]:
        return {
            "nvme.master_shard": self.numel * 4,
            "nvme.optimizer_state": self.numel * 8,
            # the record's other version: the step writes it while the committed one stays
            # readable, so the file holds every state twice (never a half-updated master)
            "nvme.second_version": self.numel * 12,
            "host.nvme_buffers": sum(host_bytes(b) for b in self.pool),
        }


def _quiet_wait(req) -> None:
    try:
        req.wait()
    except OSError:
        pass  # the first error is the one reported
