"""Where a checkpoint keeps its inputs until the recompute: on the device as they are, or
(``cpu_checkpointing``) in host memory, pinned and copied without blocking the host on CUDA,
then copied back for the recompute. Either way the bytes are counted (``memory.COUNTERS``) from
the forward until the checkpoint's graph is freed (its backward ran, or it was dropped)."""

from __future__ import annotations

import weakref

import torch

from ..core.streams import alloc_host
from .memory import COUNTERS


def is_kept(item: object) -> bool:
    """DeepSpeed's rule for what a checkpoint moves: floating-point tensors."""
    return isinstance(item, torch.Tensor) and item.is_floating_point()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _to_host(t: torch.Tensor) -> torch.Tensor:
    if t.device.type == "cpu":
        return t  # the CPU is the host: nothing to move
    host = alloc_host(t.numel(), t.dtype, pin=True).view(t.shape)
    # Same stream as the producer: the device tensor may be freed by the caller at once (the
    # allocator orders its reuse after this copy); the host does not wait for it.
    host.copy_(t, non_blocking=host.is_pinned())
    return host


class Stash:
    """The tensors of one checkpoint's arguments, kept for its recompute."""

    def __init__(self, args: tuple, to_host: bool) -> None:
        self.to_host = to_host
        self.place = "host" if to_host else "device"
        self.devices = [a.device if is_kept(a) else None for a in args]
        self.kept = [(_to_host(a) if to_host else a) if is_kept(a) else a for a in args]
        self.nbytes = sum(_nbytes(a) for a in args if is_kept(a))
        # Device bytes brought back for the recompute, in a list the finalizer can read once
        # this object is gone (the finalizer must not hold ``self``).
        self._back = [0]
        COUNTERS.add(self.place, self.nbytes)
        weakref.finalize(self, _release, self.place, self.nbytes, self._back)

    def restore(self) -> list:
        """The arguments on their devices again (copied from the host with ``cpu_checkpointing``),
        counted as device bytes until this stash is released."""
        if not self.to_host:
            return list(self.kept)
        out = []
        for item, device in zip(self.kept, self.devices):
            if device is None:
                out.append(item)
                continue
            out.append(item.to(device, non_blocking=item.is_pinned()))
        self._back[0] = self.nbytes
        COUNTERS.add("device", self.nbytes)
        return out


def _release(place: str, nbytes: int, back: list[int]) -> None:
    COUNTERS.remove(place, nbytes)
    if back[0]:
        COUNTERS.remove("device", back[0])
