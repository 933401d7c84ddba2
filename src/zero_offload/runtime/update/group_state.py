"""A group's saved state and its fragments: what ``OptimizerGroup.save / load / fragment`` hand
out, so the checkpoint code and the tensor-fragment API never walk the group's parts.

All three are in shard coordinates (this rank's partition, ``segs`` in order): ``save`` reads
the optimizer state kind by kind, ``load`` writes it, ``fragment`` gives the per-segment views
of the master, the reduced gradient or an optimizer-state key.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ...core.flat_group import FlatGroup
from ...core.state.shard_state import ShardState
from ...nvme.state_range import StateRange
from ..reduce.grad_shard import GradShard
from .shard_optimizer import ShardOptimizer

# The built-in Adam(W)'s state kinds, as a checkpoint names them.
ADAM_KEYS = {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}


@dataclass(frozen=True)
class GroupSave:
    """One group's optimizer state for a checkpoint (read only)."""

    flat: FlatGroup
    segs: list  # this rank's segments, in shard order
    sharded: bool
    step_count: int
    numel: int  # this rank's shard elements
    client: Any  # the client optimizer's update (``checkpoint_spec()``, ``shard(key)``) or None
    state: ShardState
    chunks: list[tuple[int, int]]
    extra: dict[str, torch.Tensor]  # the update's own state (ZenFlow's), saved beside the shard

    def tensor(self, kind: str) -> torch.Tensor | None:
        """State ``kind`` ("master", "exp_avg", "exp_avg_sq") as one tensor, or None where it is
        not stored as one fp32 tensor (on NVMe, a master aliased to several param slices, a
        compact format's bf16 or 8-bit values: read in fp32 by ``pieces``)."""
        return self.state.whole(kind)

    def pieces(self, kind: str) -> Iterator[torch.Tensor]:
        """State ``kind`` chunk by chunk (host memory: one chunk at a time)."""
        return (self.state.read(kind, lo, hi) for lo, hi in self.chunks)

    def client_shard(self, key: str) -> torch.Tensor:
        return self.client.shard(key)


class GroupLoad:
    """One group's optimizer state taken from a checkpoint: ``begin`` (a client optimizer's
    saved spec), ``write`` kind by kind, then ``finish`` with the saved step count (the 16-bit
    params become the master's cast, as after a step)."""

    def __init__(self, optimizer: ShardOptimizer) -> None:
        self._so = optimizer
        self.segs = optimizer.segs
        self.numel = optimizer.state.numel
        client = optimizer.client
        self.client_class = type(client.optimizer).__name__ if client is not None else None

    def begin(self, client_spec: dict | None) -> None:
        if self._so.client is not None:
            self._so.client.prepare_load(client_spec)

    def writer(self, kind: str) -> Callable[[int, torch.Tensor], None]:
        """Where shard ``kind``'s pieces go: the optimizer state, or the client optimizer's."""
        so = self._so
        if kind.startswith("client."):
            key = kind.removeprefix("client.")
            return lambda lo, src: so.client.write(key, lo, src)
        return lambda lo, src: so.state.write(kind, lo, src)

    def extra(self, fetch: Callable[[str], torch.Tensor | None]) -> None:
        """The update's own saved state (``GroupSave.extra``); ``fetch(name)`` is None where
        the checkpoint has none (a run saved without it starts it afresh)."""
        self._so.load_extra_state(fetch)

    def finish(self, step_count: int) -> None:
        self._so.step_count = step_count
        self._so.mend()  # a whole step's state replaced whatever a failed update left
        self._so.params_from_master()


def state_source(state: ShardState, kind: str):
    """``kind`` of a shard state over the whole shard: the tensor, or for a state on NVMe (or
    an aliased master not stored as one tensor, or a compact format's) a range that reads and
    writes it in fp32."""
    t = state.whole(kind)
    if t is not None:
        return t
    return StateRange(state, kind, 0, state.numel)


def state_tensor(so: ShardOptimizer, key: str, fn: str):
    """This rank's shard of optimizer state ``key``: Adam's moments, or with a client optimizer
    (client_update.py) its own state over the master shard. As DeepSpeed: any state tensor shaped
    like the master shard has a key ("step" has none). A Muon group's state is its
    ``"momentum_buffer"`` (DeepSpeed's key; the shard state's ``exp_avg``)."""
    client = so.client
    if client is None:  # the user's key -> the shard state's kind (Muon: its momentum buffer)
        kinds = so.STATE_KEYS
        if key not in kinds:
            _no_key(fn, key, list(kinds), False)
        return state_source(so.state, kinds[key])
    state = client.optimizer.state.get(client.param, {})
    found = {k: v for k, v in state.items() if torch.is_tensor(v) and v.shape == so.master.shape}
    if key not in found:
        _no_key(fn, key, sorted(found), True)
    return found[key]


def _no_key(fn: str, key: str, keys: list[str], client: bool):
    raise ValueError(
        f"{fn}: optim_state_key {key!r} is not in the optimizer state (keys: {keys}"
        + ("; a client optimizer creates its state at its first step)" if client else ")")
    )


def grad_source(gs: GradShard, host_update: bool):
    """The reduced gradient over the whole shard: the device grads per segment (a list), the
    host grad shard, or a partial offload's two parts as one range."""
    if not host_update:
        return gs.device_grads()
    return gs.host_grad() if gs.host_from == 0 else StateRange(TwinGrads(gs), "grad", 0, gs.numel)


class TwinGrads:
    """A partial offload's reduced gradient in shard coordinates, as ``StateRange`` reads and
    writes it: the device part ``[0, host_from)`` in the device grad shard, the rest in the host
    grad shard (whose index 0 is ``host_from``)."""

    def __init__(self, gs: GradShard) -> None:
        self.gs = gs

    def _parts(self, lo: int, hi: int) -> list[torch.Tensor]:
        cut, out = self.gs.host_from, []
        if lo < cut:
            out.append(self.gs.device_shard[lo : min(hi, cut)])
        if hi > cut:
            out.append(self.gs.host_grad()[max(lo, cut) - cut : hi - cut])
        return out

    def read(self, kind: str, lo: int, hi: int) -> torch.Tensor:
        parts = self._parts(lo, hi)
        return parts[0] if len(parts) == 1 else torch.cat([p.cpu() for p in parts])

    def write(self, kind: str, lo: int, src: torch.Tensor) -> None:
        at = 0
        for part in self._parts(lo, lo + src.numel()):
            part.copy_(src[at : at + part.numel()])
            at += part.numel()
