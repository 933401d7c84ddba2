"""Compute kernels of zero_offload: the host (CPU) Adam update of the offloaded optimizer.

The public names are imported lazily, so that importing a submodule that does not need torch
(e.g. the benchmark's argument parser) does not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["default_threads", "host_adam_step", "kernel_info", "reference_adam_step"]

if TYPE_CHECKING:  # pragma: no cover
    from zero_offload.kernels.host_adam import (
        default_threads,
        host_adam_step,
        kernel_info,
        reference_adam_step,
    )


def __getattr__(name: str) -> Any:
    if name in __all__:
        from zero_offload.kernels import host_adam

        return getattr(host_adam, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
