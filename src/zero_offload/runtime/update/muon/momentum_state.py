"""The shard state of a Muon group: the master shard (a ``MemoryState`` or an ``AliasState``
built without moments) and one momentum buffer, Muon's only optimizer state (4 bytes per
element, not Adam's 8).

The momentum answers as the state's ``exp_avg``, so the checkpoint format and its re-slicing
are the Adam state's; ``exp_avg_sq`` holds nothing: read, it is zeros (a Muon checkpoint's
``exp_avg_sq`` is all zero), and a write of it is dropped.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ....core.layout import Segment
from ....core.state.shard_state import Body, Chunk, InMemory, ShardState


class MomentumState(InMemory):
    exp_avg_sq = None  # no second moment: the checkpoint reads it through ``read`` (zeros)

    def __init__(self, inner: ShardState) -> None:
        """``inner``: the master shard, built with no moments."""
        self.inner, self.numel, self.where = inner, inner.numel, inner.where
        self.aliased = inner.aliased
        assert not inner.transactional, "Muon keeps no state on NVMe (the config refuses it)"
        device = inner.exp_avg.device  # the inner state's (empty) moments sit where it does
        self.exp_avg = torch.zeros(self.numel, dtype=torch.float32, device=device)

    def parts(self) -> list:
        return [self]

    def close(self) -> None:
        self.inner.close()

    def fill(self, master_of) -> None:
        self.inner.fill(master_of)

    @property
    def master(self) -> torch.Tensor | None:
        return self.inner.master

    def views(self, kind: str, segs: tuple[Segment, ...]) -> list[torch.Tensor]:
        """As ``AliasState.views``: the master's from the inner state, the momentum's here."""
        if kind == "master":
            return self.inner.views(kind, segs)
        return [self.exp_avg[s.shard_start : s.shard_start + s.numel] for s in segs]

    def update(
        self,
        chunks: list[Chunk],
        body: Body,
        write: bool = True,
        before_commit: Callable[[], None] | None = None,
        commit: bool = True,
    ) -> None:
        def with_momentum(lo: int, hi: int, views: dict[str, torch.Tensor]) -> None:
            views = {**views, "exp_avg": self.exp_avg[lo:hi], "exp_avg_sq": self._zeros(lo, hi)}
            body(lo, hi, views)

        self.inner.update(chunks, with_momentum, write, before_commit, commit)

    def read(self, kind: str, lo: int, hi: int) -> torch.Tensor:
        if kind == "master":
            return self.inner.read(kind, lo, hi)
        return self.exp_avg[lo:hi] if kind == "exp_avg" else self._zeros(lo, hi)

    def write(self, kind: str, lo: int, src: torch.Tensor) -> None:
        if kind == "master":
            self.inner.write(kind, lo, src)
        elif kind == "exp_avg":
            self.exp_avg[lo : lo + src.numel()].copy_(src)

    def _zeros(self, lo: int, hi: int) -> torch.Tensor:
        return torch.zeros(hi - lo, dtype=torch.float32, device=self.exp_avg.device)

    def nbytes(self) -> dict[str, int]:
        out = {k: v for k, v in self.inner.nbytes().items() if not k.endswith("optimizer_state")}
        out[f"{self.where}.optimizer_state"] = self.exp_avg.numel() * 4
        return out
