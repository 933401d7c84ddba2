"""Host Adam/AdamW update with compact optimizer states: bf16 master, bf16 or 8-bit moments.

One entry point, :func:`adam_step_states`, for every state kind::

    adam_step_states(master, exp_avg, exp_avg_sq, grad, param_out=None, *, step, lr, beta1,
                     beta2, eps, weight_decay, adamw, bias_correction=True, grad_scale=1.0,
                     threads=None, options=StateOptions())

* ``master``: fp32 or bf16 tensor, updated in place. A bf16 master IS the 16-bit param (DeepSpeed's
  ``bf16_master_weights_and_grads``): ``param_out`` must then be None.
* ``exp_avg``, ``exp_avg_sq``: both fp32 tensors, both bf16 tensors (DeepSpeed's
  ``bf16_optimizer_states``, rounded to nearest even as its CPU Adam stores them), or both
  :class:`QuantizedMoment` (blockwise 8-bit Adam: uint8 codes plus one fp32 absmax per block;
  ``exp_avg`` with ``signed=True``, ``exp_avg_sq`` with ``signed=False``, same block size; make
  them with :func:`zeros_moment` / :func:`quantize_moment`, read them with
  :func:`dequantize_moment`).
* ``grad``: fp32/bf16/fp16; ``param_out``: None or a bf16/fp16 tensor (fp32 master only), which may
  be the very same buffer as a 16-bit grad.
* ``options``: :class:`StateOptions`; ``stochastic_round_seed`` (bf16 master only; None = round to
  nearest even) and ``index_offset`` (the index of element 0 in the whole tensor, so that a shard
  draws the same random numbers as the unsharded tensor would).

The arithmetic per element is the fp32-state kernel's (:mod:`zero_offload.kernels.host_adam`)
between the state loads and stores: load (bf16 -> fp32 exactly, 8-bit -> map[code] * scale), the
fp32 update, store (bf16 rounded to nearest even or stochastically; 8-bit blocks re-encoded from
the updated fp32 block with its new absmax, so quantization error never accumulates as bias).
fp32 master with fp32 moments runs the fp32-state kernel itself (bitwise unchanged).

Stochastic rounding of element i: ``r = fmix32((index_offset + i) mod 2**32 ^ key) >> 16`` with
``key = sr_key(seed, step)`` (murmur3's finaliser), bf16 bits = ``(fp32 bits + r) >> 16``: the
result depends on (seed, step, index) only, never on threads or ISA.

The compiled kernel (``zero_offload._host_adam``, every ISA variant bitwise equal) runs the update;
without it (or with ``ZERO_OFFLOAD_KERNEL=reference``) :func:`reference_adam_step_states` does the
same arithmetic in PyTorch (fp32; not bitwise, since PyTorch does not fuse the multiply-adds).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from . import host_adam as ha
from .quant_maps import (
    DEFAULT_BLOCK_SIZE,
    QuantizedMoment,
    check_block_size,
    decode_blocks,
    dequantize_moment,
    encode_blocks,
    num_blocks,
    quantize_moment,
    zeros_moment,
)

__all__ = [
    "Moment",
    "QuantizedMoment",
    "StateOptions",
    "adam_step_states",
    "as_cpu_adam_hyper",
    "dequantize_moment",
    "quantize_moment",
    "reference_adam_step_states",
    "stochastic_round_bf16",
    "zeros_moment",
]

Moment = torch.Tensor | QuantizedMoment

_MASTER_CODES = {torch.float32: 0, torch.bfloat16: 1}
_STATE_F32, _STATE_BF16, _STATE_Q8 = 0, 1, 2
_MASK32 = 0xFFFFFFFF


@dataclass(frozen=True)
class StateOptions:
    """Options of the compact-state update. ``stochastic_round_seed``: None (round the bf16
    master to nearest even, DeepSpeed's behaviour) or an int seed >= 0 (stochastic rounding of
    the bf16 master write). ``index_offset``: index of element 0 in the whole tensor (>= 0)."""

    stochastic_round_seed: int | None = None
    index_offset: int = 0

    def __post_init__(self) -> None:
        seed = self.stochastic_round_seed
        if seed is not None and (
            isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**64
        ):
            raise ValueError(
                f"stochastic_round_seed must be None or an int in [0, 2**64), got {seed!r}"
            )
        off = self.index_offset
        if isinstance(off, bool) or not isinstance(off, int) or not 0 <= off < 2**64:
            raise ValueError(f"index_offset must be an int in [0, 2**64), got {off!r}")


# ------------------------------------------------------------------------------------------------
# Stochastic rounding (the reference of the kernel's)
# ------------------------------------------------------------------------------------------------


def _fmix32(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x85EBCA6B) & _MASK32
    x ^= x >> 13
    x = (x * 0xC2B2AE35) & _MASK32
    return x ^ (x >> 16)


def sr_key(seed: int, step: int) -> int:
    """The per-call key of stochastic rounding (the C++ ``sr_key``)."""
    s = _fmix32((step & _MASK32) ^ _fmix32((step >> 32) & _MASK32))
    return _fmix32((seed & _MASK32) ^ _fmix32(((seed >> 32) & _MASK32) ^ s))


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for int64 x in [0, 2**32), without overflowing int64."""
    lo = x * (c & 0xFFFF)
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & _MASK32


def _fmix32_t(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


@torch.no_grad()
def stochastic_round_bf16(
    x: torch.Tensor, seed: int, step: int, index_offset: int = 0
) -> torch.Tensor:
    """fp32 -> bf16 with the kernel's stochastic rounding (element i uses index index_offset + i).
    NaN becomes a quiet NaN as with rounding to nearest."""
    x = x.detach().reshape(-1).to(torch.float32)
    key = sr_key(int(seed), int(step))
    idx = torch.arange(x.numel(), dtype=torch.int64, device=x.device)
    idx = (idx + (index_offset & _MASK32)) & _MASK32
    r = _fmix32_t(idx ^ key) >> 16
    u = x.view(torch.int32).to(torch.int64) & _MASK32
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    bits = torch.where(nan, (u >> 16) | 0x40, (u + r) >> 16) & 0xFFFF
    return bits.to(torch.int32).to(torch.int16).view(torch.bfloat16)


# ------------------------------------------------------------------------------------------------
# Validation
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Plan:
    n: int
    master_type: int
    state_type: int
    block_size: int
    buffers: tuple[tuple[str, torch.Tensor | None], ...]


def _check_moment(name: str, x: Any, n: int, signed: bool, cpu: bool = True) -> int:
    """State type of one moment (validated)."""
    if isinstance(x, QuantizedMoment):
        if x.signed != signed:
            raise ValueError(
                f"{name} must be a QuantizedMoment with signed={signed} (the {name} map), got "
                f"signed={x.signed}"
            )
        check_block_size(x.block_size, f"{name}.block_size")
        ha._check_tensor(f"{name}.codes", x.codes, (torch.uint8,), n, cpu)
        nb = num_blocks(n, x.block_size)
        ha._check_tensor(f"{name}.scales", x.scales, (torch.float32,), nb, cpu)
        return _STATE_Q8
    if not isinstance(x, torch.Tensor):
        raise ValueError(
            f"{name} must be a torch.Tensor (fp32/bf16) or a QuantizedMoment, got {type(x).__name__}"
        )
    ha._check_tensor(name, x, (torch.float32, torch.bfloat16), n, cpu)
    return _STATE_F32 if x.dtype == torch.float32 else _STATE_BF16


def _plan(
    master, exp_avg, exp_avg_sq, grad, param_out, options: StateOptions, cpu: bool = True
) -> _Plan:
    """The validated call; ``cpu`` False (the reference): every buffer on master's device."""
    ha._check_tensor("master", master, tuple(_MASTER_CODES), None, cpu)
    n = master.numel()
    st_m = _check_moment("exp_avg", exp_avg, n, signed=True, cpu=cpu)
    st_v = _check_moment("exp_avg_sq", exp_avg_sq, n, signed=False, cpu=cpu)
    if st_m != st_v:
        raise ValueError(
            "exp_avg and exp_avg_sq must be the same state kind (both fp32, both bf16 or both "
            f"QuantizedMoment), got {_kind_name(exp_avg)} and {_kind_name(exp_avg_sq)}"
        )
    block = DEFAULT_BLOCK_SIZE  # unused unless 8-bit
    if st_m == _STATE_Q8:
        if exp_avg.block_size != exp_avg_sq.block_size:
            raise ValueError(
                f"exp_avg.block_size ({exp_avg.block_size}) and exp_avg_sq.block_size "
                f"({exp_avg_sq.block_size}) must be equal"
            )
        block = exp_avg.block_size
    ha._check_tensor("grad", grad, tuple(ha._GRAD_CODES), n, cpu)
    bf16_master = master.dtype == torch.bfloat16
    if param_out is not None:
        if bf16_master:
            raise ValueError(
                "param_out must be None with a bf16 master: the bf16 master is the 16-bit param"
            )
        ha._check_tensor("param_out", param_out, tuple(ha._OUT_CODES), n, cpu)
    if options.stochastic_round_seed is not None and not bf16_master:
        raise ValueError(
            "options.stochastic_round_seed needs a bf16 master (an fp32 master is not rounded)"
        )
    buffers = (
        ("master", master),
        ("exp_avg", _data(exp_avg)),
        ("exp_avg_sq", _data(exp_avg_sq)),
        ("exp_avg.scales", _scales(exp_avg)),
        ("exp_avg_sq.scales", _scales(exp_avg_sq)),
        ("grad", grad),
        ("param_out", param_out),
    )
    if not cpu:
        _check_one_device(master.device, buffers)
    _check_overlaps(buffers)
    return _Plan(n, _MASTER_CODES[master.dtype], st_m, block, buffers)


def _kind_name(x: Any) -> str:
    if isinstance(x, QuantizedMoment):
        return "QuantizedMoment"
    return str(getattr(x, "dtype", type(x).__name__)).replace("torch.", "")


def _data(x: Moment) -> torch.Tensor:
    return x.codes if isinstance(x, QuantizedMoment) else x


def _scales(x: Moment) -> torch.Tensor | None:
    return x.scales if isinstance(x, QuantizedMoment) else None


def _check_one_device(device: torch.device, buffers) -> None:
    for name, t in buffers:
        if t is not None and t.device != device:
            raise ValueError(f"{name} is on {t.device} but master on {device}: one device for all")


def _check_overlaps(buffers) -> None:
    """No two buffers overlap, except grad and param_out being the very same 16-bit buffer."""
    spans = []
    for name, t in buffers:
        if t is not None and t.numel():
            start = t.data_ptr()
            spans.append((name, start, start + t.numel() * t.element_size(), t.element_size()))
    for x, (a, a0, a1, sa) in enumerate(spans):
        for b, b0, b1, sb in spans[x + 1 :]:
            if a0 < b1 and b0 < a1:
                if (a, b) == ("grad", "param_out") and (a0, a1, sa) == (b0, b1, sb):
                    continue
                raise ValueError(f"{a} and {b} overlap in memory; they must be separate buffers")


# ------------------------------------------------------------------------------------------------
# Public API
# ------------------------------------------------------------------------------------------------


def adam_step_states(
    master: torch.Tensor,
    exp_avg: Moment,
    exp_avg_sq: Moment,
    grad: torch.Tensor,
    param_out: torch.Tensor | None = None,
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
    options: StateOptions | None = None,
) -> None:
    """One Adam/AdamW step over compact host states, in place (see the module docstring)."""
    options = _check_options(options)
    plan = _plan(master, exp_avg, exp_avg_sq, grad, param_out, options)
    h = _hyper(step, lr, beta1, beta2, eps, weight_decay, grad_scale, threads)
    if plan.master_type == 0 and plan.state_type == _STATE_F32:  # the fp32-state kernel
        assert isinstance(exp_avg, torch.Tensor) and isinstance(exp_avg_sq, torch.Tensor)
        ha.host_adam_step(
            master,
            exp_avg,
            exp_avg_sq,
            grad,
            param_out,
            adamw=adamw,
            bias_correction=bias_correction,
            **h,
        )
        return
    if (reason := ha._reference_reason()) is not None:
        if ha._C is None:
            ha._warn_fallback_once(reason)
        _reference_impl(
            master,
            exp_avg,
            exp_avg_sq,
            grad,
            param_out,
            options,
            bool(adamw),
            bool(bias_correction),
            h,
        )
        return
    if plan.n == 0:
        return
    _native_step(
        master, exp_avg, exp_avg_sq, grad, param_out, plan, h, adamw, bias_correction, options
    )


def _native_step(
    master, exp_avg, exp_avg_sq, grad, param_out, plan: _Plan, h: dict, adamw, bc, options
) -> None:
    """The compiled kernel over the tensors' memory (validated by ``_plan``)."""
    seed = options.stochastic_round_seed
    assert ha._C is not None, "the compiled kernel is loaded (_plan checked it)"
    ha._C.adam_step_states(
        master.data_ptr(),
        _data(exp_avg).data_ptr(),
        _data(exp_avg_sq).data_ptr(),
        0 if plan.state_type != _STATE_Q8 else exp_avg.scales.data_ptr(),
        0 if plan.state_type != _STATE_Q8 else exp_avg_sq.scales.data_ptr(),
        grad.data_ptr(),
        ha._GRAD_CODES[grad.dtype],
        0 if param_out is None else param_out.data_ptr(),
        0 if param_out is None else ha._OUT_CODES[param_out.dtype],
        plan.n,
        plan.master_type,
        plan.state_type,
        plan.block_size,
        h["step"],
        h["lr"],
        h["beta1"],
        h["beta2"],
        h["eps"],
        h["weight_decay"],
        bool(adamw),
        bool(bc),
        h["grad_scale"],
        ha.default_threads() if h["threads"] is None else h["threads"],
        seed is not None,
        0 if seed is None else seed,
        options.index_offset,
    )


def reference_adam_step_states(
    master: torch.Tensor,
    exp_avg: Moment,
    exp_avg_sq: Moment,
    grad: torch.Tensor,
    param_out: torch.Tensor | None = None,
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
    options: StateOptions | None = None,
) -> None:
    """The PyTorch implementation of :func:`adam_step_states` (same arithmetic in fp32, same
    rounding and encoding rules; the fallback without the compiled kernel). PyTorch ops only:
    the tensors may be on any one device (the device update of a compact state runs it on the
    accelerator)."""
    options = _check_options(options)
    _plan(master, exp_avg, exp_avg_sq, grad, param_out, options, cpu=False)
    h = _hyper(step, lr, beta1, beta2, eps, weight_decay, grad_scale, threads)
    _reference_impl(
        master, exp_avg, exp_avg_sq, grad, param_out, options, bool(adamw), bool(bias_correction), h
    )


def _check_options(options: Any) -> StateOptions:
    if options is None:
        return StateOptions()
    if not isinstance(options, StateOptions):
        raise ValueError(f"options must be a StateOptions or None, got {type(options).__name__}")
    return options


def _hyper(step, lr, beta1, beta2, eps, weight_decay, grad_scale, threads) -> dict[str, Any]:
    step = ha._check_int("step", step, "an int >= 1 (1-based step count)")
    if threads is not None:
        threads = ha._check_int("threads", threads, "None or an int >= 1")
    return {
        "step": step,
        "threads": threads,
        "lr": ha._check_number("lr", lr, lo=0.0),
        "beta1": ha._check_number("beta1", beta1, lo=0.0, hi=1.0, hi_open=True),
        "beta2": ha._check_number("beta2", beta2, lo=0.0, hi=1.0, hi_open=True),
        "eps": ha._check_number("eps", eps, lo=0.0),
        "weight_decay": ha._check_number("weight_decay", weight_decay, lo=0.0),
        "grad_scale": ha._check_number("grad_scale", grad_scale),
    }


# The hyperparameters that DeepSpeed's CPU Adam takes as C++ floats (``adam_update``'s arguments,
# ``Adam_Optimizer``'s members in its csrc/includes/cpu_adam.h).
CPU_ADAM_FLOAT_HYPER = ("lr", "beta1", "beta2", "eps", "weight_decay")


def as_cpu_adam_hyper(hyper: dict[str, Any]) -> dict[str, Any]:
    """``hyper`` with lr, betas, eps and weight_decay rounded to fp32, as DeepSpeed's CPU Adam
    holds them: its ``1 - beta2`` is then formed from the fp32 beta2 (1 - 0.999f = 0.00099998713,
    not 0.001). With fp32 moments that is an fp32 ulp of the update; with bf16 moments the 1.3e-5
    relative difference in the second-moment increment flips the rounding of ~0.4% of the stored
    moments at the first step, and the losses drift apart from there. The engine passes these to
    :func:`adam_step_states` for DeepSpeed's compact states; the kernels themselves take any
    values (their coefficients in double precision, rounded once)."""
    out = dict(hyper)
    for k in CPU_ADAM_FLOAT_HYPER:
        if k in out:
            out[k] = float(torch.tensor(float(out[k]), dtype=torch.float32))
    return out


def _load(x: Moment) -> torch.Tensor:
    """fp32 working copy of a state."""
    if isinstance(x, QuantizedMoment):
        return decode_blocks(x.codes, x.scales, x.block_size, x.signed)
    return x.to(torch.float32, copy=True)


def _store(dst: Moment, x: torch.Tensor) -> None:
    if isinstance(dst, QuantizedMoment):
        codes, scales = encode_blocks(x, dst.block_size, dst.signed)
        dst.codes.copy_(codes)
        dst.scales.copy_(scales)
    else:
        dst.copy_(x)  # bf16: round to nearest even


@torch.no_grad()
def _reference_impl(master, exp_avg, exp_avg_sq, grad, param_out, options, adamw, bc, h) -> None:
    g = grad.to(torch.float32, copy=True)  # read before param_out (may alias grad) is written
    p32 = master if master.dtype == torch.float32 else master.to(torch.float32, copy=True)
    m32, v32 = _load(exp_avg), _load(exp_avg_sq)
    ha._reference_impl(p32, m32, v32, g, param_out, adamw=adamw, bias_correction=bc, **h)
    if master.dtype == torch.bfloat16:
        seed = options.stochastic_round_seed
        if seed is None:
            master.copy_(p32)
        else:
            master.view(-1).copy_(stochastic_round_bf16(p32, seed, h["step"], options.index_offset))
    _store(exp_avg, m32)
    _store(exp_avg_sq, v32)
