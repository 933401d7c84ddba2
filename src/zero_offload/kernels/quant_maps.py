"""Blockwise 8-bit Adam moments: the two maps, the quantized-moment type, and the PyTorch
quantize / dequantize that the reference update and the fallback use.

A moment of n values is kept as n uint8 codes and ceil(n / block_size) fp32 scales (the absmax
of each block of ``block_size`` values). A code is the index of a value of the moment's map:
decoded = map[code] * scale. Encoding takes y = x * (1 / absmax) (fp32; 0 for an all-zero block)
and picks the nearest map value: the number of midpoints <= y (ties go to the larger value).

Both maps come from the dynamic (tree) map of Dettmers et al. ("8-bit Optimizers via Block-wise
Quantization", 2021; bitsandbytes' ``create_dynamic_map``): a decimal exponent 1e-6 .. 1 and a
linear fraction, 256 values in [-1, 1] (signed) or [0, 1] (unsigned).

* ``exp_avg`` (signed): the signed dynamic map.
* ``exp_avg_sq`` (unsigned): the unsigned dynamic map of sqrt(exp_avg_sq / absmax), stored as the
  squares of its values, i.e. a map of exp_avg_sq with twice the dynamic range of the plain
  unsigned map (1e-12 instead of 1e-6 of the block's absmax).

docs/kernel.md has the measured errors that chose them. The C++ kernel builds the same tables
with the same double-precision operations (``_host_adam.quant_maps()``; a test checks them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "QuantizedMoment",
    "dequantize_moment",
    "map_tables",
    "quantize_moment",
    "zeros_moment",
]

DEFAULT_BLOCK_SIZE = 256
MIN_BLOCK_SIZE = 32
MAX_BLOCK_SIZE = 256

_POW10 = (1e6, 1e5, 1e4, 1e3, 1e2, 1e1, 1e0)  # exact: 10 ** (6 - i)


def _dynamic_map(signed: bool) -> list[float]:
    data: list[float] = []
    for i in range(7):
        items = (1 << i) + 1 if signed else (1 << (i + 1)) + 1
        for j in range(items - 1):
            b0 = 0.1 + 0.9 * j / (items - 1)
            b1 = 0.1 + 0.9 * (j + 1) / (items - 1)
            value = (b0 + b1) / 2 / _POW10[i]
            data.append(value)
            if signed:
                data.append(-value)
    data += [0.0, 1.0]
    data.sort()
    assert len(data) == 256
    return data


def _tables(values: list[float], squared: bool) -> tuple[torch.Tensor, torch.Tensor]:
    value = torch.tensor([x * x if squared else x for x in values], dtype=torch.float32)
    v64 = value.double()
    mid = ((v64[:-1] + v64[1:]) * 0.5).float()  # exact sum in double, rounded once
    return value, torch.cat([mid, torch.tensor([math.inf])])


_MAPS = {
    True: _tables(_dynamic_map(True), squared=False),  # exp_avg
    False: _tables(_dynamic_map(False), squared=True),  # exp_avg_sq
}


def map_tables(signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(256 map values, 256 midpoints padded with +inf) of the signed (exp_avg) or unsigned
    (exp_avg_sq) map."""
    return _MAPS[bool(signed)]


_ON_DEVICE: dict[tuple[bool, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}


def _tables_on(signed: bool, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``map_tables`` on ``device`` (a moment on the accelerator is encoded and decoded there):
    the CPU tables themselves on the CPU, else one copy per device, made once."""
    if device.type == "cpu":
        return _MAPS[bool(signed)]
    key = (bool(signed), device)
    if key not in _ON_DEVICE:
        _ON_DEVICE[key] = tuple(t.to(device) for t in _MAPS[bool(signed)])  # type: ignore[assignment]
    return _ON_DEVICE[key]


@dataclass(frozen=True)
class QuantizedMoment:
    """An 8-bit Adam moment: ``codes`` (uint8, one per value, contiguous; on the CPU for the
    host kernel, on any one device for the reference) and ``scales`` (fp32, one absmax per block
    of ``block_size`` values). ``signed``: the exp_avg map (True)
    or the exp_avg_sq map (False)."""

    codes: torch.Tensor
    scales: torch.Tensor
    block_size: int = DEFAULT_BLOCK_SIZE
    signed: bool = True

    def numel(self) -> int:
        return self.codes.numel()


def check_block_size(block_size: object, name: str = "block_size") -> int:
    if (
        isinstance(block_size, bool)
        or not isinstance(block_size, int)
        or not MIN_BLOCK_SIZE <= block_size <= MAX_BLOCK_SIZE
        or block_size & (block_size - 1)
    ):
        raise ValueError(
            f"{name} must be a power of two in [{MIN_BLOCK_SIZE}, {MAX_BLOCK_SIZE}], got "
            f"{block_size!r}"
        )
    return block_size


def num_blocks(n: int, block_size: int) -> int:
    return (n + block_size - 1) // block_size


def zeros_moment(n: int, signed: bool, block_size: int = DEFAULT_BLOCK_SIZE) -> QuantizedMoment:
    """A moment of n zeros (the initial Adam state): every byte zero. A block whose scale is 0
    decodes to zeros whatever its codes (``map[code] * 0``; the signed map's code 0 gives -0.0,
    which the first update's ``beta1 * m + (1 - beta1) * g`` turns into ``(1 - beta1) * g``
    exactly), so fresh moments need no pass over their memory: a fresh mapping's zero pages are
    the state as they are, faulted in by the first step that writes them."""
    block_size = check_block_size(block_size)
    return QuantizedMoment(
        codes=torch.zeros(n, dtype=torch.uint8),
        scales=torch.zeros(num_blocks(n, block_size)),
        block_size=block_size,
        signed=bool(signed),
    )


@torch.no_grad()
def encode_blocks(
    x: torch.Tensor, block_size: int, signed: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scales) of the fp32 vector x, as the kernel encodes an updated block (on x's
    device)."""
    n = x.numel()
    pad = (-n) % block_size
    xb = torch.cat([x.float().view(-1), x.new_zeros(pad, dtype=torch.float32)]).view(-1, block_size)
    absx = xb.abs()
    absx = torch.where(torch.isnan(absx), torch.zeros_like(absx), absx)  # NaN never is the absmax
    amax = absx.amax(dim=1)
    inv = torch.where(amax > 0, torch.reciprocal(amax), torch.zeros_like(amax))
    y = xb * inv[:, None]
    mid = _tables_on(signed, x.device)[1][:255]
    codes = torch.searchsorted(mid, y.contiguous(), right=True)
    codes = torch.where(torch.isnan(y), torch.zeros_like(codes), codes)  # NaN -> code 0
    return codes.view(-1)[:n].to(torch.uint8), amax


def decode_blocks(
    codes: torch.Tensor, scales: torch.Tensor, block_size: int, signed: bool
) -> torch.Tensor:
    """fp32 values of (codes, scales), as the kernel decodes a block before its update (on the
    codes' device)."""
    n = codes.numel()
    values = _tables_on(signed, codes.device)[0][codes.view(-1).long()]
    return values * scales.repeat_interleave(block_size)[:n]


def quantize_moment(
    x: torch.Tensor, signed: bool, block_size: int = DEFAULT_BLOCK_SIZE
) -> QuantizedMoment:
    """Quantizes an fp32/bf16 moment (e.g. to convert an fp32 optimizer state)."""
    block_size = check_block_size(block_size)
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise ValueError("x must be a floating-point torch.Tensor")
    codes, scales = encode_blocks(x.detach().cpu().reshape(-1), block_size, bool(signed))
    return QuantizedMoment(codes, scales, block_size, bool(signed))


def dequantize_moment(q: QuantizedMoment) -> torch.Tensor:
    """The fp32 values of an 8-bit moment (e.g. for a checkpoint or the fragment API)."""
    return decode_blocks(q.codes, q.scales, q.block_size, q.signed)
