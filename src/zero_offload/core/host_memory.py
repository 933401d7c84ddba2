"""Where the engine's own large host buffers come from: anonymous memory maps, outside ``malloc``.

A CPU tensor from ``torch.empty`` comes from ``malloc``. glibc serves a block below its mmap
threshold from its heap, and that threshold is dynamic: freeing a mapped block of up to 32 MiB
raises it to that block's size. A training process frees such blocks every step (a module's
gathered params and gradients), so from the first step on every block up to 32 MiB, state or
transient, lands in the heap, and what the step frees stays resident there as free heap
(``core/host_heap.py``) for best-fit reuse by whatever comes next.

``empty`` keeps the engine's own buffers out of it: on the host, a request of at least
``MAP_MIN_BYTES`` is an anonymous private mapping of its own (``mmap``), viewed as a tensor
(``torch.frombuffer``) and unmapped when the last tensor viewing it is freed; smaller ones stay
with ``malloc``. Pinned host buffers (CUDA) come from ``streams.alloc_host``, which registers a
mapped buffer in place or takes torch's caching host allocator (``cudaHostAlloc``): both are
outside ``malloc`` as well. Every large host buffer of the engine is made here: the optimizer
state (master, moments), the host gradient shards, the 16-bit staging, the stage-3 param shards
and gathered buckets, the reduce buffers.

Invariants: a mapped buffer is page-aligned and zero-filled when made (the kernel's anonymous
pages), so ``zeros`` costs nothing beyond ``empty``; its pages are faulted in on first touch and
returned to the system when it is freed, never kept resident as free heap; ``is_mapped`` tells
such a buffer from any of ``malloc``'s blocks by the process's own memory map.
"""

from __future__ import annotations

import mmap

import torch

# Requests from this size up are mapped on their own: a layer's param or gradient bucket, never
# a scalar or a norm. Below it glibc keeps them in the heap, bounded by their small size.
MAP_MIN_BYTES = 1 << 20


def mapped(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A pageable CPU tensor of ``numel`` elements in an anonymous mapping of its own (zeros)."""
    nbytes = numel * _itemsize(dtype)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # frombuffer keeps ``buf`` alive with the storage; the mapping goes when the storage does.
    return torch.frombuffer(buf, dtype=torch.uint8, count=nbytes).view(dtype)


def empty(
    numel: int, dtype: torch.dtype, device: torch.device | str = "cpu", pin: bool = False
) -> torch.Tensor:
    """An uninitialised 1-D buffer of ``numel`` elements on ``device``: on the host outside
    ``malloc``'s heap from ``MAP_MIN_BYTES`` up (pinned there when ``pin`` and CUDA allows:
    ``streams.alloc_host``); on an accelerator, its caching allocator's."""
    if torch.device(device).type != "cpu":
        return torch.empty(numel, dtype=dtype, device=device)
    if pin:
        from .streams import alloc_host  # streams imports this module

        return alloc_host(numel, dtype, pin=True)
    return host_pageable(numel, dtype)


def zeros(
    numel: int, dtype: torch.dtype, device: torch.device | str = "cpu", pin: bool = False
) -> torch.Tensor:
    """``empty``, zero-filled (a fresh mapping is zeros already: no pass over it)."""
    if torch.device(device).type == "cpu" and not pin and maps(numel, dtype):
        return mapped(numel, dtype)
    return empty(numel, dtype, device, pin).zero_()


def host_pageable(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A pageable host buffer: mapped from ``MAP_MIN_BYTES`` up, else ``malloc``'s."""
    if maps(numel, dtype):
        return mapped(numel, dtype)
    return torch.empty(numel, dtype=dtype)


def is_mapped(t: torch.Tensor) -> bool:
    """Whether ``t``'s memory is a mapping of its own, not ``malloc``'s: its storage starts on a
    page boundary inside an anonymous mapping other than the main heap (``[heap]`` in
    ``/proc/self/maps``). A block of ``malloc``'s never starts on one: in the heap and in a
    mapped chunk alike a header precedes it (torch's 64-byte-aligned blocks start 64 bytes into
    a mapped chunk's page). Linux only (False where the map cannot be read)."""
    ptr = t.untyped_storage().data_ptr()
    if ptr % mmap.PAGESIZE:
        return False
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split()
                start, end = (int(x, 16) for x in fields[0].split("-"))
                if start <= ptr < end:
                    return len(fields) == 5  # anonymous, unnamed: not [heap], [stack], a file
    except OSError:
        pass
    return False


def maps(numel: int, dtype: torch.dtype) -> bool:
    """Whether a host request of ``numel`` ``dtype`` elements gets a mapping of its own."""
    return numel * _itemsize(dtype) >= MAP_MIN_BYTES


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
