"""The update of a Muon param group (``"optimizer": {"type": "Muon"}``, params with
``use_muon`` true), on the device at stages 0-2.

Muon's step needs each param's whole matrix, but its momentum is elementwise. So the momentum
buffer is sharded exactly like Adam's ``exp_avg`` (it answers as the shard state's ``exp_avg``,
``momentum_state.py``; the checkpoint saves and reslices it as one) and the step is:

1. on this rank's grad shard (unscale x clip applied first, as ``clip_grad_norm_`` before a
   torch optimizer's step): momentum <- lerp(momentum, g, 1 - beta) and the Nesterov
   look-ahead u = lerp(g, momentum, beta), both elementwise;
2. u's shards all-gathered per bucket into a full flat buffer (every rank then holds every
   muon param's whole u; stage 0 already holds it);
3. for each param that meets this rank's partition: Newton-Schulz on its whole u (the same
   matrix, so the same result, on every rank that owns a piece of it);
4. this rank's slice of the result applied to its master shard:
   p <- p * (1 - lr * weight_decay) - lr * O.

Invariant: the full buffer of step 2 lives only during the step (the working set: 4 bytes per
element of the group's flat buffer, plus Newton-Schulz's temporaries of one matrix).
"""

from __future__ import annotations

import torch

from ...core import dist
from .muon_math import momentum_step, orthogonalized
from .shard_optimizer import ShardOptimizer


class MuonUpdate(ShardOptimizer):
    # The state the fragment API names (DeepSpeed's key) -> the shard state's kind.
    STATE_KEYS = {"momentum_buffer": "exp_avg"}

    def _apply(self, factor: float) -> None:
        h = self.group.hyper
        lr, wd = float(h["lr"]), float(h["weight_decay"])
        full = self._lookahead(factor, float(h["momentum"]))
        self._orthogonalize(full, str(h["ns_method"]))
        master = self.state.views("master", self.segs) if self.aliased else self._views(self.master)
        for seg, p in zip(self.segs, master):
            if wd:
                p.mul_(1.0 - lr * wd)
            p.add_(full[seg.flat_start : seg.flat_start + seg.numel], alpha=-lr)
        if not self.aliased:
            self.home.write(0, self.master)

    def _views(self, t: torch.Tensor) -> list[torch.Tensor]:
        return [t[s.shard_start : s.shard_start + s.numel] for s in self.segs]

    def _lookahead(self, factor: float, beta: float) -> torch.Tensor:
        """Steps 1-2: the momentum shard updated and the whole group's look-ahead u, laid out
        like the flat buffer (padding zero)."""
        layout = self.group.layout
        full = torch.zeros(layout.total, dtype=torch.float32, device=self.state.exp_avg.device)
        for seg, g, m in zip(self.segs, self.grads.device_grads(self.segs), self._momentum()):
            g = g.float() * factor  # a new tensor: the reduced gradient is left as it was
            momentum_step(g, m, beta, full[seg.flat_start : seg.flat_start + seg.numel])
        if self.sharded and dist.world_size() > 1:
            rank = self.group.rank
            for b in layout.buckets:  # rank r's slice of bucket b is its r-th slice_numel
                n = b.slice_numel
                own = full[b.start + rank * n : b.start + (rank + 1) * n]
                dist.all_gather(full[b.start : b.start + b.numel], own, what="muon look-ahead")
        return full

    def _momentum(self) -> list[torch.Tensor]:
        return self._views(self.state.exp_avg)

    def _orthogonalize(self, full: torch.Tensor, ns_method: str) -> None:
        """Step 3, in place in ``full``: each param this rank owns a piece of becomes its
        orthogonalized update; the others are left (this rank reads none of them)."""
        layout = self.group.layout
        for p, off, n in zip(self.group.params, layout.offsets, layout.numels):
            if not any(s.flat_start < off + n and off < s.flat_start + s.numel for s in self.segs):
                continue
            view = full[off : off + n]
            view.copy_(orthogonalized(view.view(p.shape), ns_method).reshape(-1))
