"""The host Adam update's per-element arithmetic, in numpy, with its per-step coefficients formed
either as the project's kernel forms them or as DeepSpeed 0.19.8's CPU Adam does.

Both kernels run the same sequence per element (the project's ``csrc/adam_body.inc``, DeepSpeed's
``csrc/includes/cpu_adam.h`` ``Step_AVX``): ``m = fma(g, 1-b1, m*b1)``, ``v = fma(g*g, 1-b2, v*b2)``,
``u = m / fma(sqrt(v), bc2, eps)``, ``p = fma(p, -lr*wd, p)`` (AdamW), ``p = fma(u, step, p)``,
every operation in fp32 and rounded once. They differ only in the per-step coefficients:

- ``"project"`` (``csrc/adam_coeffs.h`` ``make_coeffs``): ``step = -lr / (1 - b1**t)`` and
  ``bc2 = 1 / sqrt(1 - b2**t)`` in double precision, rounded once to fp32 (correctly rounded);
- ``"deepspeed"`` (``Adam_Optimizer::IncrementStep`` / ``update_state``): ``b1**t`` and ``b2**t``
  accumulated by one fp32 multiplication per step, ``1 - b**t`` in fp32 (the cancellation then
  leaves ``bc2`` up to 6.8e-6 relative from the exact value, 65 fp32 ulps, at step 3),
  ``1 / sqrt(.)`` in fp32, ``step = -lr / bc1`` and ``-lr * wd`` in fp32, and ``1 - beta``
  formed from the fp32 betas.

DeepSpeed computes the last ``numel % 16`` elements of each tensor it steps in a scalar loop
(``csrc/adam/cpu_adam_impl.cpp`` ``Step_1``) whose multiply-adds are not fused; this module
models its SIMD body only (every element fused), which is what the comparisons read.

:func:`emulated_kernel` returns a drop-in for the project's host kernels (``host_adam_step``,
``adam_step_states`` with bf16 or fp32 master and moments, round-to-nearest stores), so that an
engine run with it isolates the coefficients from everything else (gradient reduction and
accumulation, casts, the update's order): ``tests/compact_states_run.py --emulate``."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch

F32 = np.float32
SOURCES = ("project", "deepspeed")


def coefficients(source: str, step: int, lr: float, beta1: float, beta2: float,
                 weight_decay: float) -> dict[str, np.float32]:  # fmt: skip
    """The per-step fp32 constants: ``one_minus_beta1``, ``one_minus_beta2``, ``bc2_rsqrt``,
    ``neg_step``, ``neg_lr_wd`` (bias correction on)."""
    if source == "project":
        bc1, bc2 = 1.0 - beta1**step, 1.0 - beta2**step
        return {
            "one_minus_beta1": F32(1.0 - beta1),
            "one_minus_beta2": F32(1.0 - beta2),
            "bc2_rsqrt": F32(1.0 / math.sqrt(bc2)),
            "neg_step": F32(-(lr / bc1)),
            "neg_lr_wd": F32(-(lr * weight_decay)),
        }
    if source != "deepspeed":
        raise ValueError(f"source must be one of {SOURCES}, got {source!r}")
    lr32, b1, b2, wd = F32(lr), F32(beta1), F32(beta2), F32(weight_decay)
    b1t = b2t = F32(1.0)
    for _ in range(step):  # IncrementStep: one fp32 multiplication per step
        b1t, b2t = F32(b1t * b1), F32(b2t * b2)
    return {
        "one_minus_beta1": F32(F32(1.0) - b1),
        "one_minus_beta2": F32(F32(1.0) - b2),
        # ``1 / sqrt(1 - _betta2_t)``: all fp32 (the float overload of sqrt; with a double sqrt
        # the fp32-master comparison over 30 steps differs in over 800 of 4133 elements)
        "bc2_rsqrt": F32(F32(1.0) / np.sqrt(F32(F32(1.0) - b2t))),
        "neg_step": F32(-lr32 / F32(F32(1.0) - b1t)),
        "neg_lr_wd": F32(-lr32 * wd),
    }


def fma(a: np.ndarray, b: np.ndarray | np.float32, c: np.ndarray) -> np.ndarray:
    """fp32 ``a * b + c`` rounded once. The product of two fp32 values is exact in double; the
    double sum is corrected by its exact error (TwoSum) where it lands on an fp32 midpoint, the
    only case in which rounding it again to fp32 could differ from one rounding."""
    x = a.astype(np.float64) * np.float64(b) if np.ndim(b) == 0 else a.astype(np.float64) * b
    c = np.broadcast_to(np.asarray(c, dtype=np.float64), x.shape)
    s = x + c
    bb = s - x
    err = (x - (s - bb)) + (c - bb)  # s + err == x + c exactly
    r = s.astype(F32)
    toward = np.nextafter(r, np.where(s > r, F32(np.inf), F32(-np.inf)).astype(F32))
    tie = (s != r) & (s - r.astype(np.float64) == toward.astype(np.float64) - s)
    fix = tie & (err != 0)
    up, down = np.maximum(r, toward), np.minimum(r, toward)
    return np.where(fix, np.where(err > 0, up, down), r).astype(F32)


def adam_update(master: np.ndarray, exp_avg: np.ndarray, exp_avg_sq: np.ndarray,
                grad: np.ndarray, *, beta1: float, beta2: float, eps: float, adamw: bool,
                weight_decay: float, c: dict[str, np.float32]
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:  # fmt: skip
    """One step over fp32 arrays (``grad`` already scaled); the new master and moments."""
    g = grad
    if weight_decay > 0 and not adamw:  # L2: the kernels' kWdL2 (DeepSpeed: fma(p, wd, g))
        g = fma(master, F32(weight_decay), g)
    m = fma(g, c["one_minus_beta1"], exp_avg * F32(beta1))
    v = fma(g * g, c["one_minus_beta2"], exp_avg_sq * F32(beta2))
    upd = m / fma(np.sqrt(v), c["bc2_rsqrt"], np.full_like(v, F32(eps)))
    p = master
    if weight_decay > 0 and adamw:
        p = fma(p, c["neg_lr_wd"], p)
    return fma(upd, c["neg_step"], p), m, v


def emulated_kernel(source: str, calls: list[int] | None = None) -> Callable[..., None]:
    """A stand-in for the project's host kernels (same arguments, in place) computing
    :func:`adam_update` with ``source``'s coefficients; ``calls`` (a one-element list) counts its
    calls. Refuses what it does not emulate: stochastic rounding, 8-bit moments, no bias
    correction."""
    if source not in SOURCES:
        raise ValueError(f"source must be one of {SOURCES}, got {source!r}")

    def kernel(master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
               grad: torch.Tensor, param_out: torch.Tensor | None = None, *, step: int,
               lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
               adamw: bool, bias_correction: bool = True, grad_scale: float = 1.0,
               threads: int | None = None, options=None) -> None:  # fmt: skip
        if not bias_correction:
            raise ValueError("emulated_kernel: bias_correction=False is not emulated")
        if options is not None and getattr(options, "stochastic_round_seed", None) is not None:
            raise ValueError("emulated_kernel: stochastic rounding is not emulated")
        for t in (master, exp_avg, exp_avg_sq):
            if not isinstance(t, torch.Tensor) or t.dtype not in (torch.float32, torch.bfloat16):
                raise ValueError("emulated_kernel: fp32 or bf16 master and moments only")
        g = grad.float().numpy() * F32(grad_scale)
        c = coefficients(source, step, lr, beta1, beta2, weight_decay)
        p, m, v = adam_update(
            master.float().numpy(), exp_avg.float().numpy(), exp_avg_sq.float().numpy(), g,
            beta1=beta1, beta2=beta2, eps=eps, adamw=adamw, weight_decay=weight_decay, c=c,
        )  # fmt: skip
        for dst, src in ((master, p), (exp_avg, m), (exp_avg_sq, v)):
            dst.copy_(torch.from_numpy(src))  # to bf16: round to nearest even, as both store
        if param_out is not None:
            param_out.copy_(torch.from_numpy(p))
        if calls is not None:
            calls[0] += 1

    return kernel
