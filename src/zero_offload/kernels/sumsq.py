"""The squared L2 norm of a gradient segment, ``sum(x**2)`` accumulated in fp32: the term the
engine adds up, per final segment, for the global gradient norm (clipping, the fp16 overflow
check, ``get_global_grad_norm``).

A host (CPU) tensor goes to the compiled kernel of ``zero_offload._host_adam``: one SIMD pass at
memory bandwidth (AVX-512 / AVX2 / scalar, chosen at import like the Adam kernel), fp32 lanes,
multi-threaded with the GIL released. Its result is bitwise the same for every ISA and thread
count (fixed lanes and blocks, block sums added in block order), so every step and every rank
adds the same numbers in the same order; NaN and Inf propagate, so overflow detection still
sees them. A device tensor, a non-contiguous one, or a host without the compiled module takes
the torch path, ``vector_norm(x, dtype=float32).square()``, as before the kernel existed. The
two paths agree within fp32 rounding (the kernel is the more accurate: its lanes are short).

``ZERO_OFFLOAD_KERNEL=reference`` (see :mod:`zero_offload.kernels.host_adam`) forces the torch
path here too.
"""

from __future__ import annotations

import os
from typing import Literal

import torch

from .host_adam import _C, _GRAD_CODES, _KERNEL_ENV, default_threads

__all__ = ["BACKENDS", "kernel_available", "sum_of_squares"]

Backend = Literal["auto", "kernel", "torch"]
BACKENDS: tuple[str, ...] = ("auto", "kernel", "torch")


def kernel_available() -> bool:
    """The compiled module is built with the sum of squares (an older build lacks it)."""
    return _C is not None and hasattr(_C, "sumsq")


def _kernel_allowed() -> bool:
    return os.environ.get(_KERNEL_ENV, "auto").strip().lower() != "reference"


def _use_kernel(t: torch.Tensor, backend: str) -> bool:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}; got {backend!r}")
    if backend == "torch":
        return False
    fits = t.is_cpu and t.dtype in _GRAD_CODES and t.is_contiguous()
    if backend == "kernel":
        if not kernel_available():
            raise RuntimeError(
                "sum_of_squares(backend='kernel'): the compiled module zero_offload._host_adam "
                "is unavailable or predates the sum-of-squares kernel; rebuild it "
                "(pip install -e .)"
            )
        if not fits:
            raise ValueError(
                "sum_of_squares(backend='kernel') takes a contiguous CPU tensor of dtype "
                f"float32, bfloat16 or float16; got {t.dtype} on {t.device}"
                + ("" if t.is_contiguous() else ", not contiguous")
            )
        return True
    return fits and kernel_available() and _kernel_allowed()


def sum_of_squares(
    t: torch.Tensor, *, backend: Backend = "auto", threads: int | None = None
) -> torch.Tensor:
    """``sum(t**2)`` with fp32 accumulation, as a 0-dim fp32 tensor on ``t``'s device.

    ``backend``: ``"auto"`` (the kernel where it applies, else torch), ``"kernel"`` (raise where
    it does not apply) or ``"torch"``. ``threads`` (kernel only): at most this many threads,
    default :func:`~zero_offload.kernels.host_adam.default_threads`; when another call (the host
    Adam update of a delayed step) holds the kernel's thread pool, the caller's thread does it
    alone rather than wait."""
    if not _use_kernel(t, backend):
        return torch.linalg.vector_norm(t, dtype=torch.float32).square()
    n = t.numel()
    value = 0.0 if n == 0 else _C.sumsq(t.data_ptr(), _GRAD_CODES[t.dtype], n, _threads(threads))
    return torch.tensor(value, dtype=torch.float32)


def _threads(threads: int | None) -> int:
    if threads is None:
        return default_threads()
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads must be None or an int >= 1, got {threads!r}")
    return threads
