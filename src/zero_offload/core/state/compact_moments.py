"""Adam's two moments in a state format (``format.py``): fp32 or bf16 tensors, or 8-bit
``QuantizedMoment``s (uint8 codes plus one fp32 absmax per block), in device or host memory.

One object for the moments of a shard, so that a state with a master of its own
(``compact_state.py``) and one whose master is the params (``alias_state.py``) keep them alike.

Invariants:
- ``view(kind, lo, hi)`` is the range in its own element type (the update's operand): a tensor
  view, or a ``QuantizedMoment`` whose codes and scales view whole blocks (``lo`` on a block
  boundary, ``hi`` too unless it is the end);
- ``read`` and ``write`` speak fp32: ``read`` decodes, ``write`` encodes; an 8-bit write that does
  not cover whole blocks re-encodes the blocks it touches from their decoded values;
- ``nbytes`` counts what is allocated (codes and scales for 8-bit).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ...kernels.quant_maps import (
    QuantizedMoment,
    decode_blocks,
    encode_blocks,
    num_blocks,
)
from .. import host_memory
from .format import StateFormat
from .shard_state import DeviceAlloc

Moment = torch.Tensor | QuantizedMoment
MOMENT_KINDS = ("exp_avg", "exp_avg_sq")


class CompactMoments:
    def __init__(
        self, numel: int, device: torch.device, fmt: StateFormat, where: str = "device"
    ) -> None:
        """Zero moments of ``numel`` elements on ``device`` in ``fmt``'s moment type; in host
        memory (``where`` "host") mappings of their own, outside malloc's heap."""
        self.numel, self.format = numel, fmt
        self.exp_avg = self._zeros(device, signed=True, host=where == "host")
        self.exp_avg_sq = self._zeros(device, signed=False, host=where == "host")

    def _zeros(self, device: torch.device, signed: bool, host: bool) -> Moment:
        fmt, n = self.format, self.numel
        alloc = host_memory if host else DeviceAlloc  # not kept: a module does not copy
        if fmt.moments == "8bit":  # zero codes and scales, as zeros_moment: untouched pages
            codes = alloc.zeros(n, torch.uint8, device)
            scales = alloc.zeros(num_blocks(n, fmt.block), torch.float32, device)
            return QuantizedMoment(codes, scales, fmt.block, signed)
        dtype = torch.bfloat16 if fmt.moments == "bf16" else torch.float32
        return alloc.zeros(n, dtype, device)

    def tensor(self, kind: str) -> Moment:
        return getattr(self, kind)

    def view(self, kind: str, lo: int, hi: int) -> Moment:
        t = self.tensor(kind)
        if not isinstance(t, QuantizedMoment):
            return t[lo:hi]
        b = t.block_size
        assert lo % b == 0 and (hi % b == 0 or hi == self.numel), "ranges hold whole blocks"
        return QuantizedMoment(t.codes[lo:hi], t.scales[lo // b : -(-hi // b)], b, t.signed)

    def read(self, kind: str, lo: int, hi: int) -> torch.Tensor:
        """Elements ``[lo, hi)`` of ``kind`` in fp32 (a copy unless the kind is fp32)."""
        t = self.tensor(kind)
        if not isinstance(t, QuantizedMoment):
            return t[lo:hi] if t.dtype == torch.float32 else t[lo:hi].float()
        b = t.block_size
        a, z = lo - lo % b, min(self.numel, -(-hi // b) * b)  # the whole blocks around it
        values = decode_blocks(t.codes[a:z], t.scales[a // b : -(-z // b)], b, t.signed)
        return values[lo - a : hi - a]

    def write(self, kind: str, lo: int, src: torch.Tensor) -> None:
        t, hi = self.tensor(kind), lo + src.numel()
        if not isinstance(t, QuantizedMoment):
            t[lo:hi].copy_(src)
            return
        b = t.block_size
        a, z = lo - lo % b, min(self.numel, -(-hi // b) * b)
        if (a, z) != (lo, hi):  # blocks only partly written: their other values kept
            whole = self.read(kind, a, z).clone()
            whole[lo - a : hi - a] = src.to(whole.device, torch.float32)
            src = whole
        codes, scales = encode_blocks(src.to(torch.float32).cpu(), b, t.signed)
        t.codes[a:z].copy_(codes)
        t.scales[a // b : -(-z // b)].copy_(scales)

    def raw(self) -> dict[str, torch.Tensor]:
        """The 8-bit codes and scales by name (what ``read``'s fp32 does not give back)."""
        out = {}
        for kind in MOMENT_KINDS:
            t = self.tensor(kind)
            if isinstance(t, QuantizedMoment):
                out[f"{kind}.codes"], out[f"{kind}.scales"] = t.codes, t.scales
        return out

    def load_raw(self, fetch: Callable[[str], torch.Tensor | None]) -> None:
        for name, t in self.raw().items():
            saved = fetch(name)
            if saved is not None:
                if saved.shape != t.shape or saved.dtype != t.dtype:
                    raise ValueError(f"{name}: saved {saved.dtype}{list(saved.shape)}, this shard "
                                     f"keeps {t.dtype}{list(t.shape)}")  # fmt: skip
                t.copy_(saved)

    def tensors(self) -> list[torch.Tensor]:
        """Every allocated tensor (``offload_states`` moves their storages)."""
        out: list[torch.Tensor] = []
        for kind in MOMENT_KINDS:
            t = self.tensor(kind)
            out += [t.codes, t.scales] if isinstance(t, QuantizedMoment) else [t]
        return out

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())
