"""A range of one kind of an NVMe-resident optimizer state, standing in for a tensor view where
the fragment accessors (``utils/tensor_fragment.py``) slice, read and write this rank's pieces:
reads come from the swap file, writes go to it (read-modify-write of the committed version)."""

from __future__ import annotations

import torch


class StateRange:
    def __init__(self, state, kind: str, start: int, numel: int) -> None:
        self.state, self.kind, self.start, self.n = state, kind, start, numel

    def __getitem__(self, sl: slice) -> StateRange:
        lo, hi, step = sl.indices(self.n)
        assert step == 1, "contiguous ranges only"
        return StateRange(self.state, self.kind, self.start + lo, max(0, hi - lo))

    def numel(self) -> int:
        return self.n

    def read(self) -> torch.Tensor:
        return self.state.read(self.kind, self.start, self.start + self.n)

    def to(self, *args, **kwargs) -> torch.Tensor:
        return self.read().to(*args, **kwargs)

    def copy_(self, src: torch.Tensor) -> StateRange:
        if src.numel() != self.n:
            raise ValueError(f"{self.kind}: {src.numel()} elements for a range of {self.n}")
        self.state.write(self.kind, self.start, src)
        return self
