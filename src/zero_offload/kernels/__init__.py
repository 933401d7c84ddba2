"""Compute kernels of zero_offload: the host (CPU) Adam update of the offloaded optimizer, with
fp32 states (host_adam) or compact states (adam_states: bf16 master, bf16 or 8-bit moments).

The public names are imported lazily, so that importing a submodule that does not need torch
(e.g. the benchmark's argument parser) does not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

_STATES = (
    "QuantizedMoment",
    "StateOptions",
    "adam_step_states",
    "dequantize_moment",
    "quantize_moment",
    "reference_adam_step_states",
    "zeros_moment",
)
__all__ = [
    "QuantizedMoment",
    "StateOptions",
    "adam_step_states",
    "default_threads",
    "dequantize_moment",
    "host_adam_step",
    "kernel_info",
    "quantize_moment",
    "reference_adam_step",
    "reference_adam_step_states",
    "zeros_moment",
]

if TYPE_CHECKING:  # pragma: no cover
    from zero_offload.kernels.adam_states import (
        QuantizedMoment,
        StateOptions,
        adam_step_states,
        dequantize_moment,
        quantize_moment,
        reference_adam_step_states,
        zeros_moment,
    )
    from zero_offload.kernels.host_adam import (
        default_threads,
        host_adam_step,
        kernel_info,
        reference_adam_step,
    )


def __getattr__(name: str) -> Any:
    if name in _STATES:
        from zero_offload.kernels import adam_states

        return getattr(adam_states, name)
    if name in __all__:
        from zero_offload.kernels import host_adam

        return getattr(host_adam, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
