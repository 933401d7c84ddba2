"""A flat group: one optimizer param group's model params laid out in one flat index space.

Stages 0-2 (``materialize=True``): the params are re-homed as views of one flat buffer on the
device. Invariant: after ``bind()`` every param's ``.data`` is a view of ``flat`` at its layout
offset, so anything written into ``flat`` (an all-gather, a copy from the master shard) is what
the module computes with, and no other copy of the params exists on the device.

Stage 3 (``materialize=False``): no full flat buffer exists; ``flat`` is None and the group only
defines the index space (layout, segments) that the param store and the shard optimizer share.
"""

from __future__ import annotations

import torch

from .layout import FlatLayout, Segment, build_layout


class FlatGroup:
    def __init__(
        self,
        index: int,
        params: list[torch.nn.Parameter],
        names: list[str],
        hyper: dict,
        dtype: torch.dtype,
        device: torch.device,
        world_size: int,
        rank: int,
        bucket_size: int,
        align: int = 16,
        layout: FlatLayout | None = None,
        materialize: bool = True,
    ) -> None:
        self.index = index
        self.params = self.flat_order(params)
        self.names = self.flat_order(names)
        self.hyper = hyper  # lr, betas, eps, weight_decay, ... (shared with the optimizer group)
        self.dtype = dtype
        self.device = device
        self.rank = rank
        self.layout: FlatLayout = layout or build_layout(
            [p.numel() for p in self.params], world_size, bucket_size, align
        )
        self.flat: torch.Tensor | None = None
        if materialize:
            self.flat = torch.zeros(self.layout.total, dtype=dtype, device=device)
            self._bind()

    @staticmethod
    def flat_order(items: list) -> list:
        """Flat order = reverse registration order: the order backward produces gradients."""
        return list(reversed(items))

    def _bind(self) -> None:
        with torch.no_grad():
            for p, off in zip(self.params, self.layout.offsets):
                view = self.flat[off : off + p.numel()].view(p.shape)
                view.copy_(p.data)
                p.data = view

    def param_views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views of any tensor laid out like ``flat`` (a flat grad buffer, say), one per param."""
        return [
            flat[off : off + p.numel()].view(p.shape)
            for p, off in zip(self.params, self.layout.offsets)
        ]

    def segments(self, sharded: bool) -> tuple[Segment, ...]:
        return self.layout.segments(self.rank) if sharded else self.layout.whole_segments()

    def shard_numel(self, sharded: bool) -> int:
        return self.layout.shard_numel if sharded else self.layout.total
