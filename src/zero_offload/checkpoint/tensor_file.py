"""safetensors files written one chunk at a time, with a SHA-256 per fixed-size block.

Why our own writer: ``safetensors.torch.save_file`` first turns every tensor into ``bytes`` (a
second copy of the whole state in host memory) and refuses tensors that share storage. This one
writes the standard format (8-byte little-endian header length, JSON header, raw data in header
order) straight from each tensor's memory, copying device tensors to the host one chunk at a time,
so peak host memory stays one chunk above the state itself. Files are read back with the official
``safetensors.safe_open``.

Digest of a file: the SHA-256 of every ``block_size`` block (the last one may be short) and,
as the file's ``sha256``, the SHA-256 of those block digests concatenated (raw bytes). A loader
that reads only some slices (an elastic resume) verifies only the blocks it touches.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import struct
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from .format import CheckpointError, CheckpointNotFoundError
from .scripts.meta_checks import check_digest_schema

BLOCK_SIZE = 64 << 20
CHUNK_BYTES = 16 << 20  # unit of device -> host staging and of each write

DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
for _name, _code in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2")):
    if hasattr(torch, _name):
        DTYPE_NAMES[getattr(torch, _name)] = _code
DTYPES: dict[str, torch.dtype] = {v: k for k, v in DTYPE_NAMES.items()}


def dtype_name(dtype: torch.dtype, where: str) -> str:
    if dtype not in DTYPE_NAMES:
        raise CheckpointError(f"{where}: dtype {dtype} cannot be stored in safetensors")
    return DTYPE_NAMES[dtype]


@dataclass(frozen=True)
class Entry:
    """One tensor to write. ``source`` is the tensor, or a function producing it when its turn
    comes (the export streams tensors it assembles one at a time), or producing its flattened
    contents as consecutive pieces (an NVMe optimizer state, read chunk by chunk)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    source: torch.Tensor | Callable[[], torch.Tensor | Iterable[torch.Tensor]]

    @staticmethod
    def of(name: str, t: torch.Tensor) -> Entry:
        return Entry(name, t.dtype, tuple(t.shape), t)

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()


def _digest(pieces: list[memoryview]) -> bytes:
    h = hashlib.sha256()
    for mv in pieces:
        h.update(mv)  # releases the GIL: blocks hash in parallel on the pool's threads
    return h.digest()


class _BlockHasher:
    """Cuts the byte stream into blocks and hashes each block on a thread pool.

    A block is a list of views of the caller's chunks (no copy); it stays referenced, and so do
    the host copies of device chunks inside it, until its hash is done. At most ``max_pending``
    blocks wait, which bounds that memory to about ``max_pending * block_size``.
    """

    def __init__(self, block_size: int, pool: ThreadPoolExecutor, max_pending: int) -> None:
        self.block_size, self.pool, self.max_pending = block_size, pool, max_pending
        self.pieces: list[memoryview] = []
        self.filled = 0
        self.size = 0
        self.futures: list[Future] = []
        self.done = 0  # futures[:done] are known finished

    def update(self, mv: memoryview) -> None:
        pos, n = 0, len(mv)
        while pos < n:
            take = min(n - pos, self.block_size - self.filled)
            self.pieces.append(mv[pos : pos + take])
            self.filled += take
            pos += take
            if self.filled == self.block_size:
                self._submit()
        self.size += n

    def _submit(self) -> None:
        self.futures.append(self.pool.submit(_digest, self.pieces))
        self.pieces, self.filled = [], 0
        while len(self.futures) - self.done > self.max_pending:
            self.futures[self.done].result()
            self.done += 1

    def finish(self) -> dict:
        if self.filled or not self.futures:
            self._submit()
        digests = [f.result() for f in self.futures]
        return {
            "size": self.size,
            "sha256": hashlib.sha256(b"".join(digests)).hexdigest(),
            "block_size": self.block_size,
            "block_sha256": [d.hex() for d in digests],
        }


def byte_chunks(t: torch.Tensor, chunk_bytes: int) -> Iterator[memoryview]:
    """``t``'s bytes, ``chunk_bytes`` at a time (a device tensor: one chunk of host memory at a
    time). Each view keeps its chunk alive while it is used (a digest may run later)."""
    flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
    for lo in range(0, flat.numel(), chunk_bytes):
        piece = flat[lo : lo + chunk_bytes]
        if piece.device.type != "cpu":
            piece = piece.cpu()
        yield host_bytes(piece)


def host_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous host uint8 tensor, without ``numpy()``: a numpy view marks the
    tensor's storage not resizable for the rest of the process, and ``offload_states`` frees an
    engine buffer by resizing its storage (a save of the engine's own buffers must not stop
    that). The view holds ``t``, so the bytes outlive the caller's reference."""
    if t.numel() == 0:
        return memoryview(b"")
    raw = (ctypes.c_char * t.numel()).from_address(t.data_ptr())
    raw._tensor = t  # keeps the storage alive as long as the view
    return memoryview(raw).cast("B")


def _header(entries: Sequence[Entry], metadata: dict[str, str] | None) -> bytes:
    header: dict = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    pos = 0
    for e in entries:
        if e.name in header or e.name == "__metadata__":
            raise CheckpointError(f"tensor name {e.name!r} appears twice in one file")
        n = e.nbytes
        header[e.name] = {
            "dtype": dtype_name(e.dtype, e.name),
            "shape": list(e.shape),
            "data_offsets": [pos, pos + n],
        }
        pos += n
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned, as safetensors does
    return struct.pack("<Q", len(raw)) + raw


def write_file(
    path: Path,
    entries: Sequence[Entry],
    metadata: dict[str, str] | None = None,
    block_size: int = BLOCK_SIZE,
    chunk_bytes: int = CHUNK_BYTES,
) -> dict:
    """Write ``entries`` as a safetensors file, fsync it, and return its digest."""
    workers = max(1, min(4, os.cpu_count() or 1))
    with open(path, "wb") as f, ThreadPoolExecutor(workers, thread_name_prefix="ckpt-hash") as pool:
        hasher = _BlockHasher(block_size, pool, max_pending=workers + 1)

        def emit(mv: memoryview) -> None:
            hasher.update(mv)  # queues views; the pool hashes whole blocks while this thread writes
            f.write(mv)

        emit(memoryview(_header(entries, metadata)))
        for e in entries:
            t = e.source() if callable(e.source) else e.source
            pieces = [t] if isinstance(t, torch.Tensor) else t
            written = 0
            for piece in pieces:
                if piece.dtype != e.dtype or (t is piece and tuple(t.shape) != e.shape):
                    raise CheckpointError(
                        f"{path.name}: tensor {e.name!r} is {piece.dtype} "
                        f"{tuple(piece.shape)}, announced as {e.dtype} {e.shape}"
                    )
                written += piece.numel() * piece.element_size()
                for mv in byte_chunks(piece, chunk_bytes):
                    emit(mv)
            if written != e.nbytes:
                raise CheckpointError(
                    f"{path.name}: tensor {e.name!r} streamed {written} bytes, announced "
                    f"{e.nbytes} ({e.dtype} {e.shape})"
                )
        digest = hasher.finish()
        f.flush()
        os.fsync(f.fileno())
    return digest


# ---- reading ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TensorInfo:
    dtype: str
    shape: tuple[int, ...]
    begin: int  # byte offsets inside the data section
    end: int


@dataclass(frozen=True)
class Header:
    data_start: int
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str]

    def byte_range(self, name: str, lo: int, hi: int, itemsize: int) -> tuple[int, int]:
        """File byte range of elements [lo, hi) of the flattened tensor ``name``."""
        start = self.data_start + self.tensors[name].begin
        return start + lo * itemsize, start + hi * itemsize

    def tensors_in(self, lo: int, hi: int) -> list[str]:
        """Names of the tensors with data in file bytes [lo, hi)."""
        return [
            n
            for n, t in self.tensors.items()
            if self.data_start + t.begin < hi and self.data_start + t.end > lo
        ]


def read_header(path: Path) -> Header:
    """Parse a safetensors header, naming the file when it is missing, truncated or malformed."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"{path}: file is missing") from None
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(
                f"{path}: {size} bytes, too short for a safetensors header (truncated)"
            )
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise CheckpointError(
                f"{path}: header claims {n} bytes but the file has {size} (truncated)"
            )
        raw = f.read(n)
    try:
        header = json.loads(raw)
        metadata = header.pop("__metadata__", None) or {}
        tensors = {
            name: TensorInfo(
                str(t["dtype"]),
                tuple(int(d) for d in t["shape"]),
                int(t["data_offsets"][0]),
                int(t["data_offsets"][1]),
            )
            for name, t in header.items()
        }
    except (ValueError, KeyError, TypeError, IndexError) as e:
        raise CheckpointError(f"{path}: malformed safetensors header ({e})") from None
    end = max((t.end for t in tensors.values()), default=0)
    if 8 + n + end != size:
        raise CheckpointError(
            f"{path}: {size} bytes, but its header describes {8 + n + end} (truncated or damaged)"
        )
    return Header(8 + n, tensors, metadata)


def touched_blocks(ranges: Iterable[tuple[int, int]], block_size: int) -> set[int]:
    """Indices of the blocks that overlap any of the byte ranges [lo, hi)."""
    out: set[int] = set()
    for lo, hi in ranges:
        if hi > lo:
            out.update(range(lo // block_size, (hi - 1) // block_size + 1))
    return out


def verify(
    path: Path, digest: dict, ranges: Iterable[tuple[int, int]] | None, header: Header | None = None
) -> None:
    """Check the file's size and the SHA-256 of every block that ``ranges`` touch (all blocks when
    ``ranges`` is None). A mismatch names the file, the byte range and the tensors inside it."""
    check_digest_schema(path, digest)
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"{path}: file is missing") from None
    if size != digest["size"]:
        raise CheckpointError(
            f"{path}: {size} bytes, the checkpoint recorded {digest['size']} (truncated or changed)"
        )
    bs = int(digest["block_size"])
    nblocks = len(digest["block_sha256"])
    blocks = sorted(range(nblocks) if ranges is None else touched_blocks(ranges, bs))
    fd = os.open(path, os.O_RDONLY)
    try:

        def check(i: int) -> bool:  # pread and sha256 release the GIL: blocks hash in parallel
            data = os.pread(fd, min(bs, size - i * bs), i * bs)
            return hashlib.sha256(data).hexdigest() == digest["block_sha256"][i]

        workers = max(1, min(4, os.cpu_count() or 1, len(blocks)))
        with ThreadPoolExecutor(workers, thread_name_prefix="ckpt-verify") as pool:
            results = list(pool.map(check, blocks))
    finally:
        os.close(fd)
    bad = [i for i, ok in zip(blocks, results) if not ok]
    if bad:
        i = bad[0]
        lo, hi = i * bs, min(size, (i + 1) * bs)
        inside = header.tensors_in(lo, hi) if header is not None else []
        what = f"tensor(s) {', '.join(inside[:5])}" if inside else "the header"
        if header is not None and lo < header.data_start and inside:
            what = f"the header and {what}"
        raise CheckpointError(
            f"{path}: checksum mismatch in bytes [{lo}, {hi}) ({what}); the file is damaged"
        )
