"""The update of a Muon param group (``"optimizer": {"type": "Muon"}``, params with
``use_muon`` true) at stages 0-3: ``MuonUpdate`` with its state on the device, and the same
steps (``MuonSteps``) under ``HostMuonUpdate`` (``host_muon_update.py``) with its state in host
memory (``offload_optimizer`` "cpu").

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

import torch

from ....core import dist
from ..shard_optimizer import ShardOptimizer
from .muon_math import momentum_step, orthogonalized


class MuonSteps:
    """Muon's step over a ``ShardOptimizer``'s segments, wherever its state lives; the
    subclass gives each segment's reduced gradient and master view in the state's memory."""

    # The state the fragment API names (DeepSpeed's key) -> the shard state's kind.
    STATE_KEYS = {"momentum_buffer": "exp_avg"}

    def _muon_step(
        self, factor: float, grads: list[torch.Tensor], masters: list[torch.Tensor]
    ) -> None:
        h = self.group.hyper
        lr, wd = float(h["lr"]), float(h["weight_decay"])
        full = self._lookahead(grads, factor, float(h["momentum"]))
        self._orthogonalize(full, str(h["ns_method"]))
        for seg, p in zip(self.segs, masters):
            if wd:
                p.mul_(1.0 - lr * wd)
            update = full[seg.flat_start : seg.flat_start + seg.numel]
            p.add_(update.to(p.device), alpha=-lr)  # the device's slice to the master's memory

    def _views(self, t: torch.Tensor) -> list[torch.Tensor]:
        return [t[s.shard_start : s.shard_start + s.numel] for s in self.segs]

    def _lookahead(self, grads: list[torch.Tensor], factor: float, beta: float) -> torch.Tensor:
        """Steps 1-2: the momentum shard updated and the whole group's look-ahead u, on the
        device, laid out like the flat buffer (padding zero)."""
        layout = self.group.layout
        full = torch.zeros(layout.total, dtype=torch.float32, device=self.group.device)
        for seg, g, m in zip(self.segs, grads, self._views(self.state.exp_avg)):
            g = g.float() * factor  # a new tensor: the reduced gradient is left as it was
            dst = full[seg.flat_start : seg.flat_start + seg.numel]
            out = dst if m.device == dst.device else torch.empty_like(m)
            momentum_step(g, m, beta, out)
            if out is not dst:  # computed where the state lives, then to the device
                dst.copy_(out)
        if self.sharded and dist.world_size() > 1:
            rank = self.group.rank
            for b in layout.buckets:  # rank r's slice of bucket b is its r-th slice_numel
                n = b.slice_numel
                own = full[b.start + rank * n : b.start + (rank + 1) * n]
                dist.all_gather(full[b.start : b.start + b.numel], own, what="muon look-ahead")
        return full

    def _orthogonalize(self, full: torch.Tensor, ns_method: str) -> None:
        """Step 3, in place in ``full``: each param this rank owns a piece of becomes its
        orthogonalized update; the others are left (this rank reads none of them)."""
        for shape, off, n in self._owned():
            view = full[off : off + n]
            view.copy_(orthogonalized(view.view(shape), ns_method).reshape(-1))

    def _owned(self) -> list[tuple[torch.Size, int, int]]:
        """(shape, flat offset, numel) of each param this rank owns a piece of, found once: the
        partition is fixed for the run (no params x segments scan per step)."""
        owned = getattr(self, "_muon_owned", None)
        if owned is None:
            layout = self.group.layout
            owned = [
                (getattr(p, "ds_shape", p.shape), off, n)  # stage 3: p itself is empty
                for p, off, n in zip(self.group.params, layout.offsets, layout.numels)
                if any(s.flat_start < off + n and off < s.flat_start + s.numel for s in self.segs)
            ]
            self._muon_owned = owned
        return owned


class MuonUpdate(MuonSteps, ShardOptimizer):
    """The state on the device (an fp32 group's master may be the params themselves)."""

    def _apply(self, factor: float) -> None:
        master = self.state.views("master", self.segs) if self.aliased else self._views(self.master)
        self._muon_step(factor, self.grads.device_grads(self.segs), master)
        if not self.aliased:
            self.home.write(0, self.master)
