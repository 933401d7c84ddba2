"""The optimizer object users and LR schedulers see.

A ``torch.optim.Optimizer`` whose ``param_groups`` are the flat groups' hyperparameter dicts (the
same dict objects), so a scheduler writing ``group["lr"]`` changes what the next update uses. The
update itself is the engine's business: ``step()`` here is refused, as calling it outside the
engine would skip gradient reduction.
"""

from __future__ import annotations

import torch

from .flat_group import FlatGroup
from .shard_optimizer import ShardOptimizer


class ZeroOptimizer(torch.optim.Optimizer):
    def __init__(self, groups: list[FlatGroup], shards: list[ShardOptimizer]) -> None:
        defaults = {k: v for k, v in groups[0].hyper.items() if k != "params"}
        super().__init__(
            [
                {**{k: v for k, v in g.hyper.items() if k != "params"}, "params": g.params}
                for g in groups
            ],
            defaults,
        )
        # torch copied the dicts; point param_groups at the live hyper dicts instead.
        for g, pg in zip(groups, self.param_groups):
            g.hyper.update(pg)
            g.hyper["params"] = g.params
        self.param_groups = [g.hyper for g in groups]
        self.flat_groups = groups
        self.shards = shards

    def step(self, closure=None):  # noqa: D401
        raise RuntimeError(
            "call engine.step(), not optimizer.step(): the engine reduces gradients first"
        )

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Gradients live in engine-owned buffers; the engine clears them after each step."""
