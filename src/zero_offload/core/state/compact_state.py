"""The shard state in a compact format (``format.py``): a bf16 master (DeepSpeed's
``bf16_master_weights_and_grads``) and/or bf16 moments (``bf16_optimizer_states``) or 8-bit
moments (``Adam8bit`` / ``AdamW8bit``: uint8 codes plus one fp32 absmax per block), in host
memory (``offload_optimizer`` "cpu", the SIMD kernel of ``kernels/adam_states.py``) or on the
device (the same arithmetic in PyTorch).

Invariants:
- ``update`` gives the body each chunk's views in their own element types (a bf16 tensor, or a
  ``QuantizedMoment`` whose codes and scales are views of whole blocks: every chunk but the
  last is a multiple of the block); the rule's kernel takes them as they are;
- ``read`` and ``write`` speak fp32 (checkpoints, the fragment API, conversions): ``read``
  decodes, ``write`` encodes; an 8-bit write that does not cover whole blocks re-encodes the
  blocks it touches from their decoded values;
- the memory report counts what is allocated: master, codes and scales.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ...kernels.quant_maps import QuantizedMoment, decode_blocks, encode_blocks, zeros_moment
from .format import StateFormat
from .shard_state import FILL_PIECE, KINDS, Body, Chunk, Fill, InMemory

Moment = torch.Tensor | QuantizedMoment


class CompactState(InMemory):
    aliased = False

    def __init__(self, numel: int, device: torch.device, where: str, fmt: StateFormat) -> None:
        self.numel, self.where, self.format = numel, where, fmt
        self.master_dtype = fmt.master
        self.master = torch.empty(numel, dtype=fmt.master, device=device)
        self.exp_avg = self._zeros(numel, device, signed=True)
        self.exp_avg_sq = self._zeros(numel, device, signed=False)

    def _zeros(self, n: int, device: torch.device, signed: bool) -> Moment:
        fmt = self.format
        if fmt.moments == "8bit":
            q = zeros_moment(n, signed, fmt.block)
            return QuantizedMoment(q.codes.to(device), q.scales.to(device), fmt.block, signed)
        dtype = torch.bfloat16 if fmt.moments == "bf16" else torch.float32
        return torch.zeros(n, dtype=dtype, device=device)

    def parts(self) -> list:
        return [self]

    def close(self) -> None:
        """Memory: freed with the object."""

    def fill(self, master_of: Fill) -> None:
        for lo in range(0, self.numel, FILL_PIECE):
            hi = min(lo + FILL_PIECE, self.numel)
            if self.master.dtype == torch.float32:
                master_of(lo, hi, self.master[lo:hi])
            else:  # the 16-bit home's values are bf16 already: exact either way
                tmp = torch.empty(hi - lo, dtype=torch.float32, device=self.master.device)
                master_of(lo, hi, tmp)
                self.master[lo:hi].copy_(tmp)

    def tensor(self, kind: str) -> Moment:
        return getattr(self, kind)

    def _view(self, kind: str, lo: int, hi: int) -> Moment:
        t = self.tensor(kind)
        if not isinstance(t, QuantizedMoment):
            return t[lo:hi]
        b = t.block_size
        assert lo % b == 0 and (hi % b == 0 or hi == self.numel), "chunks hold whole blocks"
        return QuantizedMoment(t.codes[lo:hi], t.scales[lo // b : -(-hi // b)], b, t.signed)

    def update(
        self,
        chunks: list[Chunk],
        body: Body,
        write: bool = True,
        before_commit: Callable[[], None] | None = None,
        commit: bool = True,
    ) -> None:
        for lo, hi in chunks:
            body(lo, hi, {k: self._view(k, lo, hi) for k in KINDS})  # type: ignore[misc]
        if before_commit is not None:
            before_commit()

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
        out = {}
        for kind in ("exp_avg", "exp_avg_sq"):
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

    def nbytes(self) -> dict[str, int]:
        def size(m: Moment) -> int:
            if isinstance(m, QuantizedMoment):
                return m.codes.numel() + m.scales.numel() * 4
            return m.numel() * m.element_size()

        return {
            f"{self.where}.master_shard": self.master.numel() * self.master.element_size(),
            f"{self.where}.optimizer_state": size(self.exp_avg) + size(self.exp_avg_sq),
        }
