"""The I/O engine of NVMe offload: direct I/O between aligned host buffers and swap files.

A request (read or write of one CPU buffer at one file offset) is split into ``block_size``
pieces that a pool of ``threads x queue_depth`` worker threads runs with pread/pwrite (DeepSpeed's
``aio.intra_op_parallelism`` threads each keep ``queue_depth`` libaio requests in flight: here
each worker keeps one blocking request in flight, so as many pieces are at the disk at once); :meth:`AioEngine.read` and :meth:`AioEngine.write` return a :class:`Request`
at once, and :meth:`Request.wait` blocks until every piece is done, raising the first error as an
``OSError`` that names the swap file, the offset, the byte count and the operation.

Backends (``AioEngine.backend``):
    ``"pthreads"``        the compiled module ``zero_offload._aio``: C++ threads, outside the GIL;
    ``"python-threads"``  fallback when it is missing (one warning): ``os.preadv``/``os.pwritev``
                          (which release the GIL) on a ``ThreadPoolExecutor``, same splitting.

Environment variable (read when an :class:`AioEngine` is created):
    ZERO_OFFLOAD_AIO  ``auto`` (default) | ``cpp`` (require the compiled module) |
                      ``python`` (force the fallback).

Swap files are opened with ``O_DIRECT`` where the filesystem allows it (where it refuses with
EINVAL, as tmpfs did before Linux 6.6, they are buffered: ``SwapFile.direct`` is False). With
direct I/O the buffer address, the byte count and the file offset of every request must be
multiples of :data:`ALIGN`: use :func:`aligned_empty` buffers. The caller keeps a buffer
untouched until its request is waited for; the :class:`Request` keeps the buffer and the file
alive until then.

``single_submit`` and ``overlap_events`` are DeepSpeed's libaio settings, kept in
:class:`AioPolicy` so a config round-trips; the thread backends have no submission queue or event
loop for them to tune.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import errno
import os
import threading
import time
import warnings
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from ..._native import load_optional
from ...core import host_memory
from ...core.streams import alloc_host
from .trace import tracer

__all__ = [
    "ALIGN",
    "AioEngine",
    "AioPolicy",
    "Request",
    "SwapFile",
    "aligned_empty",
    "io_uring_available",
    "measure_disk_bandwidth",
]

ALIGN = 4096  # direct I/O alignment of buffer addresses, byte counts and file offsets
_AIO_ENV = "ZERO_OFFLOAD_AIO"
_BASELINE_BLOCK = 1 << 20
_MAX_WORKERS = 1024  # the compiled module's largest pool

_C, _IMPORT_ERROR = load_optional("zero_offload._aio")
_URGENT = bool(getattr(_C, "SUBMIT_URGENT", 0))  # a build whose submit() takes ``urgent``

_fallback_warned = False


@dataclass(frozen=True)
class AioPolicy:
    """DeepSpeed's ``aio`` settings. ``threads`` is ``intra_op_parallelism``; ``block_size`` is
    the piece size a request is split into (rounded up to :data:`ALIGN` for direct I/O);
    ``threads x queue_depth`` pieces are in flight at once (:attr:`workers`)."""

    block_size: int = 1 << 20
    queue_depth: int = 8
    threads: int = 1
    single_submit: bool = False
    overlap_events: bool = True

    def __post_init__(self) -> None:
        for name in ("block_size", "queue_depth", "threads"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"AioPolicy.{name} must be an int >= 1, got {value!r}")

    @property
    def workers(self) -> int:
        """I/O worker threads: one blocking request each, so ``threads x queue_depth`` pieces
        are at the disk at once, as DeepSpeed's libaio threads keep them (at most 1024)."""
        return min(self.threads * self.queue_depth, _MAX_WORKERS)


def _round_up(n: int, to: int = ALIGN) -> int:
    return -(-n // to) * to


def aligned_empty(nbytes: int, pin: bool = False) -> torch.Tensor:
    """An uninitialised uint8 CPU tensor of ``nbytes`` rounded up to :data:`ALIGN`, whose
    data_ptr is ALIGN-aligned; in pinned memory when ``pin`` and CUDA is available."""
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise ValueError(f"nbytes must be an int >= 0, got {nbytes!r}")
    size = _round_up(nbytes)
    if pin and torch.cuda.is_available():
        # Through alloc_host (a large buffer registered at its size, a small one from the
        # caching allocator; pageable if pinning is refused, warned once). Both are
        # page-aligned as a rule: no extra page, which would push a power-of-two size into the
        # next size class.
        raw = alloc_host(size, torch.uint8, pin=True)
        if raw.data_ptr() % ALIGN == 0:
            return raw
        raw = alloc_host(size + ALIGN, torch.uint8, pin=True)
    else:
        # Pageable: a mapping of its own from host_memory.MAP_MIN_BYTES up, page-aligned (ALIGN
        # is a page) and outside malloc's heap; a smaller one malloc's, aligned by hand.
        raw = host_memory.host_pageable(size, torch.uint8)
        if raw.data_ptr() % ALIGN == 0:
            return raw
        raw = torch.empty(size + ALIGN, dtype=torch.uint8)
    start = -raw.data_ptr() % ALIGN
    return raw[start : start + size]  # the slice keeps raw's storage alive


def io_uring_available() -> bool | None:
    """Whether the io_uring_setup syscall works here (None without the compiled module). It is
    only probed: no io_uring backend is built."""
    return None if _C is None else bool(_C.io_uring_available())


# ------------------------------------------------------------------------------------------------
# Swap files
# ------------------------------------------------------------------------------------------------


class SwapFile:
    """A preallocated file that requests read and write, opened with O_DIRECT when possible.

    ``fd`` (-1 once closed), ``path``, ``nbytes`` (its size: the size asked for, rounded up to
    ALIGN), ``direct`` (whether O_DIRECT is on). :meth:`close` waits for the requests still in
    flight on it; the context manager closes it (it does not unlink it)."""

    def __init__(self, path: Path, fd: int, nbytes: int, direct: bool) -> None:
        self.path = path
        self.fd = fd
        self.nbytes = nbytes
        self.direct = direct
        self._pending: weakref.WeakSet[Request] = weakref.WeakSet()

    def track(self, request: Request) -> None:
        """``request`` is in flight on this file: ``close`` waits for it."""
        self._pending.add(request)

    def untrack(self, request: Request) -> None:
        """``request`` has finished."""
        self._pending.discard(request)

    @classmethod
    def create(cls, path: Path, nbytes: int, direct: bool = True) -> SwapFile:
        """Create (or truncate) ``path`` with mode 0o600 and preallocate ``nbytes`` rounded up to
        ALIGN. Raises OSError naming the file and the bytes when the space cannot be reserved
        (the file is then removed)."""
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"nbytes must be an int >= 0, got {nbytes!r}")
        path = Path(path)
        size = _round_up(nbytes)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            os.fchmod(fd, 0o600)  # also when the file existed (O_CREAT's mode applies only to new)
            if size:
                try:
                    os.posix_fallocate(fd, 0, size)
                except OSError as e:
                    raise OSError(e.errno, _fallocate_message(path, size, e)) from None
            fd, is_direct = _reopen_direct(path, fd) if direct else (fd, False)
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        return cls(path, fd, size, is_direct)

    @classmethod
    def open(cls, path: Path, direct: bool = True) -> SwapFile:
        """Open an existing swap file (its size is ``nbytes``). A missing file raises
        FileNotFoundError naming it."""
        path = Path(path)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except OSError as e:
            raise OSError(e.errno, f"cannot open swap file {path}: {e.strerror}") from None
        try:
            size = os.fstat(fd).st_size
            fd, is_direct = _reopen_direct(path, fd) if direct else (fd, False)
        except BaseException:
            os.close(fd)
            raise
        return cls(path, fd, size, is_direct)

    def close(self) -> None:
        """Wait for the requests in flight on this file, then close it (idempotent)."""
        for request in list(self._pending):
            request.finish()
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)

    def unlink(self) -> None:
        """Close the file and remove it (no error if it is already gone)."""
        self.close()
        self.path.unlink(missing_ok=True)

    def __enter__(self) -> SwapFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.fd < 0 else f"fd={self.fd}"
        return f"SwapFile({str(self.path)!r}, nbytes={self.nbytes}, direct={self.direct}, {state})"


def _fallocate_message(path: Path, size: int, e: OSError) -> str:
    msg = f"cannot preallocate {size} bytes ({size / (1 << 30):.2f} GiB) for swap file {path}"
    if e.errno != errno.ENOSPC:
        return f"{msg}: {e.strerror}"
    try:
        st = os.statvfs(path)
        return f"{msg}: no space left on device ({st.f_bavail * st.f_frsize} bytes free there)"
    except OSError:
        return f"{msg}: no space left on device"


def _reopen_direct(path: Path, fd: int) -> tuple[int, bool]:
    """(an O_DIRECT descriptor of ``path`` replacing ``fd``, True), or (``fd``, False) when the
    filesystem (tmpfs before Linux 6.6) or the platform refuses O_DIRECT: buffered I/O."""
    o_direct = getattr(os, "O_DIRECT", 0)
    if not o_direct:
        return fd, False
    try:
        dfd = os.open(path, os.O_RDWR | os.O_CLOEXEC | o_direct)
    except OSError as e:
        if e.errno in (errno.EINVAL, errno.EOPNOTSUPP):
            return fd, False
        raise OSError(
            e.errno, f"cannot open swap file {path} for direct I/O: {e.strerror}"
        ) from None
    os.close(fd)
    return dfd, True


# ------------------------------------------------------------------------------------------------
# Requests and the engine
# ------------------------------------------------------------------------------------------------


class _Handle(Protocol):
    def done(self) -> bool: ...

    def wait(self) -> None: ...


class _CHandle:
    """A request of the compiled module (its id)."""

    __slots__ = ("id",)

    def __init__(self, request_id: int) -> None:
        self.id = request_id

    def done(self) -> bool:
        return bool(_C.done(self.id))

    def wait(self) -> None:
        _C.wait(self.id)


class _PyHandle:
    """A request of the Python fallback: one future per piece."""

    __slots__ = ("futures", "failed")

    def __init__(self) -> None:
        self.futures: list[concurrent.futures.Future[None]] = []
        self.failed = False  # once set, unstarted pieces are skipped

    def done(self) -> bool:
        return all(f.done() for f in self.futures)

    def wait(self) -> None:
        concurrent.futures.wait(self.futures)
        for f in self.futures:  # the first failing piece's error
            e = f.exception()
            if e is not None:
                raise e


def _py_piece(handle: _PyHandle, fd: int, addr: int, length: int, at: int, write: bool) -> None:
    """One piece of the fallback: a pread/pwrite loop (short transfers; EINTR is retried by
    Python itself), the twin of run_piece in csrc/aio.cpp, with the same error messages."""
    if handle.failed:
        return
    view = memoryview((ctypes.c_char * length).from_address(addr)).cast("B")
    op = "pwrite" if write else "pread"
    done = 0
    while done < length:
        pos = at + done
        try:
            if write:
                n = os.pwritev(fd, [view[done:]], pos)
            else:
                n = os.preadv(fd, [view[done:]], pos)
        except OSError as e:
            # O_DIRECT: a read cut short by the end of the file leaves an unaligned position,
            # and the retry fails with EINVAL instead of returning 0: an end of file too.
            eof = not write and e.errno == errno.EINVAL and done > 0
            if not (eof and os.fstat(fd).st_size <= pos):
                handle.failed = True
                raise OSError(
                    e.errno, f"{e.strerror} ({op} of {length} bytes at file offset {at})"
                ) from None
            n = 0
        if n == 0:
            handle.failed = True
            if write:  # a pwrite of a nonzero count that writes nothing
                raise OSError(
                    errno.EIO,
                    f"{os.strerror(errno.EIO)} ({op} of {length} bytes at file offset {at})",
                )
            raise OSError(
                errno.EIO,
                f"unexpected end of file: read {done} of {length} bytes at file offset {at}",
            )
        done += n


class Request:
    """A submitted read or write: :meth:`done` polls, :meth:`wait` blocks until every piece is
    done and raises the first error as an OSError naming the file, the offset, the byte count and
    the operation (again on every later call). A request dropped without a wait is waited for by
    its finaliser, so its buffer is never freed under the I/O."""

    __slots__ = (
        "file",
        "op",
        "offset",
        "nbytes",
        "_buf",
        "_handle",
        "_lock",
        "_finished",
        "_error",
        "__weakref__",
    )

    def __init__(
        self, file: SwapFile, op: str, offset: int, nbytes: int, buf: torch.Tensor, handle: _Handle
    ) -> None:
        self.file = file
        self.op = op
        self.offset = offset
        self.nbytes = nbytes
        self._buf: torch.Tensor | None = buf
        self._handle = handle
        self._lock = threading.Lock()
        self._finished = False
        self._error: tuple[int, str] | None = None
        file.track(self)

    def done(self) -> bool:
        if self._finished:
            return True
        try:
            return self._handle.done()
        except ValueError:  # its id was consumed by a wait() in another thread: it is done
            return True

    def wait(self) -> None:
        self.finish()
        if self._error is not None:
            raise OSError(*self._error)

    def finish(self) -> None:
        """Wait for the I/O and record the outcome; never raises."""
        if self._finished:
            return
        with self._lock:
            if self._finished:
                return
            trace = tracer()
            began = trace.waiting(self) if trace is not None else None
            try:
                self._handle.wait()
                if trace is not None:
                    trace.finished(self, began)
            except OSError as e:
                self._error = (
                    e.errno if e.errno is not None else errno.EIO,
                    f"{self.op} of {self.nbytes} bytes at offset {self.offset} of swap file "
                    f"{self.file.path} failed: {e.strerror or e}",
                )
            except BaseException:  # interrupted (KeyboardInterrupt) while the I/O still runs:
                # not finished, so the buffer stays owned; a later wait waits again
                raise
            self._finished = True
            self._buf = None
            self.file.untrack(self)

    def __del__(self) -> None:
        try:
            self.finish()
        except Exception:  # interpreter shutdown
            pass

    def __repr__(self) -> str:
        state = "failed" if self._error else "done" if self._finished else "in flight"
        return (
            f"Request({self.op}, {str(self.file.path)!r}, offset={self.offset}, "
            f"nbytes={self.nbytes}, {state})"
        )


def _aio_mode() -> str:
    mode = os.environ.get(_AIO_ENV, "auto").strip().lower() or "auto"
    if mode not in ("auto", "cpp", "python"):
        raise ValueError(f"{_AIO_ENV} must be one of auto, cpp, python; got {mode!r}")
    return mode


def _warn_fallback_once() -> None:
    global _fallback_warned
    if not _fallback_warned:
        _fallback_warned = True
        warnings.warn(
            "zero_offload NVMe offload: the compiled I/O module zero_offload._aio is unavailable "
            f"({_IMPORT_ERROR}); using Python threads (os.preadv/os.pwritev) instead. Reinstall "
            "with a C++17 compiler (pip install -e .) to build it.",
            RuntimeWarning,
            stacklevel=3,
        )


class AioEngine:
    """Reads and writes of CPU buffers in swap files, split into ``policy.block_size`` pieces
    run by ``policy.workers`` threads. ``backend``: ``"pthreads"`` or ``"python-threads"``
    (chosen at construction from ZERO_OFFLOAD_AIO and the compiled module's presence). Several
    Python threads may submit and wait at once. The C++ pools are process-wide, one per thread
    count: engines with the same ``threads`` share one."""

    def __init__(self, policy: AioPolicy | None = None) -> None:
        self.policy = policy if policy is not None else AioPolicy()
        mode = _aio_mode()
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        if mode == "cpp" and _C is None:
            raise RuntimeError(
                f"{_AIO_ENV}=cpp but the compiled module zero_offload._aio is unavailable "
                f"({_IMPORT_ERROR})"
            )
        if mode == "python" or _C is None:
            if mode == "auto":
                _warn_fallback_once()
            self.backend = "python-threads"
            self._pool = concurrent.futures.ThreadPoolExecutor(
                self.policy.workers, thread_name_prefix="zero_offload_aio"
            )
        else:
            self.backend = "pthreads"

    def read(self, f: SwapFile, offset: int, buf: torch.Tensor, urgent: bool = False) -> Request:
        """Read ``buf``'s bytes from ``f`` at ``offset`` into ``buf``. ``urgent``: its pieces go
        to the disk before every queued normal request's (a read the computation waits for,
        e.g. a param fetch queued behind the optimizer state's read-ahead); the compiled
        backend only (the fallback's queue is first come, first served)."""
        return self._submit(f, offset, buf, False, urgent)

    def write(self, f: SwapFile, offset: int, buf: torch.Tensor) -> Request:
        """Write ``buf``'s bytes to ``f`` at ``offset``."""
        return self._submit(f, offset, buf, True)

    def close(self) -> None:
        """Stop the fallback's threads (after the requests in flight); the C++ pools persist."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    def _submit(
        self, f: SwapFile, offset: int, buf: torch.Tensor, write: bool, urgent: bool = False
    ) -> Request:
        op = "write" if write else "read"
        nbytes = _validate(f, offset, buf, op)
        addr = buf.data_ptr()
        block = self.policy.block_size
        if f.direct:
            block = _round_up(block)  # every piece of a direct request stays aligned
        if self._pool is None:
            how = (f.fd, addr, nbytes, offset, write, block, self.policy.workers)
            if urgent and _URGENT:
                how += (True,)
            handle: _Handle = _CHandle(_C.submit(*how))
        else:
            py = _PyHandle()
            for start in range(0, nbytes, block):
                length = min(block, nbytes - start)
                py.futures.append(
                    self._pool.submit(
                        _py_piece, py, f.fd, addr + start, length, offset + start, write
                    )
                )
            handle = py
        request = Request(f, op, offset, nbytes, buf, handle)
        trace = tracer()
        if trace is not None:  # ZERO_OFFLOAD_NVME_TRACE: the timeline of every request
            trace.submitted(request)
        return request


def _validate(f: SwapFile, offset: int, buf: torch.Tensor, op: str) -> int:
    """The request's byte count, once its arguments are checked (ValueError otherwise)."""
    if not isinstance(f, SwapFile):
        raise ValueError(f"aio {op}: expected a SwapFile, got {type(f).__name__}")
    if f.fd < 0:
        raise ValueError(f"aio {op}: swap file {f.path} is closed")
    if not isinstance(buf, torch.Tensor):
        raise ValueError(f"aio {op}: buf must be a torch.Tensor, got {type(buf).__name__}")
    if not buf.is_cpu:
        raise ValueError(f"aio {op}: buf must be a CPU tensor, got device {buf.device}")
    if not buf.is_contiguous():
        raise ValueError(f"aio {op}: buf must be contiguous")
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
        raise ValueError(f"aio {op}: offset must be an int >= 0, got {offset!r}")
    nbytes = buf.numel() * buf.element_size()
    if offset + nbytes > f.nbytes:
        raise ValueError(
            f"aio {op} of {nbytes} bytes at offset {offset} goes past the end of swap file "
            f"{f.path} ({f.nbytes} bytes)"
        )
    if f.direct:
        bad = []
        if buf.data_ptr() % ALIGN:
            bad.append(f"buffer address {buf.data_ptr():#x}")
        if nbytes % ALIGN:
            bad.append(f"byte count {nbytes}")
        if offset % ALIGN:
            bad.append(f"file offset {offset}")
        if bad:
            raise ValueError(
                f"aio {op} on swap file {f.path} (direct I/O): {', '.join(bad)} not a multiple "
                f"of {ALIGN}; use aligned_empty() buffers and {ALIGN}-byte offsets and sizes"
            )
    return nbytes


# ------------------------------------------------------------------------------------------------
# Disk bandwidth
# ------------------------------------------------------------------------------------------------


def _baseline(fd: int, view: memoryview, write: bool) -> None:
    """Sequential single-threaded pread/pwrite in 1 MiB blocks (like ``dd oflag=direct``)."""
    pos, total = 0, len(view)
    while pos < total:
        chunk = view[pos : min(total, pos + _BASELINE_BLOCK)]
        n = os.pwritev(fd, [chunk], pos) if write else os.preadv(fd, [chunk], pos)
        if n <= 0:
            raise OSError(errno.EIO, f"baseline {'write' if write else 'read'} stopped at {pos}")
        pos += n


def measure_disk_bandwidth(path: Path, nbytes: int, policy: AioPolicy) -> dict[str, Any]:
    """Write then read a scratch file of ``nbytes`` (rounded up to ALIGN) at ``path`` (a file
    name, or a directory to put it in) with an :class:`AioEngine` of ``policy``, and with plain
    sequential single-threaded pread/pwrite in 1 MiB blocks (the disk's baseline); returns GB/s
    (1e9 bytes/s; writes include an fdatasync, and overwrite: an untimed pass writes the file
    first) for each, and removes the scratch file. With a
    buffered file (``direct`` False) the numbers are the page cache's, not the disk's."""
    path = Path(path)
    if path.is_dir():
        path = path / f".zero_offload_aio_bench.{os.getpid()}"
    nbytes = _round_up(nbytes)
    buf = aligned_empty(nbytes)
    buf.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8))
    checksum = int(buf.view(torch.int64).sum())
    view = memoryview((ctypes.c_char * nbytes).from_address(buf.data_ptr())).cast("B")
    engine = AioEngine(policy)
    result: dict[str, Any] = {"path": str(path), "nbytes": nbytes, "backend": engine.backend}
    result.update(threads=policy.threads, queue_depth=policy.queue_depth)
    result.update(workers=policy.workers, block_size=policy.block_size)
    f = SwapFile.create(path, nbytes)
    try:
        result["direct"] = f.direct

        def timed(fn: Any) -> float:
            t0 = time.perf_counter()
            fn()
            return nbytes / 1e9 / max(time.perf_counter() - t0, 1e-9)

        def baseline_write() -> None:
            _baseline(f.fd, view, True)
            os.fdatasync(f.fd)

        def engine_write() -> None:
            engine.write(f, 0, buf).wait()
            os.fdatasync(f.fd)

        # Untimed first pass: the first write of a preallocated extent converts it from
        # "unwritten" (ext4, xfs), which costs whichever pass comes first. Swap files are
        # overwritten in steady state, so both timed passes overwrite.
        baseline_write()
        result["baseline_write_gbps"] = timed(baseline_write)
        result["baseline_read_gbps"] = timed(lambda: _baseline(f.fd, view, False))
        result["write_gbps"] = timed(engine_write)
        buf.zero_()
        result["read_gbps"] = timed(lambda: engine.read(f, 0, buf).wait())
        result["verified"] = int(buf.view(torch.int64).sum()) == checksum
    finally:
        engine.close()
        f.unlink()
    result["io_uring_available"] = io_uring_available()
    return result
