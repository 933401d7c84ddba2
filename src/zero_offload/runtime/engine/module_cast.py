"""Moving a module to the engine's device and training dtype without touching buffer precision.

``module.to(dtype)`` casts floating buffers too. DeepSpeed casts only parameters (its engine
calls ``module.half()``/``bfloat16()`` on params through its own path and keeps buffers such as a
Llama's rotary ``inv_freq`` in fp32); a bf16 ``inv_freq`` is off by ~4e-3 relative, which puts
the rotary angle 0.37 rad off at position 2047. So: params get the training dtype, buffers only
move device and keep their own dtype, unless ``data_types.buffer_dtype`` asks for one
(``cast_buffers_``).
"""

from __future__ import annotations

import torch


def cast_params_(module: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """In place: every floating parameter to ``(device, dtype)``; every buffer to ``device`` only.

    Invariants: parameter objects keep their identity (optimizer groups built before the call
    still point at them); integer/bool parameters move device but keep their dtype; buffers keep
    their dtype whatever it is.
    """
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"cast_params_: dtype must be a floating torch.dtype, got {dtype!r}")
    module.to(device=device)  # params and buffers move; nothing is cast
    with torch.no_grad():
        for p in module.parameters():
            if p.is_floating_point() and p.dtype != dtype:
                p.data = p.data.to(dtype)


def cast_buffers_(
    module: torch.nn.Module, dtype: torch.dtype, keep: frozenset[int] | set[int] = frozenset()
) -> None:
    """In place: every floating buffer to ``dtype`` (DeepSpeed's ``data_types.buffer_dtype``);
    integer and bool buffers keep theirs, and so do the buffers whose ids are in ``keep``
    (``data_types.keep_in_fp32_modules``)."""
    for m in module.modules():
        for name, b in m._buffers.items():
            if b is not None and b.is_floating_point() and b.dtype != dtype and id(b) not in keep:
                m._buffers[name] = b.to(dtype)
