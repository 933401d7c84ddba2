"""Host buffers of ``cpu_checkpointing`` kept across steps. A checkpoint's input of at least
``REGISTER_MIN_BYTES`` is copied into a buffer page-locked in place (cudaHostRegister, through
``streams.alloc_host``); registering costs a page walk, and unregistering a device-wide
synchronize. Freed with its stash, such a buffer would be registered and unregistered again every
step; here it goes back to a free list by its exact size instead, and the next step's checkpoint
of the same size takes it: each size is registered once per process (as many buffers as were
live at once), never unregistered while the process trains.

Invariant: a buffer is reused only after the device work that read or wrote it for its last
stash finished, in stream order: the stash records an event after its last copy (to the host in
the forward, back to the device for the recompute), and ``take`` makes the current stream wait
for it; the host itself never reads or writes these buffers. Smaller inputs keep torch's caching
host allocator, which reuses its blocks the same way."""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from ..core import streams
from ..core.pinned_bytes import REGISTER_MIN_BYTES

Alloc = Callable[[int, torch.dtype, bool], torch.Tensor]


class HostBuffers:
    """Free lists of uint8 host buffers by exact byte size, each with the event its last use
    recorded (None on the CPU)."""

    def __init__(self, min_bytes: int = REGISTER_MIN_BYTES, alloc: Alloc | None = None) -> None:
        self.min_bytes = min_bytes
        self._alloc = alloc
        self._free: dict[int, list[tuple[torch.Tensor, torch.cuda.Event | None]]] = {}
        self._lock = threading.Lock()  # a stash is freed on whichever thread drops it
        self.allocated = 0  # buffers made (each registered once where CUDA pins it)

    def pooled(self, nbytes: int) -> bool:
        """Whether a buffer of ``nbytes`` comes from (and goes back to) this pool."""
        return nbytes >= self.min_bytes

    def take(self, nbytes: int) -> torch.Tensor:
        """A pinned host buffer of exactly ``nbytes`` (uint8): a freed one of that size, once the
        current stream waits for its last use, else a new one."""
        with self._lock:
            free = self._free.get(nbytes)
            item = free.pop() if free else None
        if item is not None:
            buf, event = item
            if event is not None:
                torch.cuda.current_stream().wait_event(event)
            return buf
        alloc = self._alloc or streams.alloc_host
        self.allocated += 1
        return alloc(nbytes, torch.uint8, True)

    def give(self, buf: torch.Tensor, event: torch.cuda.Event | None) -> None:
        """``buf`` free again once ``event`` (its last use) has completed."""
        with self._lock:
            self._free.setdefault(buf.numel(), []).append((buf, event))

    def clear(self) -> None:
        """Drop every free buffer (each is unregistered as it is collected)."""
        with self._lock:
            self._free.clear()

    def free_bytes(self) -> int:
        with self._lock:
            return sum(n * len(v) for n, v in self._free.items())


HOST_BUFFERS = HostBuffers()
