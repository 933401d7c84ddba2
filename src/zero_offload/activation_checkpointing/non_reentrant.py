"""``non_reentrant_checkpoint(function, *args)``: torch's non-reentrant checkpoint (saved-tensor
hooks, no nested backward; it works when no input requires grad) with DeepSpeed's rules on top:

- the arguments reach torch inside one carrier object, so torch keeps no tensor of them: the
  forward runs on the caller's tensors (its graph leads to them), and the recompute on the
  carrier's ``Stash`` (on the device, or with ``cpu_checkpointing`` in host memory, brought
  back with each tensor's ``requires_grad``, so every op saves what it saved in the forward);
- the random states are this package's snapshot (the default generators and the model-parallel
  tracker's states, which torch does not know), replayed around the recompute."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.utils.checkpoint as torch_checkpoint

from .boundary import boundary
from .rng import RngSnapshot
from .settings import SETTINGS
from .stash import Stash


class _Arguments:
    """The checkpoint's arguments: the caller's until its forward returns, then the stash."""

    def __init__(self, args: tuple, to_host: bool) -> None:
        self.live: tuple | None = args
        self.stash = Stash(args, to_host) if torch.is_grad_enabled() else None

    def take(self) -> tuple:
        return self.live if self.live is not None else tuple(self.stash.restore())


def _contexts() -> tuple[contextlib.AbstractContextManager, ...]:
    """torch's ``context_fn``: the forward's context takes the random states, the recompute's
    replays them (within the policy's boundary: synchronized, timed)."""
    taken: dict[str, RngSnapshot] = {}
    policy = SETTINGS.policy

    @contextlib.contextmanager
    def forward() -> Iterator[None]:
        taken["rng"] = RngSnapshot.take()
        yield

    @contextlib.contextmanager
    def recompute() -> Iterator[None]:
        with boundary(policy, "recompute"), taken["rng"].replayed():
            yield

    return forward(), recompute()


def non_reentrant_checkpoint(function: Callable, *args: Any):
    policy = SETTINGS.policy
    carrier = _Arguments(args, policy.cpu_checkpointing)

    def run(arguments: _Arguments):
        out = function(*arguments.take())
        arguments.live = None  # from here on only the stash holds the arguments
        return out

    with boundary(policy, "forward"):
        return torch_checkpoint.checkpoint(
            run, carrier, use_reentrant=False, preserve_rng_state=False, context_fn=_contexts
        )
