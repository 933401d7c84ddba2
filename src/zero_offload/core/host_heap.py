"""What the host's C allocator holds beyond the live tensors: its own named memory term.

PyTorch's CPU tensors come from ``malloc``. On glibc a freed block below the mmap threshold
(which rises to 32 MiB as soon as large blocks are freed) stays in malloc's heap, resident,
for reuse; a freed mmapped block goes back to the system at once. A training process frees
much in mid-sized blocks (a module's gathered params and gradients, the model as loaded before
it was partitioned), so its resident size carries that free heap on top of every accounted
term: at a 220M Llama, stage 3 with both offloads on one rank, about 0.9 GiB after set-up.

A step's own transient buffers (the params each fetch reads or gathers, their gradients: 1 to
32 MiB each) are the larger share. glibc serves each by best fit from whatever its heap holds
free, so successive fetches land in different places and the resident free heap grows with the
model (with both offloads "nvme": 2.2 bytes a param, 4.7 GiB at 2.19B), not with any buffer
count of the config. ``fix_mmap_threshold`` ends that for a process whose step is bound by
the disk anyway: every block from ``NVME_MMAP_THRESHOLD`` up is mapped on its own and returned
when freed (a page fault per page of each new block; a disk-bound step is expected to hide it),
so the heap holds only small blocks. Fixing it must come before the set-up's first large allocation, or the
heap's holes from set-up serve the step's blocks all the same (glibc uses a free chunk that
fits before it maps a new one).

Invariants: ``free_bytes`` reads malloc's own count (``mallinfo2().fordblks``: bytes in free
heap chunks, resident or not) and changes nothing; ``release`` hands the heaps' free pages
back (``malloc_trim``), which later allocations fault in again; on a C library without these
calls (musl, macOS) both are no-ops and ``free_bytes`` is None.
"""

from __future__ import annotations

import ctypes
import functools

M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)
# Blocks from this size up are mapped on their own once ``fix_mmap_threshold`` ran: a layer's
# params and gradients at any width a model trains at, not an activation of a short sequence.
NVME_MMAP_THRESHOLD = 1 << 20


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
        lib.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
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


def fix_mmap_threshold(nbytes: int = NVME_MMAP_THRESHOLD) -> bool:
    """Map every allocation of at least ``nbytes`` on its own from now on, for the whole process
    (glibc's ``mallopt(M_MMAP_THRESHOLD)``, which also ends its dynamic threshold); whether it
    took effect (False without glibc)."""
    lib = _glibc()
    return lib is not None and bool(lib.mallopt(M_MMAP_THRESHOLD, nbytes))


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
