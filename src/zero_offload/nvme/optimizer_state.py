"""The master shard and Adam moments of one flat group in a swap file (``offload_optimizer``
"nvme"): the state of ``core/state/shard_state.py`` with host memory bounded by a buffer pool.

File layout: the shard index space is cut into chunks of ``chunk`` elements (the host update's
unit, a multiple of 2048); chunk k has a *record* of three regions (master, exp_avg, exp_avg_sq)
in the state format's element types (``core/state/format.py``; ``record_layout.py``: fp32 or
bf16 values, or 8-bit codes followed by their fp32 scales), each padded to whole 4096-byte
blocks, and two versions of it, at ``(2k + v) * record`` bytes. ``current[k]`` is the version
holding chunk k's committed state.

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
- the update's body gets each chunk's views in the format's types (fp32 or bf16 tensors,
  ``QuantizedMoment``s of whole blocks) over the record buffer, as ``CompactState`` gives them;
  ``read``, ``write`` and ``fill`` speak fp32 as ``CompactState`` does (decode; encode, an 8-bit
  write re-encoding the blocks it touches from their decoded values);
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
from ..core.state.format import FP32, StateFormat
from ..core.state.shard_state import KINDS, Body, Chunk
from ..kernels.quant_maps import QuantizedMoment, decode_blocks, encode_blocks
from .errors import NvmeSwapError
from .io.aio import AioEngine, SwapFile, aligned_empty
from .io.checksum import BLOCK, block_sums, first_mismatch
from .io.file_guard import check_swap_file, hold
from .io.scratch import own_file
from .record_layout import RecordLayout
from .swap_root import making

Moment = torch.Tensor | QuantizedMoment


class NvmeOptimizerState:
    where = "nvme"
    aliased = False
    transactional = True

    def whole(self, kind: str) -> torch.Tensor | None:
        """Records in a file: no tensor holds a kind whole."""
        return None

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
        fmt: StateFormat = FP32,
    ) -> None:
        self.numel, self.chunk, self.aio, self.format = numel, chunk, aio, fmt
        self.layout = RecordLayout(chunk, fmt)  # a chunk's regions are whole 4096-byte blocks
        self.master_dtype = fmt.master
        self.record = self.layout.record
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
        return (2 * k + version) * self.record + self.layout.offsets[kind]

    def _n(self, k: int) -> int:
        """Elements of chunk k (the last one may be short)."""
        return min(self.chunk, self.numel - k * self.chunk)

    def _typed(self, region: torch.Tensor, kind: str, n: int) -> Moment:
        """The first ``n`` values of a region's bytes (starting at the region) in its type."""
        if kind == "master":
            return region[: n * self.format.master_bytes].view(self.format.master)
        if self.layout.quantized:
            codes = region[:n]
            at = self.chunk  # the scales follow the chunk's codes (4-byte aligned)
            scales = region[at : at + self.layout.scales_of(n) * 4].view(torch.float32)
            return QuantizedMoment(codes, scales, self.format.block, kind == "exp_avg")
        dtype = torch.bfloat16 if self.format.moments == "bf16" else torch.float32
        return region[: n * dtype.itemsize].view(dtype)

    def _views(self, buf: torch.Tensor, n: int) -> dict[str, Moment]:
        return {kind: self._typed(buf[s : s + p], kind, n) for kind, s, p in self._spans()}

    def _spans(self):
        return zip(KINDS, self.layout.offsets, self.layout.spans)

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
        if kind is None:
            return slice(0, self.record // BLOCK)
        start, span = self.layout.offsets[kind], self.layout.spans[kind]
        return slice(start // BLOCK, (start + span) // BLOCK)

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
            region = self.layout.kind_at((bad + blocks.start) * BLOCK)
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

    def _region_buf(self, kind: int) -> torch.Tensor:
        """``pool[0]``'s bytes for one region of ``kind`` (the element cache)."""
        return self.pool[0][: self.layout.spans[kind]]

    def _load(self, k: int, kind: int) -> torch.Tensor:
        """Region ``kind`` of chunk k's committed version into ``pool[0]``, checked."""
        region, v = self._region_buf(kind), self.current[k]
        self._wait(self.aio.read(self.file, self._offset(k, v, kind), region), "read", k)
        self._verify(k, v, region, kind)
        return region

    def _decode(self, t: Moment, a: int, b: int, n: int) -> torch.Tensor:
        """Values ``[a, b)`` of a chunk's typed view ``t`` of ``n`` values, in fp32 (8-bit: the
        whole blocks around them decoded)."""
        if not isinstance(t, QuantizedMoment):
            return t[a:b].float()
        bs = t.block_size
        aa, bb = a - a % bs, min(n, -(-b // bs) * bs)
        values = decode_blocks(t.codes[aa:bb], t.scales[aa // bs : -(-bb // bs)], bs, t.signed)
        return values[a - aa : b - aa]

    def read(self, kind: str, lo: int, hi: int) -> torch.Tensor:
        """Elements ``[lo, hi)`` of ``kind`` in fp32 (decoded from the format's types)."""
        self._drop_early()  # pool[0] may hold a record read ahead
        self.flush()
        out = torch.empty(hi - lo, dtype=torch.float32)
        i = KINDS.index(kind)
        for k, a, b, at in self._regions(lo, hi):
            n = self._n(k)
            t = self._typed(self._load(k, i), kind, n)
            out[at : at + b - a].copy_(self._decode(t, a, b, n))
        return out

    def write(self, kind: str, lo: int, src: torch.Tensor) -> None:
        """Into the committed version (not a step), in fp32, encoded into the format's types
        (bf16 rounded to nearest; an 8-bit write re-encodes the blocks it touches, their other
        values decoded and kept). One region is cached in ``pool[0]`` and written back when
        another region is touched or at ``flush`` (which every read, update and fill runs
        first), so many small consecutive writes cost one read and one write."""
        self._drop_early()
        i = KINDS.index(kind)
        src = src.detach().reshape(-1).to("cpu", torch.float32)
        for k, a, b, at in self._regions(lo, lo + src.numel()):
            n = self._n(k)
            t = self._typed(self._cached(k, i), kind, n)
            piece = src[at : at + b - a]
            if not isinstance(t, QuantizedMoment):
                t[a:b].copy_(piece)
                continue
            bs = t.block_size
            aa, bb = a - a % bs, min(n, -(-b // bs) * bs)
            whole = self._decode(t, aa, bb, n).clone()
            whole[a - aa : b - aa] = piece
            codes, scales = encode_blocks(whole, bs, t.signed)
            t.codes[aa:bb].copy_(codes)
            t.scales[aa // bs : -(-bb // bs)].copy_(scales)

    def _cached(self, k: int, i: int) -> torch.Tensor:
        """Region ``i`` of chunk k in ``pool[0]``, cached for writes (the one cached before
        is written back first)."""
        if self._dirty != (k, i):
            self.flush()
            self._load(k, i)
            self._dirty = (k, i)
        return self._region_buf(i)

    def flush(self) -> None:
        """Write the cached region of ``write`` back, if any."""
        if self._dirty is None:
            return
        (k, i), self._dirty = self._dirty, None
        off = self._offset(k, self.current[k], i)
        self._wrote(k, self.current[k], self._region_buf(i), i)
        self._wait(self.aio.write(self.file, off, self._region_buf(i)), "write", k)

    def fill(self, master_of: Callable[[int, int, torch.Tensor], object]) -> None:
        """Initial state, one chunk at a time: moments zero, ``master_of(lo, hi, out)`` writes
        elements ``[lo, hi)`` of the master into ``out`` (fp32, host; a bf16 master keeps
        them rounded to nearest)."""
        self._dirty = None  # every region is rewritten
        self._drop_early()
        buf = self.pool[0]
        for k in range(self.nchunks):
            lo = k * self.chunk
            hi = min(lo + self.chunk, self.numel)
            buf.zero_()
            views = self._views(buf, hi - lo)
            master = views["master"]
            assert isinstance(master, torch.Tensor)
            if master.dtype == torch.float32:
                master_of(lo, hi, master)
            else:
                tmp = torch.empty(hi - lo, dtype=torch.float32)
                master_of(lo, hi, tmp)
                master.copy_(tmp)
            # the moments stay the zeroed bytes: zero codes and scales are zeros (zeros_moment)
            off = self._offset(k, self.current[k])
            self._wrote(k, self.current[k], buf)
            self._wait(self.aio.write(self.file, off, buf), "write", k)

    # ---- 8-bit moments' stored tensors (a bitwise resume) --------------------------------------
    def raw(self) -> dict[str, torch.Tensor]:
        """8-bit moments: each moment's codes and scales, read from the committed records
        (copies, called at save time); nothing for fp32 or bf16 values (``read`` is exact)."""
        if not self.layout.quantized:
            return {}
        self._drop_early()
        self.flush()
        nblocks = self.layout.scales_of(self.numel)
        out = {}
        for kind in ("exp_avg", "exp_avg_sq"):
            i = KINDS.index(kind)
            codes = torch.empty(self.numel, dtype=torch.uint8)
            scales = torch.empty(nblocks, dtype=torch.float32)
            for k in range(self.nchunks):
                lo, n = k * self.chunk, self._n(k)
                t = self._typed(self._load(k, i), kind, n)
                assert isinstance(t, QuantizedMoment)
                codes[lo : lo + n].copy_(t.codes)
                at = lo // self.format.block
                scales[at : at + t.scales.numel()].copy_(t.scales)
            out[f"{kind}.codes"], out[f"{kind}.scales"] = codes, scales
        return out

    def load_raw(self, fetch: Callable[[str], torch.Tensor | None]) -> None:
        """``raw`` back into the committed records (same partition only; absent names leave
        the values ``write`` converted)."""
        if not self.layout.quantized:
            return
        self._drop_early()
        nblocks = self.layout.scales_of(self.numel)
        for kind in ("exp_avg", "exp_avg_sq"):
            want = {"codes": (torch.uint8, self.numel), "scales": (torch.float32, nblocks)}
            saved: dict[str, torch.Tensor | None] = {}
            for part, (dtype, n) in want.items():
                t = fetch(f"{kind}.{part}")
                if t is not None and (t.dtype != dtype or tuple(t.shape) != (n,)):
                    raise ValueError(f"{kind}.{part}: saved {t.dtype}{list(t.shape)}, this "
                                     f"shard keeps {dtype}[{n}]")  # fmt: skip
                saved[part] = t
            i = KINDS.index(kind)
            for k in range(self.nchunks):
                lo, n = k * self.chunk, self._n(k)
                q = self._typed(self._cached(k, i), kind, n)
                assert isinstance(q, QuantizedMoment)
                codes, scales = saved["codes"], saved["scales"]
                if codes is not None:
                    q.codes.copy_(codes[lo : lo + n])
                if scales is not None:
                    at = lo // self.format.block
                    q.scales.copy_(scales[at : at + q.scales.numel()])
        self.flush()

    def nbytes(self) -> dict[str, int]:
        fmt, n = self.format, self.numel
        if self.layout.quantized:
            moments = 2 * (n + self.layout.scales_of(n) * 4)
        else:
            moments = 2 * n * (2 if fmt.moments == "bf16" else 4)
        master = n * fmt.master_bytes
        return {
            "nvme.master_shard": master,
            "nvme.optimizer_state": moments,
            # the record's other version: the step writes it while the committed one stays
            # readable, so the file holds every state twice (never a half-updated master)
            "nvme.second_version": master + moments,
            "host.nvme_buffers": sum(host_bytes(b) for b in self.pool),
        }


def _quiet_wait(req) -> None:
    try:
        req.wait()
    except OSError:
        pass  # the first error is the one reported
