"""CUDA streams of the engine, and their no-op stand-ins on the CPU.

Ordering contract (CUDA): the reduce stream waits on the compute stream before a bucket is
reduced; the d2h stream waits on the reduce stream's event before copying a reduced segment to the
host; the compute stream waits on the reduce stream at the end of backward; the host waits on the
d2h event before it reads a host gradient. On the CPU every operation is synchronous in program
order, so every wait is a no-op.
"""

from __future__ import annotations

import contextlib

import torch


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
    caller falls back to pageable memory, warned once by ``pin_failed``."""
    if pin:
        try:
            return torch.empty(numel, dtype=dtype, pin_memory=True)
        except RuntimeError as e:  # no CUDA, or the pinned allocation was refused
            pin_failed(str(e))
    return torch.empty(numel, dtype=dtype)


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
