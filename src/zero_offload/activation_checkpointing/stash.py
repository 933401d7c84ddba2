"""Where a checkpoint keeps its inputs until the recompute: on the device as they are, or
(``cpu_checkpointing``) in host memory, pinned and copied without blocking the host on CUDA,
then copied back for the recompute (inputs of 64 MiB or more in buffers kept across steps:
``host_buffers``). Either way the bytes are counted (``memory.COUNTERS``) from
the forward until the checkpoint's graph is freed (its backward ran, or it was dropped)."""

from __future__ import annotations

import weakref

import torch

from ..core.pinned_bytes import host_bytes
from ..core.streams import alloc_host
from .host_buffers import HOST_BUFFERS
from .memory import COUNTERS


def is_kept(item: object) -> bool:
    """DeepSpeed's rule for what a checkpoint moves: floating-point tensors."""
    return isinstance(item, torch.Tensor) and item.is_floating_point()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _on_host(t: torch.Tensor) -> bool:
    return t.device.type == "cpu"


def _to_host(t: torch.Tensor, pooled: list[torch.Tensor]) -> torch.Tensor:
    """``t``'s copy in host memory; a buffer taken from ``HOST_BUFFERS`` is appended to
    ``pooled`` (the stash gives it back when it is freed)."""
    if _on_host(t):
        return t.detach()  # the CPU is the host: nothing to move
    nbytes = _nbytes(t)
    if HOST_BUFFERS.pooled(nbytes):
        buf = HOST_BUFFERS.take(nbytes)
        pooled.append(buf)
        host = buf.view(t.dtype).view(t.shape)
    else:
        host = alloc_host(t.numel(), t.dtype, pin=True).view(t.shape)
    # Same stream as the producer: the device tensor may be freed by the caller at once (the
    # allocator orders its reuse after this copy); the host does not wait for it.
    host.copy_(t, non_blocking=host.is_pinned())
    return host


def _last_use() -> object:
    """An event after the work queued so far on the current stream (None on the CPU)."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    event = torch.cuda.Event()
    event.record()
    return event


class Stash:
    """The arguments of one checkpoint, kept for its recompute: tensors detached (no graph is
    held), floating-point ones on the device or in host memory, with their ``requires_grad``."""

    def __init__(self, args: tuple, to_host: bool) -> None:
        self.to_host = to_host
        self.place = "host" if to_host else "device"
        self.flags = [isinstance(a, torch.Tensor) and a.requires_grad for a in args]
        self.devices = [a.device if is_kept(a) else None for a in args]
        pooled: list[torch.Tensor] = []
        self.kept = [
            (_to_host(a, pooled) if to_host else a.detach()) if is_kept(a) else a for a in args
        ]
        # the pooled buffers' last use, updated after each copy from or to them
        self._last = [_last_use() if pooled else None]
        self.nbytes = sum(_nbytes(a) for a in args if is_kept(a))
        # what the kept copies reserve where they wait (pinned host copies: the allocator's)
        held = (
            sum(host_bytes(k) for k, a in zip(self.kept, args) if is_kept(a))
            if to_host
            else self.nbytes
        )
        # Device bytes brought back for the recompute, in a list the finalizer can read once
        # this object is gone (the finalizer must not hold ``self``).
        self._back = [0]
        COUNTERS.add(self.place, held)
        weakref.finalize(self, _release, self.place, held, self._back, pooled, self._last)

    def restore(self) -> list:
        """The arguments for the recompute: on their devices again (copied from the host with
        ``cpu_checkpointing``, then counted as device bytes until this stash is freed), each
        tensor a new leaf with its argument's ``requires_grad``, so the recompute's ops save
        what the forward's saved and the argument's gradient can be read off it."""
        out = []
        for item, device, flag in zip(self.kept, self.devices, self.flags):
            if self.to_host and device is not None:
                item = item.to(device, non_blocking=item.is_pinned())
            if isinstance(item, torch.Tensor):
                item = item.detach().requires_grad_(flag)
            out.append(item)
        if self._last[0] is not None:
            self._last[0] = _last_use()
        if self.to_host and not self._back[0]:  # a second backward reuses the first's count
            self._back[0] = self.nbytes
            COUNTERS.add("device", self.nbytes)
        return out


def _release(
    place: str, nbytes: int, back: list[int], pooled: list[torch.Tensor], last: list
) -> None:
    COUNTERS.remove(place, nbytes)
    for buf in pooled:
        HOST_BUFFERS.give(buf, last[0])
    if back[0]:
        COUNTERS.remove("device", back[0])
