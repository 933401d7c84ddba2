"""The rule of a Muon param group (``"optimizer": {"type": "Muon"}``, params with ``use_muon``
true) at stages 0-3: ``MuonRule``, run by the device update with its state on the device, or by
the host update with its state in host memory (``offload_optimizer`` "cpu"; then only the
look-ahead's and the orthogonalized update's slices of this rank cross the bus, 4 bytes per
element each way, and the updated master reaches the home through the host update's staging).
The delayed update is not built for Muon (step 2's all-gather is a collective the worker thread
would issue behind the next forward's): the config refuses it by key.

Muon's step needs each param's whole matrix, but its momentum is elementwise. So the momentum
buffer is sharded exactly like Adam's ``exp_avg`` (it answers as the shard state's ``exp_avg``,
``momentum_state.py``; the checkpoint saves and reslices it as one) and the step is:

1. on this rank's grad shard (unscale x clip applied first, as ``clip_grad_norm_`` before a
   torch optimizer's step), where the state lives: momentum <- lerp(momentum, g, 1 - beta) and
   the Nesterov look-ahead u = lerp(g, momentum, beta), both elementwise;
2. u's shards, on the device, all-gathered per bucket into a full flat buffer (every rank then
   holds every muon param's whole u; stage 0 already holds it);
3. for each param that meets this rank's partition: Newton-Schulz on its whole u on the device
   (the same matrix, so the same result, on every rank that owns a piece of it);
4. this rank's slice of the result, brought to where the master lives, applied to it:
   p <- p * (1 - lr * weight_decay) - lr * O.

Invariant: the full buffer of step 2 lives only during the step (the working set: 4 bytes per
element of the group's flat buffer on the device, plus Newton-Schulz's temporaries of one
matrix; with the state on the host, also one segment's u and O in host memory at a time).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ....core import dist
from .muon_math import momentum_step, orthogonalized

if TYPE_CHECKING:
    from ..shard_optimizer import ShardOptimizer


class MuonRule:
    """Muon's step over an update's segments, wherever its state lives: the update gives each
    segment's reduced gradient and master view in the state's memory (``grad_views``,
    ``master_views``) and refreshes its home after (``write_home``)."""

    # The state the fragment API names (DeepSpeed's key) -> the shard state's kind.
    STATE_KEYS = {"momentum_buffer": "exp_avg"}

    def __init__(self) -> None:
        self._owned_cache: list[tuple[torch.Size, int, int]] | None = None

    def apply(self, u: ShardOptimizer, factor: float, commit: bool = True) -> None:
        assert commit, "Muon's state is in memory"
        self.step(u, factor, u.grad_views(), u.master_views())
        u.write_home()

    def step(
        self,
        u: ShardOptimizer,
        factor: float,
        grads: list[torch.Tensor],
        masters: list[torch.Tensor],
    ) -> None:
        h = u.group.hyper
        lr, wd = float(h["lr"]), float(h["weight_decay"])
        full = self._lookahead(u, grads, factor, float(h["momentum"]))
        self._orthogonalize(u, full, str(h["ns_method"]))
        for seg, p in zip(u.segs, masters):
            if wd:
                p.mul_(1.0 - lr * wd)
            update = full[seg.flat_start : seg.flat_start + seg.numel]
            p.add_(update.to(p.device), alpha=-lr)  # the device's slice to the master's memory

    def _lookahead(
        self, u: ShardOptimizer, grads: list[torch.Tensor], factor: float, beta: float
    ) -> torch.Tensor:
        """Steps 1-2: the momentum shard updated and the whole group's look-ahead u, on the
        device, laid out like the flat buffer (padding zero)."""
        layout = u.group.layout
        full = torch.zeros(layout.total, dtype=torch.float32, device=u.group.device)
        momenta = [u.state.exp_avg[s.shard_start : s.shard_start + s.numel] for s in u.segs]
        for seg, g, m in zip(u.segs, grads, momenta):
            g = g.float() * factor  # a new tensor: the reduced gradient is left as it was
            dst = full[seg.flat_start : seg.flat_start + seg.numel]
            out = dst if m.device == dst.device else torch.empty_like(m)
            momentum_step(g, m, beta, out)
            if out is not dst:  # computed where the state lives, then to the device
                dst.copy_(out)
        if u.sharded and dist.world_size() > 1:
            rank = u.group.rank
            for b in layout.buckets:  # rank r's slice of bucket b is its r-th slice_numel
                n = b.slice_numel
                own = full[b.start + rank * n : b.start + (rank + 1) * n]
                dist.all_gather(full[b.start : b.start + b.numel], own, what="muon look-ahead")
        return full

    def _orthogonalize(self, u: ShardOptimizer, full: torch.Tensor, ns_method: str) -> None:
        """Step 3, in place in ``full``: each param this rank owns a piece of becomes its
        orthogonalized update; the others are left (this rank reads none of them)."""
        for shape, off, n in self._owned(u):
            view = full[off : off + n]
            view.copy_(orthogonalized(view.view(shape), ns_method).reshape(-1))

    def _owned(self, u: ShardOptimizer) -> list[tuple[torch.Size, int, int]]:
        """(shape, flat offset, numel) of each param this rank owns a piece of, found once: the
        partition is fixed for the run (no params x segments scan per step)."""
        if self._owned_cache is None:
            layout, segs = u.group.layout, u.segs
            self._owned_cache = [
                (getattr(p, "ds_shape", p.shape), off, n)  # stage 3: p itself is empty
                for p, off, n in zip(u.group.params, layout.offsets, layout.numels)
                if any(s.flat_start < off + n and off < s.flat_start + s.numel for s in segs)
            ]
        return self._owned_cache
