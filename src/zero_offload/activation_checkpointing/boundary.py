"""``synchronize_checkpoint_boundary`` and ``profile``: a checkpoint's forward or backward with
the device synchronized at both ends, and its time logged (rank 0)."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator

import torch

from ..core import dist as _dist
from .policy import CheckpointPolicy

log = logging.getLogger("zero_offload")


def _synchronize() -> None:
    if _dist.default_device().type == "cuda":
        torch.cuda.synchronize()


@contextlib.contextmanager
def boundary(policy: CheckpointPolicy, phase: str) -> Iterator[None]:
    """``phase``: "forward", "backward" or "recompute" (the name in the profile log)."""
    if not (policy.synchronize or policy.profile):
        yield
        return
    _synchronize()
    start = time.perf_counter()
    try:
        yield
    finally:  # torch's non-reentrant recompute ends early by raising once it has what it needs
        _synchronize()
        if policy.profile and _dist.rank() == 0:
            ms = (time.perf_counter() - start) * 1e3
            log.info("activation checkpoint %s: %.3f ms", phase, ms)
