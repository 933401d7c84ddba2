"""The host bytes a buffer really reserves: what ``peak.host.*``, the components' ``nbytes()``
and the NVMe param cache's ``max_in_cpu`` bound count.

Every pinned host buffer of the project comes from ``streams.alloc_host``, one of two ways:

- at least ``REGISTER_MIN_BYTES``: a pageable buffer page-locked in place
  (cudaHostRegister), which reserves its exact size (``registered`` records its address);
- smaller: torch's caching host allocator, which rounds every request up to the next power of
  two (``CachingHostAllocator``: ``PowerOf2Ceil(size)`` under its ``pinned_max_round_threshold``
  and ``pinned_max_cached_size``, unbounded by default) and keeps the block for reuse.

Pageable buffers (the CPU, where nothing is pinned) count their tensor's bytes, as before.
"""

from __future__ import annotations

import torch

# Pinned buffers at least this large are registered in place (cudaHostRegister) instead of
# taken from the caching host allocator, which rounds every request up to a power of two: a
# 12 GB host gradient shard would pin 16 GB. Smaller ones keep the allocator (and its reuse).
REGISTER_MIN_BYTES = 64 << 20
_REGISTERED: set[int] = set()  # data_ptr of every live registered buffer


def cached_bytes(nbytes: int) -> int:
    """What the caching host allocator reserves for a request of ``nbytes``: the next power of
    two (0 for 0)."""
    return 0 if nbytes <= 0 else 1 << (nbytes - 1).bit_length()


def reserved(nbytes: int, pinned: bool) -> int:
    """The bytes a host buffer of ``nbytes`` reserves: ``nbytes`` pageable or registered
    (pinned, at least ``REGISTER_MIN_BYTES``), else the caching allocator's power of two."""
    if not pinned or nbytes >= REGISTER_MIN_BYTES:
        return nbytes
    return cached_bytes(nbytes)


def note_registered(t: torch.Tensor) -> None:
    _REGISTERED.add(t.data_ptr())


def note_unregistered(ptr: int) -> None:
    _REGISTERED.discard(ptr)


def is_registered(t: torch.Tensor) -> bool:
    return t.data_ptr() in _REGISTERED


def host_bytes(t: torch.Tensor) -> int:
    """The host bytes ``t`` (a buffer from ``alloc_host`` or ``aio.aligned_empty``) reserves:
    its own bytes unless it is pinned by the caching allocator, then its allocation's (the
    storage's, which an aligned view may start inside) power of two."""
    own = t.numel() * t.element_size()
    # Nothing is pinned before CUDA is initialized; asking first would make a context (on
    # GPU 0) for a process that trains on the CPU.
    if t.device.type != "cpu" or not torch.cuda.is_initialized():
        return own
    if not t.is_pinned() or is_registered(t):
        return own
    return cached_bytes(t.untyped_storage().nbytes())
