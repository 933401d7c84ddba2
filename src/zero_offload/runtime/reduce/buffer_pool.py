"""The reduce buffers kept for the run: at most ``keep`` (two) device buffers, reused bucket
after bucket, so a backward neither allocates nor frees a buffer per bucket.

A request of ``n`` elements gets a view ``base[:n]`` of a free base at least that large. While
fewer than ``keep`` bases exist, a request no free base fits creates one of exactly its size, and
a free base too small for a request is replaced by one that fits: the bases grow to the largest
request (never above ``reduce_bucket_size``: no request is larger) within the first backward and
then stay. A request beyond ``keep`` bases in use (the first backward, before the launch order
is learned, can fill a third bucket) gets a temporary that is freed after its collective.

Invariant (CUDA): a base is handed out again only after every stream that read it finished:
``give`` records an event on each of them (the reduce stream that reduced it, the d2h stream
that copied the result to the host) and ``take`` makes the taking stream wait on them.
"""

from __future__ import annotations

import torch

from ...core import host_memory


class BufferPool:
    def __init__(self, keep: int = 2) -> None:
        self.keep = keep
        self.bases: list[torch.Tensor] = []  # owned for the run, in use or free
        self.free: list[tuple[torch.Tensor, list]] = []  # (base, events its reuse waits on)

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.bases)

    def owns(self, buf: torch.Tensor) -> bool:
        return any(buf._base is b for b in self.bases)

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A buffer of ``numel`` elements whose contents are undefined (the caller writes or
        zeroes what it reduces)."""
        fits = [k for k, (b, _) in enumerate(self.free) if _fits(b, numel, dtype, device)]
        if fits:
            k = min(fits, key=lambda k: self.free[k][0].numel())  # the smallest that fits
            base, events = self.free.pop(k)
            _wait(events)
            return base[:numel]
        if len(self.bases) >= self.keep and self.free:  # a free base too small: replace it
            base, events = self.free.pop(0)
            _wait(events)  # its last readers finish before its memory can be reused
            if base.is_cuda:  # the allocator recycles it only after this stream gets here
                base.record_stream(torch.cuda.current_stream())
            self.bases = [b for b in self.bases if b is not base]
        if len(self.bases) < self.keep:
            base = torch.empty(numel, dtype=dtype, device=device)
            self.bases.append(base)
            return base[:numel]
        # beyond the pool: a temporary (on a CPU a mapping of its own: core/host_memory.py)
        return host_memory.empty(numel, dtype, device)

    def give(self, buf: torch.Tensor, readers: list) -> None:
        """``buf`` (a view of a base) is free again once the work queued so far on ``readers``
        (streams; none on the CPU) is done."""
        base = buf._base
        events = []
        for stream in readers:
            ev = torch.cuda.Event()
            ev.record(stream)
            events.append(ev)
        self.free.append((base, events))

    def reset(self) -> None:
        """Everything is quiet (an abandoned backward waited for its collectives): every base
        is free; those already free keep the events they wait on."""
        free = {id(b) for b, _ in self.free}
        self.free += [(b, []) for b in self.bases if id(b) not in free]


def _fits(base: torch.Tensor, numel: int, dtype: torch.dtype, device: torch.device) -> bool:
    return base.numel() >= numel and base.dtype == dtype and base.device == device


def _wait(events: list) -> None:
    for ev in events:
        torch.cuda.current_stream().wait_event(ev)
