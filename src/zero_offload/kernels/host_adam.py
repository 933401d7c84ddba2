"""Host (CPU) Adam/AdamW update of ZeRO-Offload.

Each rank keeps its fp32 master shard and the Adam moments in host memory. Per step,
:func:`host_adam_step` makes one pass over memory per element: it reads the gradient (fp32, bf16
or fp16), multiplies it by ``grad_scale`` (loss unscale times clip coefficient, computed by the
caller), applies Adam (L2 weight decay) or AdamW (decoupled weight decay) to the master weight
and the moments in place, and optionally writes the new weight rounded to bf16/fp16 (round to
nearest even) into ``param_out``, the staging buffer that goes back to the device.

The work is done by the compiled module ``zero_offload._host_adam`` (C++, SIMD with run-time ISA
dispatch, multi-threaded, GIL released). When it is not available (build failed, unsupported
platform) the same math runs in :func:`reference_adam_step` (pure PyTorch), with one warning.

Environment variables:
    ZERO_OFFLOAD_KERNEL  ``auto`` (default) | ``cpp`` (require the compiled kernel) |
                         ``reference`` (force the PyTorch implementation); read at every call.
    ZERO_OFFLOAD_ISA     ``avx512`` | ``avx2`` | ``scalar``: force a variant of the compiled
                         kernel (read at import; testing and benchmarking).

Semantics (DeepSpeed's CPU Adam, ``csrc/includes/cpu_adam.h``), fp32 arithmetic::

    g = grad * grad_scale
    if not adamw and weight_decay > 0:  g = g + weight_decay * p
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    denom = sqrt(v) * (1 / sqrt(1 - beta2**step)) + eps      # bias correction optional
    if adamw and weight_decay > 0:      p = p - lr * weight_decay * p
    p = p - lr / (1 - beta1**step) * m / denom
    param_out = round_to_16bit(p)
"""

from __future__ import annotations

import math
import numbers
import os
import warnings
from typing import Any

import torch

from .._native import load_optional

__all__ = [
    "default_threads",
    "host_adam_step",
    "kernel_info",
    "reference_adam_step",
]

_GRAD_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_OUT_CODES = {torch.bfloat16: 1, torch.float16: 2}
_KERNEL_ENV = "ZERO_OFFLOAD_KERNEL"
_ISA_ENV = "ZERO_OFFLOAD_ISA"
_REFERENCE_CHUNK = 1 << 20  # elements per chunk of the reference path (bounds temporaries)

_C, _IMPORT_ERROR = load_optional("zero_offload._host_adam")

if _C is not None and os.environ.get(_ISA_ENV):
    try:
        _C.set_isa(os.environ[_ISA_ENV].strip().lower())
    except ValueError as exc:
        warnings.warn(f"{_ISA_ENV} ignored: {exc}", RuntimeWarning, stacklevel=2)

_fallback_warned = False


_threads_cache: tuple[str | None, int] | None = None


def default_threads() -> int:
    """Cores this process may use (its CPU affinity mask), divided among the ranks of this node
    (LOCAL_WORLD_SIZE, set by torchrun), at least 1. The affinity mask is read once per process
    (per LOCAL_WORLD_SIZE value)."""
    global _threads_cache
    local_env = os.environ.get("LOCAL_WORLD_SIZE")
    if _threads_cache is not None and _threads_cache[0] == local_env:
        return _threads_cache[1]
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    try:
        local_world = int(local_env or "1")
    except ValueError:
        local_world = 1
    result = max(1, cores // max(1, local_world))
    _threads_cache = (local_env, result)
    return result


def _kernel_mode() -> str:
    mode = os.environ.get(_KERNEL_ENV, "auto").strip().lower() or "auto"
    if mode not in ("auto", "cpp", "reference"):
        raise ValueError(f"{_KERNEL_ENV} must be one of auto, cpp, reference; got {mode!r}")
    return mode


def _reference_reason() -> str | None:
    """Why the reference path is used (None when the compiled kernel is used)."""
    mode = _kernel_mode()
    if mode == "reference":
        return f"forced by {_KERNEL_ENV}=reference"
    if _C is None:
        reason = f"compiled module zero_offload._host_adam is unavailable ({_IMPORT_ERROR})"
        if mode == "cpp":
            raise RuntimeError(f"{_KERNEL_ENV}=cpp but the {reason}")
        return reason
    return None


def kernel_info() -> dict[str, Any]:
    """Which implementation :func:`host_adam_step` uses, with its ISA, SIMD width and threads."""
    reason = _reference_reason()
    if reason is not None:
        return {
            "kernel": "reference",
            "isa": "torch",
            "simd_width": None,
            "threads": default_threads(),
            "reason": reason,
            "supported_isas": list(_C.supported_isas()) if _C is not None else [],
        }
    return {
        "kernel": "cpp",
        "isa": _C.get_isa(),
        "simd_width": _C.simd_width(),
        "threads": default_threads(),
        "reason": None,
        "supported_isas": list(_C.supported_isas()),
    }


# ------------------------------------------------------------------------------------------------
# Validation
# ------------------------------------------------------------------------------------------------


def _names(dtypes) -> str:
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


def _check_tensor(
    name: str, t: Any, allowed: tuple[torch.dtype, ...], numel: int | None, cpu: bool = True
) -> None:
    """``cpu`` False: any device (the PyTorch reference of the compact states runs there)."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if cpu and not t.is_cpu:
        raise ValueError(f"{name} must be a CPU tensor, got device {t.device}")
    if t.dtype not in allowed:
        raise ValueError(f"{name} must have dtype {_names(allowed)}; got {_names([t.dtype])}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    if numel is not None and t.numel() != numel:
        raise ValueError(
            f"{name} has {t.numel()} elements but master has {numel}; all tensors must have the "
            "same numel"
        )


def _check_number(
    name: str, x: Any, lo: float | None = None, hi: float | None = None, hi_open: bool = False
) -> float:
    if type(x) is not float:  # fast path for the common case
        if isinstance(x, torch.Tensor) and x.numel() == 1:  # e.g. a scheduler's tensor lr
            x = x.item()
        if isinstance(x, bool) or not isinstance(x, numbers.Real):
            raise ValueError(f"{name} must be a real number, got {type(x).__name__}")
        x = float(x)
    if not math.isfinite(x):
        raise ValueError(f"{name} must be finite, got {x}")
    if lo is not None and x < lo:
        raise ValueError(f"{name} must be >= {lo}, got {x}")
    if hi is not None and (x >= hi if hi_open else x > hi):
        raise ValueError(f"{name} must be {'<' if hi_open else '<='} {hi}, got {x}")
    return x


def _check_int(name: str, x: Any, what: str) -> int:
    if type(x) is not int and (isinstance(x, bool) or not isinstance(x, numbers.Integral)):
        raise ValueError(f"{name} must be {what}, got {x!r}")
    if x < 1:
        raise ValueError(f"{name} must be {what}, got {x!r}")
    return int(x)


_BUFFER_NAMES = ("master", "exp_avg", "exp_avg_sq", "grad", "param_out")


def _check_overlaps(tensors: tuple[torch.Tensor | None, ...]) -> None:
    """No two buffers may overlap, except grad and param_out being the very same 16-bit buffer
    (each element's grad is read before its param_out is written). Order: _BUFFER_NAMES."""
    spans = []
    for i, t in enumerate(tensors):
        if t is not None:
            n = t.numel()
            if n:
                start = t.data_ptr()
                size = t.element_size()
                spans.append((i, start, start + n * size, size))
    for x in range(len(spans)):
        i, a0, a1, sa = spans[x]
        for y in range(x + 1, len(spans)):
            j, b0, b1, sb = spans[y]
            if a0 < b1 and b0 < a1:
                if (i, j) == (3, 4) and a0 == b0 and a1 == b1 and sa == sb:
                    continue  # grad and param_out are the same 16-bit buffer
                raise ValueError(
                    f"{_BUFFER_NAMES[i]} and {_BUFFER_NAMES[j]} overlap in memory; they must be "
                    "separate buffers"
                )


def _validate(
    master,
    exp_avg,
    exp_avg_sq,
    grad,
    param_out,
    step,
    lr,
    beta1,
    beta2,
    eps,
    weight_decay,
    grad_scale,
    threads,
) -> dict[str, Any]:
    _check_tensor("master", master, (torch.float32,), None)
    n = master.numel()
    _check_tensor("exp_avg", exp_avg, (torch.float32,), n)
    _check_tensor("exp_avg_sq", exp_avg_sq, (torch.float32,), n)
    _check_tensor("grad", grad, tuple(_GRAD_CODES), n)
    if param_out is not None:
        _check_tensor("param_out", param_out, tuple(_OUT_CODES), n)
    step = _check_int("step", step, "an int >= 1 (1-based step count)")
    if threads is not None:
        threads = _check_int("threads", threads, "None or an int >= 1")
    _check_overlaps((master, exp_avg, exp_avg_sq, grad, param_out))
    return {
        "step": step,
        "threads": threads,
        "lr": _check_number("lr", lr, lo=0.0),
        "beta1": _check_number("beta1", beta1, lo=0.0, hi=1.0, hi_open=True),
        "beta2": _check_number("beta2", beta2, lo=0.0, hi=1.0, hi_open=True),
        "eps": _check_number("eps", eps, lo=0.0),
        "weight_decay": _check_number("weight_decay", weight_decay, lo=0.0),
        "grad_scale": _check_number("grad_scale", grad_scale),
    }


# ------------------------------------------------------------------------------------------------
# Public API
# ------------------------------------------------------------------------------------------------


def host_adam_step(
    master: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    grad: torch.Tensor,
    param_out: torch.Tensor | None,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    adamw: bool,
    bias_correction: bool = True,
    grad_scale: float = 1.0,
    threads: int | None = None,
) -> None:
    """One Adam/AdamW step on host tensors, in place (see the module docstring for the math).

    master, exp_avg, exp_avg_sq: fp32, contiguous, CPU, updated in place. grad: fp32/bf16/fp16,
    contiguous, CPU, read only. param_out: bf16/fp16 contiguous CPU tensor that receives the new
    master rounded to nearest even, or None. All have the same numel; param_out may be the very
    same buffer as a 16-bit grad. step is the 1-based step count. threads defaults to
    :func:`default_threads`; the result is bitwise independent of the thread count.
    """
    h = _validate(
        master,
        exp_avg,
        exp_avg_sq,
        grad,
        param_out,
        step,
        lr,
        beta1,
        beta2,
        eps,
        weight_decay,
        grad_scale,
        threads,
    )
    if (reason := _reference_reason()) is not None:
        if _C is None:
            _warn_fallback_once(reason)
        _reference_impl(
            master,
            exp_avg,
            exp_avg_sq,
            grad,
            param_out,
            adamw=bool(adamw),
            bias_correction=bool(bias_correction),
            **h,
        )
        return
    if master.numel() == 0:
        return
    _native_step(
        master, exp_avg, exp_avg_sq, grad, param_out, h, bool(adamw), bool(bias_correction)
    )


def _native_step(master, exp_avg, exp_avg_sq, grad, param_out, h: dict, adamw, bc) -> None:
    """The compiled kernel over the tensors' memory (validated by ``_validate``)."""
    _C.adam_step(
        master.data_ptr(),
        exp_avg.data_ptr(),
        exp_avg_sq.data_ptr(),
        grad.data_ptr(),
        _GRAD_CODES[grad.dtype],
        0 if param_out is None else param_out.data_ptr(),
        0 if param_out is None else _OUT_CODES[param_out.dtype],
        master.numel(),
        h["step"],
        h["lr"],
        h["beta1"],
        h["beta2"],
        h["eps"],
        h["weight_decay"],
        adamw,
        bc,
        h["grad_scale"],
        default_threads() if h["threads"] is None else h["threads"],
    )


def _warn_fallback_once(reason: str) -> None:
    global _fallback_warned
    if not _fallback_warned:
        _fallback_warned = True
        warnings.warn(
            f"zero_offload host Adam: the compiled kernel is unavailable, using the (slower) "
            f"PyTorch reference implementation: {reason}. Reinstall with a C++17 compiler "
            "(pip install -e .) to build it.",
            RuntimeWarning,
            stacklevel=3,
        )


def reference_adam_step(
    master: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    grad: torch.Tensor,
    param_out: torch.Tensor | None,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    adamw: bool,
    bias_correction: bool = True,
    grad_scale: float = 1.0,
    threads: int | None = None,
) -> None:
    """Pure-PyTorch implementation of :func:`host_adam_step` (same math in fp32, same per-call
    scalars; not bitwise identical, since PyTorch rounds some products the kernel fuses).
    ``threads`` is accepted for signature compatibility; PyTorch's intra-op threads are used."""
    h = _validate(
        master,
        exp_avg,
        exp_avg_sq,
        grad,
        param_out,
        step,
        lr,
        beta1,
        beta2,
        eps,
        weight_decay,
        grad_scale,
        threads,
    )
    _reference_impl(
        master,
        exp_avg,
        exp_avg_sq,
        grad,
        param_out,
        adamw=bool(adamw),
        bias_correction=bool(bias_correction),
        **h,
    )


def _coefficients(
    step: int, lr: float, beta1: float, beta2: float, weight_decay: float, bias_correction: bool
) -> tuple[float, float]:
    """(step_size, 1/sqrt(bc2)) in double precision, as the C++ kernel computes them."""
    bc1 = 1.0 - math.pow(beta1, step) if bias_correction else 1.0
    bc2 = 1.0 - math.pow(beta2, step) if bias_correction else 1.0
    return lr / bc1, 1.0 / math.sqrt(bc2)


@torch.no_grad()
def _reference_impl(
    master,
    exp_avg,
    exp_avg_sq,
    grad,
    param_out,
    *,
    step,
    lr,
    beta1,
    beta2,
    eps,
    weight_decay,
    adamw,
    bias_correction,
    grad_scale,
    threads=None,  # PyTorch's intra-op threads are used
) -> None:
    step_size, bc2_rsqrt = _coefficients(step, lr, beta1, beta2, weight_decay, bias_correction)
    l2 = weight_decay > 0 and not adamw
    decoupled = weight_decay > 0 and adamw
    p_all, m_all, v_all = master.view(-1), exp_avg.view(-1), exp_avg_sq.view(-1)
    g_all = grad.view(-1)
    o_all = None if param_out is None else param_out.view(-1)
    n = p_all.numel()
    for start in range(0, n, _REFERENCE_CHUNK):
        end = min(n, start + _REFERENCE_CHUNK)
        p, m, v = p_all[start:end], m_all[start:end], v_all[start:end]
        g = g_all[start:end].to(torch.float32, copy=True)  # read before param_out is written
        g.mul_(grad_scale)
        if l2:
            g.add_(p, alpha=weight_decay)
        m.mul_(beta1).add_(g, alpha=1.0 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
        denom = torch.sqrt(v, out=g)  # g is dead: reuse it for the denominator
        denom.mul_(bc2_rsqrt).add_(eps)
        if decoupled:
            p.add_(p, alpha=-(lr * weight_decay))
        p.addcdiv_(m, denom, value=-step_size)
        if o_all is not None:
            o_all[start:end].copy_(p)
