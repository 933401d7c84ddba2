"""The rule: what a group's update computes, chosen once when the group is built, run by any
placement's update (``shard_optimizer.py``) over the state where it lives.

- ``AdamRule``: Adam(W) by the placement's own kernel (torch's fused Adam on the accelerator,
  the SIMD host kernel chunk by chunk on the host);
- ``ClientRule``: a client ``torch.optim.Optimizer`` over this rank's master segments
  (``paths/client_update.py``), then the home refreshed from the master;
- ``MuonRule``: Muon's step (``muon/muon_update.py``), then the home refreshed;
- ``TwinRule``: partial offload's two parts side by side (``paths/twin_update.py``).

Invariant: a rule changes the master, the moments and the param home only through the update's
own methods; it holds no state of the step (the state kind does).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from .shard_optimizer import ShardOptimizer

ADAM_KEYS = {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}


class Rule(Protocol):
    # The fragment API's optimizer-state keys -> the shard state's kinds.
    STATE_KEYS: dict[str, str]

    def apply(self, u: ShardOptimizer, factor: float, commit: bool = True) -> None: ...


class AdamRule:
    STATE_KEYS = ADAM_KEYS

    def apply(self, u: ShardOptimizer, factor: float, commit: bool = True) -> None:
        u.adam(factor, commit)


class ClientRule:
    """The client's state is its own (``ClientUpdate``); the shard state keeps no moments."""

    STATE_KEYS = ADAM_KEYS

    def apply(self, u: ShardOptimizer, factor: float, commit: bool = True) -> None:
        assert u.client is not None and commit, "a client optimizer runs in memory"
        u.client.step([(s.shard_start, g) for s, g in zip(u.segs, u.grad_views())], factor)
        u.write_home()
