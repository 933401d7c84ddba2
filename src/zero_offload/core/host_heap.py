"""What the host's C allocator holds beyond the live tensors: its own named memory term.

PyTorch's CPU tensors come from ``malloc``. On glibc a freed block below the mmap threshold
(which rises to 32 MiB as soon as large blocks are freed) stays in malloc's heap, resident,
for reuse; a freed mmapped block goes back to the system at once. A training process frees
much in mid-sized blocks (a module's gathered params and gradients, the model as loaded before
it was partitioned), so its resident size carries that free heap on top of every accounted
term: at a 220M Llama, stage 3 with both offloads on one rank, about 0.9 GiB after set-up.

Invariants: ``free_bytes`` reads malloc's own count (``mallinfo2().fordblks``: bytes in free
heap chunks, resident or not) and changes nothing; ``release`` hands the heaps' free pages
back (``malloc_trim``), which later allocations fault in again; on a C library without these
calls (musl, macOS) both are no-ops and ``free_bytes`` is None.
"""

from __future__ import annotations

import ctypes
import functools


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd",
            "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost",
        )
    ]  # fmt: skip


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    try:
        lib = ctypes.CDLL("libc.so.6")
        lib.mallinfo2.restype = _Mallinfo2
        lib.malloc_trim.argtypes = [ctypes.c_size_t]
        return lib
    except (OSError, AttributeError):  # not glibc, or one older than 2.33
        return None


def free_bytes() -> int | None:
    """Bytes in malloc's heaps that no allocation uses (None where that cannot be read)."""
    lib = _glibc()
    return None if lib is None else int(lib.mallinfo2().fordblks)


def release() -> None:
    """Return the heaps' free pages to the system: after a phase that freed much at once
    (loading a model, partitioning it, building the engine)."""
    lib = _glibc()
    if lib is not None:
        lib.malloc_trim(0)


class HeapPeak:
    """The most free heap seen at the samples (``sample`` after each backward and step)."""

    def __init__(self) -> None:
        self.peak = 0

    def sample(self) -> None:
        held = free_bytes()
        if held is not None and held > self.peak:
            self.peak = held

    def reset(self) -> None:
        self.peak = 0
