"""One warning when offload runs on CUDA from pageable host memory.

A copy between the device and pageable memory is synchronous for the host (the driver stages it
through its own pinned buffer): the backward hooks' gradient copies then stall the backward, and
the uploads stop overlapping the host update. That is what ``pin_memory: false`` asks for, but
it is slow without a word; the warning names the key. Pinning that fails is warned by
``core.streams.pin_failed`` instead.
"""

from __future__ import annotations

import warnings

import torch

_warned = False


def unpinned_keys(zc) -> list[str]:
    """The offload sections of ``zero_optimization`` that put states on the host unpinned."""
    out = []
    for key in ("offload_optimizer", "offload_param"):
        section = getattr(zc, key, None)
        if section is None:
            continue
        device = str(getattr(section.device, "value", section.device))  # enum or str
        if device in ("cpu", "nvme") and not section.pin_memory:
            out.append(f"zero_optimization.{key}.pin_memory")
    return out


def warn_unpinned(device: torch.device, keys: list[str]) -> bool:
    """Warn once per process when ``device`` is CUDA and ``keys`` name unpinned offload;
    returns whether it warned now."""
    global _warned
    if _warned or device.type != "cuda" or not keys:
        return False
    warnings.warn(
        f"offload on CUDA from pageable host memory ({', '.join(keys)} is false): every "
        "host<->device copy is synchronous, so gradient copies stall the backward and uploads "
        "do not overlap the host update; set it true unless pinning is refused here",
        stacklevel=3,
    )
    _warned = True
    return True
