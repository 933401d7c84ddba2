"""CUDA streams of the engine, and their no-op stand-ins on the CPU.

Ordering contract (CUDA): the reduce stream waits on the compute stream before a bucket is
reduced; the d2h stream waits on the reduce stream's event before copying a reduced segment to the
host; the compute stream waits on the reduce stream at the end of backward; the host waits on the
d2h event before it reads a host gradient. On the CPU every operation is synchronous in program
order, so every wait is a no-op.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import weakref

import torch

from . import host_memory, pinned_bytes
from .pinned_bytes import REGISTER_MIN_BYTES


class Streams:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.reduce = torch.cuda.Stream(device)
            self.d2h = torch.cuda.Stream(device)
            self.h2d = torch.cuda.Stream(device)
            self.fetch = torch.cuda.Stream(device)  # stage 3: param all-gathers (and their h2d)
        else:
            self.reduce = self.d2h = self.h2d = self.fetch = None

    def use(self, stream) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()

    def wait(self, waiter, waitee) -> None:
        """``waiter`` stream (None = current) waits for all work queued so far on ``waitee``."""
        if not self.cuda:
            return
        (waiter or torch.cuda.current_stream()).wait_stream(waitee or torch.cuda.current_stream())

    def record(self, stream=None):
        if not self.cuda:
            return None
        ev = torch.cuda.Event()
        ev.record(stream or torch.cuda.current_stream())
        return ev

    def keep_alive(self, t: torch.Tensor, stream) -> None:
        """Tell the caching allocator ``t`` is in use on ``stream`` (do not recycle it early)."""
        if self.cuda and stream is not None:
            t.record_stream(stream)


def alloc_host(numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """Host buffer; pinned when asked and possible. Pinning can fail (containers, WSL): the
    caller falls back to pageable memory, warned once by ``pin_failed``. Every pinned host
    buffer of the project comes from here; ``pinned_bytes.host_bytes`` counts what it
    reserves. None of it is ``malloc``'s from ``host_memory.MAP_MIN_BYTES`` up: pageable and
    registered buffers are mappings of their own, the caching host allocator's are
    ``cudaHostAlloc``'s (``core/host_memory.py``)."""
    if pin:
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if nbytes >= REGISTER_MIN_BYTES and torch.cuda.is_available():
            t = _registered(numel, dtype, nbytes)
            if t is not None:
                return t
        try:
            return torch.empty(numel, dtype=dtype, pin_memory=True)
        except RuntimeError as e:  # no CUDA, or the pinned allocation was refused
            pin_failed(str(e))
    return host_memory.host_pageable(numel, dtype)


def _registered(numel: int, dtype: torch.dtype, nbytes: int) -> torch.Tensor | None:
    """A page-aligned pageable buffer of exactly ``nbytes`` (a mapping of its own), page-locked with
    cudaHostRegister; None if registering fails (the caller then uses the caching allocator).

    Invariants: the pages are unregistered when the returned tensor object is collected, never
    after its memory is freed (the storage outlives the tensor object, views included), so the
    worst case is a buffer that stops being pinned while a view of it is still in use; the
    device is synchronized first, so no copy queued from or to it is still running. A failed
    registration leaves the CUDA runtime's last error set, which torch's next kernel-launch
    check would raise as its own: it is cleared, and without a way to clear it (a runtime
    linked statically) nothing is registered."""
    clear_error = _cuda_clear_error()
    if clear_error is None:
        return None
    t = host_memory.mapped(numel, dtype)  # page-aligned: its own mapping
    assert t.numel() == numel
    cudart = torch.cuda.cudart()
    device = torch.cuda.current_device()  # the context the pages are registered in
    err = cudart.cudaHostRegister(t.data_ptr(), nbytes, 0)
    if int(err) != 0:
        clear_error()
        return None
    pinned_bytes.note_registered(t)
    weakref.finalize(t, _unregister, t.data_ptr(), device)
    return t


def _unregister(ptr: int, device: int) -> None:
    """Runs on whichever thread drops the last reference (a worker, the collector, exit), whose
    current device may be GPU 0: synchronizing ``device`` by index makes no context elsewhere
    (a plain ``synchronize()`` on rank k > 0 made one on GPU 0)."""
    pinned_bytes.note_unregistered(ptr)
    try:
        torch.cuda.synchronize(device)  # no queued copy still reads or writes the pages
        with torch.cuda.device(device):
            torch.cuda.cudart().cudaHostUnregister(ptr)
    except RuntimeError:
        # CUDA already torn down (interpreter exit): nothing is running, and the pages go
        # with the process
        pass


@functools.cache
def _cuda_clear_error():
    """``cudaGetLastError`` of the CUDA runtime torch loaded (it reads and resets the last
    error), or None where that runtime is not a shared library of this process."""
    try:
        with open("/proc/self/maps") as f:
            paths = sorted({ln.split()[-1] for ln in f if "/libcudart.so" in ln})
    except OSError:
        return None
    if not paths:
        return None
    fn = ctypes.CDLL(paths[0]).cudaGetLastError
    fn.restype = ctypes.c_int
    return fn


def release_pinned_cache() -> bool:
    """Give the caching host allocator's unused pinned blocks back to the system (it keeps
    every freed block, rounded up to a power of two, for reuse); whether this torch can. For
    after set-up: ``zero.Init``'s pinned chunks, once the stage-3 store has copied them into its
    own shard, would otherwise stay pinned for the whole run."""
    fn = getattr(torch._C, "_accelerator_emptyHostCache", None) or getattr(
        torch._C, "_host_emptyCache", None
    )
    if fn is None:
        return False
    fn()
    return True


_warned = False


def pin_failed(reason: str) -> None:
    global _warned
    if not _warned:
        import warnings

        warnings.warn(
            f"pinned host memory unavailable ({reason.splitlines()[0]}); using pageable memory: "
            "host<->device copies will not overlap with compute",
            stacklevel=3,
        )
        _warned = True
