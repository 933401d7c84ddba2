"""``non_reentrant_checkpoint(function, *args)``: torch's non-reentrant checkpoint (saved-tensor
hooks, no nested backward; works when no input requires grad) with DeepSpeed's random-state
rule: the recompute also replays the model-parallel tracker's states, which torch does not know.
The inputs stay where they are (``cpu_checkpointing`` applies to the reentrant ``checkpoint``)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch.utils.checkpoint as torch_checkpoint

from .boundary import boundary
from .rng import TRACKER
from .settings import SETTINGS


def _tracker_contexts() -> tuple[contextlib.AbstractContextManager, ...]:
    taken: dict[str, Any] = {}

    @contextlib.contextmanager
    def forward() -> Iterator[None]:
        taken["states"] = TRACKER.get_states()
        yield

    @contextlib.contextmanager
    def recompute() -> Iterator[None]:
        now = TRACKER.get_states()
        TRACKER.set_states(taken["states"])
        try:
            yield
        finally:
            TRACKER.set_states(now)

    return forward(), recompute()


def non_reentrant_checkpoint(function: Callable, *args: Any):
    with boundary(SETTINGS.policy, "forward"):
        return torch_checkpoint.checkpoint(
            function,
            *args,
            use_reentrant=False,
            preserve_rng_state=True,
            context_fn=_tracker_contexts,
        )
